"""Local sweep runs: each run a launcher subprocess in its own session, `parallel` at a time, its console
output in `RUN_DIR/sweep.log`; SIGTERM or Ctrl-C stop every started run (by pid) before returning."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from rollart_hpc.sweep.grid import SWEEP_LOG

POLL_S = 0.5


def run_local(out: Path, names: Sequence[str], commands: dict[str, list[str]], parallel: int) -> int:
    """Run the commands, `parallel` at a time; report each end; 1 if any run failed."""
    pending, failed = list(names), []
    running: dict[str, tuple[subprocess.Popen[bytes], float]] = {}
    done = 0
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        while pending or running:
            while pending and len(running) < parallel:
                name = pending.pop(0)
                print(f"[sweep] start {name} (log {out / name / SWEEP_LOG})", flush=True)
                running[name] = (start_run(out / name, commands[name]), time.monotonic())
            for name, (proc, started) in list(running.items()):
                if proc.poll() is None:
                    continue
                del running[name]
                took = time.monotonic() - started
                if proc.returncode == 0:
                    done += 1
                    print(f"[sweep] {name} finished in {took:.0f}s", flush=True)
                else:
                    failed.append(name)
                    log = out / name / SWEEP_LOG
                    print(
                        f"[sweep] {name} FAILED (exit {proc.returncode}) after {took:.0f}s; log {log}",
                        flush=True,
                    )
            time.sleep(POLL_S)
    except KeyboardInterrupt:
        stop_runs([proc for proc, _ in running.values()])
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(f"[sweep] {done} finished, {len(failed)} failed: {', '.join(failed) or 'none'}", flush=True)
    return 1 if failed else 0


def _raise_interrupt(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def start_run(run_dir: Path, command: list[str]) -> subprocess.Popen[bytes]:
    run_dir.mkdir(parents=True, exist_ok=True)
    with (run_dir / SWEEP_LOG).open("ab") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def stop_runs(procs: Sequence[subprocess.Popen[bytes]], grace_s: float = 30.0) -> None:
    """SIGTERM each launcher by pid (it stops its world in order), SIGKILL any left after the grace."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
