"""Run checkpoint directories: only complete ones count; partial ones are discarded at start; pruning."""

from pathlib import Path

from rollart_hpc.config import load_config
from rollart_hpc.controller import checkpoint as ckpt

CONFIG = load_config(Path(__file__).resolve().parent.parent / "configs" / "tiny.toml")


def make(run_dir, version, complete):
    path = ckpt.step_dir(run_dir, version)
    (path / "trainer").mkdir(parents=True)
    if complete:
        ckpt.write_controller_state(path, {"core": {"version": version}}, CONFIG)
    return path


def test_latest_ignores_incomplete_and_discard_removes_them(tmp_path):
    assert ckpt.latest(tmp_path) is None
    one = make(tmp_path, 1, True)
    two = make(tmp_path, 2, False)  # trainer part written, controller part missing: a cut-short save
    assert ckpt.latest(tmp_path) == one
    assert ckpt.read_controller_state(one)["core"]["version"] == 1
    assert ckpt.discard_incomplete(tmp_path) == [two]
    assert not two.exists() and one.exists()


def test_prune_keeps_the_newest_complete(tmp_path):
    paths = [make(tmp_path, v, True) for v in (1, 2, 3, 4)]
    removed = ckpt.prune(tmp_path, keep=2)
    assert removed == paths[:2]
    assert ckpt.latest(tmp_path) == paths[3]
