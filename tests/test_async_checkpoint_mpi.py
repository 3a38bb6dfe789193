"""Background checkpoint saves across real processes (mpiexec, gloo, DP=2 with the distributed optimizer).

Run as a script under mpiexec, this file is the trainer worker (see `_worker`). A save is held in flight by
its writer gate (a file that is never created in the crash case): both ranks take a training step while
their writers wait, then die; the previous complete checkpoint is what a new world loads. Released, the
same save completes on both ranks and loads with its step.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

pytestmark = [pytest.mark.mpi, pytest.mark.slow]


def _worker(model_dir: str, out: str, store: str, mode: str) -> None:
    import torch.distributed as dist

    from rollart_hpc.train import checkpoint, comm
    from rollart_hpc.train.config import OptimConfig, TrainerConfig
    from rollart_hpc.train.trainer import Trainer
    from tests.test_train_mpi import _global_batch

    rank, world = int(os.environ["OMPI_COMM_WORLD_RANK"]), int(os.environ["OMPI_COMM_WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    cfg = TrainerConfig(optim=OptimConfig(lr=1e-3), micro_batch_tokens=48, collective_timeout_s=120)
    trainer = Trainer(model_dir, cfg)
    root = Path(out)
    if mode == "resume":
        newest = next(p for p in (root / "second", root / "first") if checkpoint.is_complete(p))
        (root / "resumed.json").write_text(json.dumps([newest.name, trainer.load_checkpoint(newest)]))
        return
    batch = _global_batch(trainer.config.vocab_size)
    from rollart_hpc.train.batch import split_across_ranks

    shard = split_across_ranks(batch, world)[rank]
    trainer.sft_step(shard)
    trainer.save_checkpoint(root / "first")
    trainer.sft_step(shard)
    gate = root / "gate"
    pending = trainer.start_checkpoint(root / "second", gate=gate)
    trainer.sft_step(shard)  # returns while this rank's writer still waits at its gate
    assert pending.nbytes == 0 or not pending.written  # a rank may have nothing to write (DP rank 1)
    (root / f"stepped-{rank}").write_text(str(pending.nbytes))
    comm.barrier("both ranks stepped", 120, next(trainer.gpt.parameters()).device)
    if mode == "crash":
        (root / f"pid-{rank}").write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == 0:
        gate.touch()
    assert pending.finish(blocking=True)
    (root / f"done-{rank}").write_text(str(pending.nbytes))
    dist.destroy_process_group()


def _run(num_ranks: int, model_dir: Path, out: Path, mode: str) -> subprocess.CompletedProcess[str]:
    from rollart_hpc.cluster.mpiexec import mpi_session, mpiexec_argv
    from rollart_hpc.cluster.supervise import kill_group

    cmd = mpiexec_argv(num_ranks, sys.executable, __file__, str(model_dir), str(out))
    cmd += [str(out / f"store-{uuid.uuid4().hex}"), mode]
    extra = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parent.parent)}
    with mpi_session() as base:
        env = {**base, **extra}
        if mode != "crash":
            return subprocess.run(cmd, env=env, timeout=300, capture_output=True, text=True)
        # OpenMPI's prterun does not always exit when every rank is killed by a signal at once (seen to
        # hang with both ranks dead): once every rank has recorded its pid and is gone, it is stopped.
        logs = out / "mpiexec.log"
        with logs.open("w") as log:
            proc = subprocess.Popen(
                cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
            _until(lambda: proc.poll() is not None or _ranks_gone(out, num_ranks), "the killed ranks", 300)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    # A killed rank's helpers (dist_checkpointing's Manager and its resource tracker) outlive it, in the
    # process group the rank leads (mpiexec starts each rank in its own): end them, as the launcher does.
    for pid_file in out.glob("pid-*"):
        kill_group(int(pid_file.read_text()))
    return subprocess.CompletedProcess(cmd, proc.returncode, logs.read_text(), "")


def _ranks_gone(out: Path, num_ranks: int) -> bool:
    import psutil

    pids = [out / f"pid-{rank}" for rank in range(num_ranks)]
    if not all(p.is_file() for p in pids):
        return False
    for p in pids:
        try:
            if psutil.Process(int(p.read_text())).status() != psutil.STATUS_ZOMBIE:
                return False
        except (psutil.NoSuchProcess, ValueError):
            continue
    return True


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rollart_hpc.models.tiny import make_tiny_model

    return make_tiny_model(
        tmp_path_factory.mktemp("async") / "qwen2", family="qwen2", hidden_size=128, num_layers=2,
        num_heads=2, num_kv_heads=1, tie_word_embeddings=False,
    )  # fmt: skip


def test_ranks_killed_during_a_background_save_resume_from_the_previous_checkpoint(
    model_dir: Path, tmp_path: Path
) -> None:
    from rollart_hpc.train import checkpoint

    proc = _run(2, model_dir, tmp_path, "crash")
    assert proc.returncode != 0 and "Traceback" not in proc.stdout + proc.stderr  # killed, nothing raised
    assert int((tmp_path / "stepped-0").read_text()) > 0 and (tmp_path / "stepped-1").is_file()
    assert checkpoint.is_complete(tmp_path / "first") and checkpoint.checkpoint_step(tmp_path / "first") == 1
    assert not (tmp_path / "second").exists()
    partial = tmp_path / ".second.tmp"
    assert (partial / "common.pt").is_file() and not (partial / ".metadata").exists()
    assert not list(partial.glob("*.distcp"))  # the writers never got past their gate
    resumed = _run(1, model_dir, tmp_path, "resume")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert json.loads((tmp_path / "resumed.json").read_text()) == ["first", 1]


def test_a_released_background_save_completes_on_every_rank(model_dir: Path, tmp_path: Path) -> None:
    from rollart_hpc.train import checkpoint

    proc = _run(2, model_dir, tmp_path, "finish")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert checkpoint.checkpoint_step(tmp_path / "second") == 2
    assert int((tmp_path / "done-0").read_text()) > 0  # DP rank 0 writes the gathered optimizer state
    assert (tmp_path / "done-1").is_file()
    resumed = _run(1, model_dir, tmp_path, "resume")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert json.loads((tmp_path / "resumed.json").read_text()) == ["second", 2]


if __name__ == "__main__":
    _worker(*sys.argv[1:5])


def _until(predicate: Callable[[], bool], what: str, timeout_s: float = 400) -> None:
    tick, deadline = threading.Event(), time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"not reached in time: {what}"
        tick.wait(0.05)


TRAINER_RANK = 4  # configs/tiny.toml: controller, rollout, env, reward, trainer


def test_a_run_whose_trainer_dies_during_a_background_save_resumes_from_the_last_complete_one(
    tmp_path: Path,
) -> None:
    """Run level: step-2's save is let through, step-4's is held at its gate; step 5 trains while it is in
    flight (the controller did not wait for it, nor mark it complete); the trainer rank is SIGKILLed, the
    restart resumes from step 2, and once step-4's writer is let through the run finishes."""
    from launching import metric_lines, rank_pid, read_summary, start_run

    from rollart_hpc.controller import checkpoint as ckpt

    run_dir, gate = tmp_path / "run", tmp_path / "gate"
    gate.mkdir()
    (gate / "step-000002").touch()
    overrides = [
        "controller.mode=sync", "controller.num_steps=5", "controller.checkpoint_every_steps=2",
        "controller.keep_checkpoints=5", "controller.checkpoint_async=true",
        f"controller.checkpoint_write_gate={gate}",
    ]  # fmt: skip
    proc = start_run(run_dir, "--max-restarts", "1", *overrides)
    try:
        _until(lambda: len(metric_lines(run_dir)) >= 5, "step 5 trained")
        held = ckpt.step_dir(run_dir, 4)
        assert ckpt.latest(run_dir) == ckpt.step_dir(run_dir, 2)
        assert not ckpt.complete(held) and (held / ".trainer.tmp" / "common.pt").is_file()
        os.kill(rank_pid(run_dir, TRAINER_RANK), signal.SIGKILL)
        _until(lambda: (run_dir / "restarts.jsonl").is_file(), "the restart")
        (gate / "step-000004").touch()
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-2000:] + err[-3000:]
    assert "restart 1/1 from step 2" in out
    assert ckpt.latest(run_dir) == ckpt.step_dir(run_dir, 4)
    summary = read_summary(run_dir)
    assert summary["balanced"] and summary["accounting"]["trained"] == 5 * 4
