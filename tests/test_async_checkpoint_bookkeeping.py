"""The controller's side of background checkpoints (`controller.checkpoint_async`): a begun checkpoint is
marked complete only once every trainer rank has reported its part written; until then the previous
complete checkpoint is the resume point. Synchronous saves wait for the trainers as before."""

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest

from rollart_hpc.cluster.mailbox import Message
from rollart_hpc.config import load_config
from rollart_hpc.contracts.errors import UsageError
from rollart_hpc.contracts.protocol import Tag
from rollart_hpc.controller import checkpoint as ckpt
from rollart_hpc.controller import recovery
from rollart_hpc.controller.state import Controller

TINY = Path(__file__).resolve().parent.parent / "configs" / "tiny.toml"
TRAINERS = [3, 4]


class Mailbox:
    """Records what the controller sends; answers CHECKPOINTED at once (a synchronous trainer)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, int, Tag]] = []

    def send(self, payload: str, rank: int, tag: Tag) -> None:
        self.sent.append((payload, rank, tag))

    def wait_for(self, tag: Tag, source: int) -> Message:
        payload = next(p for p, r, t in self.sent if r == source and t == Tag.CHECKPOINT)
        return Message(source=source, tag=tag, payload=payload)


def fake_controller(run_dir: Path, version: int, *overrides: str) -> SimpleNamespace:
    config = load_config(TINY, list(overrides))
    fake = SimpleNamespace(
        config=config,
        ctx=SimpleNamespace(run_dir=run_dir, ranks={"trainer": TRAINERS}, mailbox=Mailbox(), log=logging),
        core=SimpleNamespace(version=version, state_dict=lambda: {"version": fake.core.version}),
        store=SimpleNamespace(position=lambda: SimpleNamespace(as_dict=lambda: {"rows": 0})),
        loaded_history={},
        wall_s=lambda: 1.0,
        unwritten={},
        trace=SimpleNamespace(rows=[], write=lambda kind, **row: fake.trace.rows.append((kind, row))),
        last_checkpoint=0,
        last_checkpoint_at=0.0,
    )
    fake.handle = lambda msg: Controller.handle(fake, msg)  # type: ignore[arg-type]
    return fake


def _trainer_files(path: Path) -> None:
    (path / "trainer").mkdir(parents=True, exist_ok=True)
    for name, size in {"__0_0.distcp": 5, "__0_1.distcp": 3, "__1_0.distcp": 7, "common.pt": 2}.items():
        (path / "trainer" / name).write_bytes(b"x" * size)


def _checkpointed(controller: SimpleNamespace, path: Path, rank: int) -> None:
    controller.handle(Message(source=rank, tag=Tag.CHECKPOINTED, payload=str(path / "trainer")))
    recovery.complete_written(controller)  # type: ignore[arg-type]


def test_a_background_checkpoint_is_complete_only_when_every_trainer_rank_wrote_it(tmp_path: Path) -> None:
    controller = fake_controller(tmp_path, 2, "controller.checkpoint_async=true")
    first = recovery.save(controller)  # type: ignore[arg-type]
    _trainer_files(first)
    for rank in TRAINERS:
        _checkpointed(controller, first, rank)
    assert ckpt.latest(tmp_path) == first
    controller.core.version = 4
    second = recovery.save(controller)  # type: ignore[arg-type]
    assert controller.last_checkpoint == 4 and not ckpt.complete(second)
    controller.core.version = 5  # training went on; the checkpoint keeps the state of version 4
    _trainer_files(second)
    _checkpointed(controller, second, TRAINERS[0])
    assert not ckpt.complete(second) and ckpt.latest(tmp_path) == first  # the resume point, still
    _checkpointed(controller, second, TRAINERS[1])
    assert ckpt.latest(tmp_path) == second and ckpt.read_controller_state(second)["core"] == {"version": 4}
    assert controller.trace.rows[-1][0] == "checkpoint_complete"
    assert controller.trace.rows[-1][1]["bytes_per_rank"] == {"0": 8, "1": 7}
    assert [kind for kind, _ in controller.trace.rows].count("checkpoint") == 2
    assert controller.unwritten == {}


def test_a_synchronous_checkpoint_is_complete_when_save_returns(tmp_path: Path) -> None:
    controller = fake_controller(tmp_path, 2)
    assert controller.config.controller.checkpoint_async is False
    path = tmp_path / "checkpoints" / "step-000002"
    _trainer_files(path)
    assert recovery.save(controller) == path and ckpt.latest(tmp_path) == path  # type: ignore[arg-type]
    assert [t for _, _, t in controller.ctx.mailbox.sent] == [Tag.CHECKPOINT] * len(TRAINERS)


def test_a_write_gate_without_background_saves_is_refused() -> None:
    with pytest.raises(UsageError, match="checkpoint_write_gate: needs controller.checkpoint_async"):
        load_config(TINY, ["controller.checkpoint_write_gate=/tmp/gate"])
