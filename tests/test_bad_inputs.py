"""Bad input never costs data: a corrupt HF model, a tokenizer that does not fit the model, a truncated
trajectory store, a checkpoint from another config and a malformed household task file each end with one
line naming the file and what is wrong (exit code 2 from the CLI), before anything in the run changes."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rollart_hpc.config import load_config, write_resolved
from rollart_hpc.contracts.errors import UsageError
from rollart_hpc.controller import checkpoint as ckpt
from rollart_hpc.models.validate import check_model_dir
from rollart_hpc.store.trajectories import StorePosition, TrajectoryStore, check_resumable
from rollart_hpc.tasks.families.household_data import load_manifest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_store_trajectories import make_traj  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from rollart_hpc.models.tiny import make_tiny_model

    out = tmp_path_factory.mktemp("model") / "tiny"
    make_tiny_model(
        out, hidden_size=64, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=64, vocab_size=300
    )
    return out


def copy_model(model_dir, tmp_path):
    return Path(shutil.copytree(model_dir, tmp_path / "model"))


def cli(*args, env=None):
    return subprocess.run(
        [sys.executable, str(REPO / "launch.py"), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def one_line_error(result, *fragments):
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_good_model_passes(model_dir):
    assert check_model_dir(model_dir).vocab_size == 300


def truncate_weights(folder):
    weights = folder / "model.safetensors"
    os.truncate(weights, weights.stat().st_size - 100)


def grow_tokenizer(folder):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.add_tokens([f"extra{i}" for i in range(400)])
    tokenizer.save(str(folder / "tokenizer.json"))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (truncate_weights, r"model\.safetensors: truncated or corrupt"),
        (
            lambda folder: (folder / "model.safetensors").write_bytes(
                b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!"
            ),
            r"model\.safetensors: corrupt safetensors file \(header is not JSON\)",
        ),
        (
            lambda folder: (folder / "config.json").write_text("{ not json"),
            r"config\.json: not a usable model config",
        ),
        (grow_tokenizer, r"tokenizer\.json: tokenizer does not match the model: token id \d+"),
        (
            lambda folder: (folder / "tokenizer.json").write_text('{"version": "1.0"'),
            r"tokenizer\.json: unreadable tokenizer",
        ),
    ],
    ids=[
        "truncated-weights",
        "garbage-weights",
        "corrupt-config",
        "larger-tokenizer",
        "unreadable-tokenizer",
    ],
)
def test_a_damaged_model_file_is_named(model_dir, tmp_path, damage, message):
    folder = copy_model(model_dir, tmp_path)
    damage(folder)
    with pytest.raises(UsageError, match=message):
        check_model_dir(folder)


def test_run_with_a_corrupt_model_writes_nothing(model_dir, tmp_path):
    folder = copy_model(model_dir, tmp_path)
    os.truncate(folder / "model.safetensors", 50)
    run_dir = tmp_path / "run"
    result = cli(
        "run", "configs/tiny.toml", "model.source=path", f"model.path={folder}", "--run-dir", str(run_dir)
    )
    one_line_error(result, str(folder / "model.safetensors"))
    assert not run_dir.exists()


def make_store(path, rows):
    with TrajectoryStore(path) as store:
        store.append([make_traj(i) for i in range(rows)], [2000.0 + i for i in range(rows)])
        return store.position()


def test_store_shorter_than_the_checkpoint_is_named(tmp_path):
    path = tmp_path / "trajectories.h5"
    position = make_store(path, 6)
    check_resumable(path, position)
    beyond = StorePosition(position.rows + 2, position.tokens + 10, position.events)
    with pytest.raises(UsageError, match=r"trajectories\.h5: truncated: the checkpoint needs"):
        check_resumable(path, beyond)


def test_cut_store_file_is_named(tmp_path):
    path = tmp_path / "trajectories.h5"
    position = make_store(path, 6)
    os.truncate(path, path.stat().st_size // 2)
    with pytest.raises(UsageError, match=r"trajectories\.h5: unreadable trajectory store"):
        check_resumable(path, position)
    missing = tmp_path / "gone.h5"
    with pytest.raises(UsageError, match=r"gone\.h5: missing"):
        check_resumable(missing, position)


def fake_run(tmp_path, checkpoint_overrides, rows=4):
    """A run directory (tiny config) with a trajectory store and one complete checkpoint written under
    the config with `checkpoint_overrides`."""
    run_dir = tmp_path / "run"
    config = load_config(REPO / "configs/tiny.toml", ["controller.mode=sync"])
    write_resolved(config, run_dir)
    position = make_store(run_dir / "trajectories.h5", rows)
    path = ckpt.step_dir(run_dir, 2)
    (path / "trainer").mkdir(parents=True)
    written_under = load_config(REPO / "configs/tiny.toml", ["controller.mode=sync", *checkpoint_overrides])
    ckpt.write_controller_state(path, {"core": {"version": 2}, "store": position.as_dict()}, written_under)
    return run_dir, config


def test_checkpoint_from_another_config_is_refused(tmp_path):
    run_dir, config = fake_run(tmp_path, ["controller.batch_size=8"])
    path = ckpt.latest(run_dir)
    with pytest.raises(UsageError, match=r"is from another config: controller\.batch_size was 8, .* says 4"):
        ckpt.check_fingerprint(path, config)
    before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file()}
    result = cli("resume", str(run_dir))
    one_line_error(result, str(path), "controller.batch_size")
    assert {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file()} == before


def test_same_config_checkpoint_passes_and_truncated_store_is_refused(tmp_path):
    run_dir, config = fake_run(tmp_path, [])
    path = ckpt.latest(run_dir)
    ckpt.check_resumable(run_dir, config, path)
    state = ckpt.read_controller_state(path)
    state["store"]["rows"] += 3
    ckpt.write_controller_state(path, state, config)
    result = cli("resume", str(run_dir))
    one_line_error(result, str(run_dir / "trajectories.h5"), "truncated")


def test_fingerprint_covers_model_and_seed():
    base = ckpt.config_fingerprint(load_config(REPO / "configs/tiny.toml"))
    other = ckpt.config_fingerprint(
        load_config(REPO / "configs/tiny.toml", ["model.num_layers=2", "run.seed=3"])
    )
    assert {k for k in base if base[k] != other.get(k)} == {"model.num_layers", "run.seed"}
    assert json.loads(json.dumps(base)) == base


def household_cache(root, manifest_text):
    folder = root / "household" / "v1"
    folder.mkdir(parents=True)
    (folder / "manifest.json").write_text(manifest_text)
    (folder / "READY").write_text("1\n")
    return folder / "manifest.json"


@pytest.mark.parametrize(
    ("text", "what"),
    [
        ("{ not json", "JSONDecodeError"),
        ('{"version": "v1"}', "KeyError"),
        ('{"games": [{"index": 0, "type": "take"}]}', "games[0].objective missing or not str"),
        (
            '{"games": [{"index": 0, "type": "t", "objective": "o", "walkthrough": [1], "sha256": "x"}]}',
            "games[0].walkthrough holds non-text",
        ),
    ],
)
def test_malformed_household_task_file_is_named(tmp_path, text, what):
    manifest = household_cache(tmp_path, text)
    with pytest.raises(UsageError) as info:
        load_manifest(tmp_path)
    message = str(info.value)
    assert message.startswith(f"{manifest}: malformed household task file") and what in message
    assert "\n" not in message


def test_run_with_a_malformed_household_file_writes_nothing(tmp_path):
    manifest = household_cache(tmp_path / "data", '{"games": 3}')
    run_dir = tmp_path / "run"
    result = cli(
        "run", "configs/tiny.toml", "envs.families=['household', 'calc_math']", "--run-dir", str(run_dir),
        env={"ROLLART_DATA": str(tmp_path / "data")},
    )  # fmt: skip
    one_line_error(result, str(manifest), "'games' is not a list")
    assert not run_dir.exists()


def test_checkpoint_older_than_a_config_field_resumes_while_the_field_keeps_its_default(tmp_path):
    """A field the schema gained after the checkpoint was written is absent from its fingerprint: a run
    that leaves it at its default (the old behaviour) resumes; one that changes it is refused."""
    run_dir, config = fake_run(tmp_path, [])
    path = ckpt.latest(run_dir)
    marker_path = path / ckpt.COMPLETE
    marker = json.loads(marker_path.read_text())
    del marker["config"]["algo.sampler_balance"]
    marker_path.write_text(json.dumps(marker))
    ckpt.check_fingerprint(path, config)
    changed = load_config(
        REPO / "configs/tiny.toml", ["controller.mode=sync", 'algo.sampler_balance="family"']
    )
    with pytest.raises(UsageError, match=r"algo\.sampler_balance was None, the run's config says 'family'"):
        ckpt.check_fingerprint(path, changed)
