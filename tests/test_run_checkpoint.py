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


def make_with_trainer_file(run_dir, version):
    path = ckpt.step_dir(run_dir, version)
    (path / "trainer").mkdir(parents=True)
    (path / "trainer" / "__0_0.distcp").write_bytes(b"x" * 100)
    ckpt.write_controller_state(path, {"core": {"version": version}}, CONFIG)
    return path


def test_complete_marker_lists_every_file_with_its_size(tmp_path):
    path = make_with_trainer_file(tmp_path, 1)
    files = ckpt.manifest(path)
    assert files["trainer/__0_0.distcp"] == 100 and ckpt.CONTROLLER_STATE in files
    assert ckpt.problem(path) is None


def test_damaged_newest_checkpoint_is_discarded_with_a_line_and_the_older_one_used(tmp_path):
    one, two, three = (make_with_trainer_file(tmp_path, v) for v in (1, 2, 3))
    with (three / "trainer" / "__0_0.distcp").open("r+b") as fh:
        fh.truncate(50)  # truncated
    (two / ckpt.CONTROLLER_STATE).unlink()  # deleted
    lines = []
    assert ckpt.latest_valid(tmp_path, lines.append) == one
    assert not three.exists() and not two.exists() and one.exists()
    assert "trainer/__0_0.distcp has 50 bytes, the checkpoint wrote 100" in lines[0]
    assert "controller.pkl is missing" in lines[1]


def test_no_valid_checkpoint_means_start_over(tmp_path):
    path = make_with_trainer_file(tmp_path, 1)
    (path / ckpt.CONTROLLER_STATE).write_bytes(b"not a pickle")  # same size would still fail to load
    lines = []
    assert ckpt.latest_valid(tmp_path, lines.append) is None and len(lines) == 1
