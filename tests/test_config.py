import subprocess
import sys
from pathlib import Path

import pytest

from rollart_hpc.config import load_config, write_resolved
from rollart_hpc.config.choices import ASYNC_DEFAULT_STALENESS, FAMILY_NAMES, MODES
from rollart_hpc.config.loader import apply_overrides, build, parse_override
from rollart_hpc.config.resolve import read_resolved
from rollart_hpc.config.schema import Config
from rollart_hpc.contracts.errors import UsageError

REPO = Path(__file__).resolve().parent.parent
CONFIGS = sorted((REPO / "configs").glob("*.toml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_config_parses(path):
    config = load_config(path)
    assert isinstance(config, Config)


def test_shipped_configs_exist():
    assert any(p.name == "smoke.toml" for p in CONFIGS)


def test_parse_override_values_are_toml():
    assert parse_override("trainer.lr=1e-6") == (["trainer", "lr"], 1e-6)
    assert parse_override("a.b=true") == (["a", "b"], True)
    assert parse_override("a.b=[1, 2]") == (["a", "b"], [1, 2])
    assert parse_override("run.name=hello") == (["run", "name"], "hello")
    assert parse_override('run.name="x y"') == (["run", "name"], "x y")


@pytest.mark.parametrize("bad", ["noequals", "=3", "a..b=1", ".a=1"])
def test_parse_override_rejects_malformed(bad):
    with pytest.raises(UsageError, match="dotted.key=value"):
        parse_override(bad)


def test_overrides_do_not_mutate_input():
    data = {"run": {"seed": 1}}
    out = apply_overrides(data, ["run.seed=2", "roles.env.num_ranks=3"])
    assert data == {"run": {"seed": 1}}
    assert out == {"run": {"seed": 2}, "roles": {"env": {"num_ranks": 3}}}


def test_unknown_key_is_named():
    with pytest.raises(
        UsageError, match=r"unknown key cluster\.nonexistent \(allowed at this level: .*peer_timeout_s"
    ):
        build(Config, {"cluster": {"nonexistent": 1}})


def test_wrong_type_is_named():
    with pytest.raises(UsageError, match=r"roles\.env\.num_ranks: expected int, got str"):
        build(Config, {"roles": {"env": {"num_ranks": "two"}}})
    with pytest.raises(UsageError, match=r"roles\.env\.num_ranks: expected int, got bool"):
        build(Config, {"roles": {"env": {"num_ranks": True}}})


def test_literal_lists_allowed_values():
    with pytest.raises(
        UsageError, match=r"cluster\.torch_backend: 'mpi' is not one of 'auto', 'gloo', 'nccl'"
    ):
        build(Config, {"cluster": {"torch_backend": "mpi"}})


def test_int_accepted_for_float():
    assert build(Config, {"cluster": {"peer_timeout_s": 3}}).cluster.peer_timeout_s == 3.0


def test_value_checks():
    with pytest.raises(UsageError, match=r"roles\.controller\.num_ranks: must be 1"):
        build(Config, {"roles": {"controller": {"num_ranks": 2}}})
    with pytest.raises(UsageError, match=r"cluster\.peer_timeout_s: must be > 0"):
        build(Config, {"cluster": {"peer_timeout_s": 0}})
    with pytest.raises(UsageError, match=r"trainer.ppo_epochs: must be >= 1, got 0"):
        build(Config, {"trainer": {"ppo_epochs": 0}})


def test_cross_section_invariant(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[smoke]\nfail_rank = 7\n")
    with pytest.raises(UsageError, match=r"smoke\.fail_rank: rank 7 is outside the world of 5 ranks"):
        load_config(path)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(UsageError, match="config file not found"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[run\nname=")
    with pytest.raises(UsageError, match="invalid TOML"):
        load_config(bad)


def test_resolved_round_trip(tmp_path):
    config = load_config(REPO / "configs" / "smoke.toml", ["run.seed=7", "roles.rollout.num_ranks=2"])
    write_resolved(config, tmp_path)
    assert read_resolved(tmp_path) == config
    assert (tmp_path / "role-rollout.toml").read_text().count("num_ranks = 2") == 1
    assert not list(tmp_path.glob(".*.tmp"))


@pytest.mark.parametrize(
    "code",
    [
        "import sys, rollart_hpc.config, rollart_hpc.config.schema, rollart_hpc.cluster.plan\n"
        "heavy = [m for m in ('torch', 'megatron', 'vllm', 'mpi4py', 'transformers') if m in sys.modules]\n"
        "assert not heavy, heavy\n",
        "import sys, rollart_hpc.config.choices\n"
        "ours = sorted(m for m in sys.modules if m.startswith('rollart_hpc.'))\n"
        "assert all(m.startswith(('rollart_hpc.config', 'rollart_hpc.contracts')) for m in ours), ours\n",
    ],
    ids=["schema-is-torch-free", "choices-import-only-config-and-contracts"],
)
def test_config_imports_in_a_fresh_interpreter(code):
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_field_is_documented():
    import dataclasses

    def walk(cls):
        for f in dataclasses.fields(cls):
            assert f.metadata.get("doc"), f"{cls.__name__}.{f.name} has no doc"
            if dataclasses.is_dataclass(
                f.default_factory if f.default_factory is not dataclasses.MISSING else None
            ):
                walk(f.default_factory)

    walk(Config)


def test_mode_staleness():
    def staleness(mode, bound=-1):
        return build(Config, {"controller": {"mode": mode, "max_staleness": bound}}).controller.staleness

    assert [staleness(mode) for mode in MODES] == [0, 1, ASYNC_DEFAULT_STALENESS]
    assert staleness("async", 3) == 3 and staleness("sync", 0) == 0
    with pytest.raises(UsageError, match=r"controller\.max_staleness: mode 'one_step_off' implies 1"):
        staleness("one_step_off", 2)


def test_family_and_household_type_names():
    with pytest.raises(UsageError, match=r"envs\.families: 'chess' is not one of 'household', 'calc_math'"):
        build(Config, {"envs": {"families": ["chess"]}})
    with pytest.raises(UsageError, match=r"envs\.household_types: 'fly' is not one of put_in, put_on"):
        build(Config, {"envs": {"household_types": ["fly"]}})
    assert build(Config, {"envs": {"families": list(FAMILY_NAMES)}}).envs.families == list(FAMILY_NAMES)


@pytest.mark.parametrize("ops", [0, 4])
def test_calc_max_ops_out_of_range_is_refused_with_the_config_path(ops):
    with pytest.raises(UsageError, match=rf"envs\.calc_max_ops: must be in \[1, 3\], got {ops}"):
        build(Config, {"envs": {"calc_max_ops": ops}})
    assert build(Config, {"envs": {"calc_max_ops": 3}}).envs.calc_max_ops == 3


def test_registries_hold_one_entry_per_family_name():
    from rollart_hpc.reward.functions import REWARD_FNS
    from rollart_hpc.tasks.registry import FAMILIES

    assert sorted(FAMILIES) == sorted(FAMILY_NAMES)
    assert sorted(REWARD_FNS) == sorted(FAMILY_NAMES)


def test_tiny_model_shape_follows_hidden_size():
    model = build(Config, {"model": {"hidden_size": 256}}).model
    assert (model.num_heads, model.num_kv_heads, model.head_dim) == (4, 2, 64)
    assert build(Config, {"model": {"hidden_size": 64}}).model.num_kv_heads == 1
    with pytest.raises(UsageError, match=r"model\.hidden_size: must be a positive multiple of 64"):
        build(Config, {"model": {"hidden_size": 96}})


def test_trainer_settings_from_the_trainer_section():
    from rollart_hpc.train.config import TrainerConfig

    section = build(Config, {"trainer": {"weight_decay": 0.1, "grad_clip": 0.5, "micro_batch_tokens": 512}})
    cfg = TrainerConfig.from_config(section.trainer, lr=2e-4, seed=7, timeout_s=30.0)
    assert (cfg.optim.lr, cfg.optim.weight_decay, cfg.optim.grad_clip) == (2e-4, 0.1, 0.5)
    assert (cfg.micro_batch_tokens, cfg.seed, cfg.collective_timeout_s) == (512, 7, 30.0)
    assert cfg.precision == "fp32"
    bf16 = build(Config, {"trainer": {"precision": "bf16"}}).trainer
    assert TrainerConfig.from_config(bf16, lr=2e-4, seed=7, timeout_s=30.0).precision == "bf16"


def test_engine_dtype_is_the_published_dtype_unless_vllm_names_one():
    from rollart_hpc.inference.engines import engine_dtype

    builtin = build(Config, {}).rollout
    assert (engine_dtype(builtin, "fp32"), engine_dtype(builtin, "bf16")) == ("float32", "bfloat16")
    vllm = build(Config, {"rollout": {"engine": "vllm"}}).rollout
    assert (engine_dtype(vllm, "fp32"), engine_dtype(vllm, "bf16")) == ("float32", "bfloat16")
    pinned = build(Config, {"rollout": {"engine": "vllm", "vllm": {"dtype": "float32"}}}).rollout
    assert engine_dtype(pinned, "bf16") == "float32"


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("temperature", -1.0, r"rollout\.temperature: must be > 0 \(greedy turns .*got -1\.0"),
        ("temperature", 0.0, r"rollout\.temperature: must be > 0"),
        ("top_p", 2.0, r"rollout\.top_p: must lie in \(0, 1\], got 2\.0"),
        ("top_p", 0.0, r"rollout\.top_p: must lie in \(0, 1\], got 0\.0"),
        ("top_k", -1, r"rollout\.top_k: must be >= 0 \(0 = off\), got -1"),
        ("top_p", 0.9, r"rollout\.top_p: must be 1\.0 \(off\): the trainer does not recompute the truncated"),
        ("top_k", 20, r"rollout\.top_k: must be 0 \(off\): the trainer does not recompute the truncated"),
    ],
)
def test_rollout_sampling_values_are_checked(key, value, message):
    with pytest.raises(UsageError, match=message):
        build(Config, {"rollout": {key: value}})


def test_rollout_temperature_reaches_the_trainer_and_dry_run_refuses_a_bad_one():
    from rollart_hpc.train.config import TrainerConfig

    section = build(Config, {"rollout": {"temperature": 0.7}})
    cfg = TrainerConfig.from_config(
        section.trainer, lr=1e-3, seed=0, timeout_s=30.0, temperature=section.rollout.temperature
    )
    assert cfg.temperature == 0.7
    result = subprocess.run(
        [sys.executable, str(REPO / "launch.py"), "run", "configs/tiny.toml", "--dry-run", "rollout.top_p=2"],
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )  # fmt: skip
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        "error: rollout.top_p: must lie in (0, 1], got 2.0"
    ], result.stderr
