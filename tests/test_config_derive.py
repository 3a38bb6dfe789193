"""Component settings derived from the user config (`rollart_hpc.config.derive`): the mechanism's
declaration checks, and the values each component receives for real configs, spelled out field by field
(the mapping the components were built with before they were derived by name)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from rollart_hpc.algo.tracker import SPORho
from rollart_hpc.config.derive import derive
from rollart_hpc.config.resolve import load_config
from rollart_hpc.config.schema import Config
from rollart_hpc.contracts.errors import UsageError
from rollart_hpc.controller.core import CoreSettings
from rollart_hpc.envs.faults import FaultConfig, LatencyConfig
from rollart_hpc.envs.worker import EnvWorkerConfig
from rollart_hpc.inference.engines import engine_dtype
from rollart_hpc.inference.vllm_engine import VLLMSettings
from rollart_hpc.reward.pool import RewardPoolConfig
from rollart_hpc.reward.service import pool_config
from rollart_hpc.tasks.agent_loop import AgentConfig
from rollart_hpc.train.config import OptimConfig, TrainerConfig

REPO = Path(__file__).resolve().parents[1]
# Each config with and without overrides that move fields away from their defaults.
CASES = [
    ("local.toml", []),
    ("tiny.toml", []),
    ("gpu_2x8_qwen7b.toml", []),
    (
        "tiny.toml",
        [
            "roles.trainer.num_ranks=2",
            "trainer.tensor_parallel=2",
            "trainer.sequence_parallel=true",
            "trainer.loss_impl=eager",
            "trainer.attention=unfused",
            "trainer.recompute=selective",
            "trainer.precision=bf16",
            "trainer.distributed_optimizer=false",
            "trainer.overlap_grad_reduce=false",
            "trainer.ppo_epochs=2",
            "trainer.num_minibatches=4",
            "trainer.weight_decay=0.01",
            "trainer.grad_clip=0.5",
            "rollout.temperature=0.7",
            "envs.faults.crash_prob=0.1",
            "envs.faults.hang_prob=0.05",
            "envs.faults.error_prob=0.02",
            "envs.faults.latency=pareto",
            "envs.faults.latency_scale_s=0.5",
            "envs.faults.latency_max_s=3.0",
            "envs.step_timeout_s=12.0",
            "envs.episode_timeout_s=99.0",
            "reward.max_workers=5",
            "reward.executor=thread",
            "reward.idle_shutdown_s=7.0",
            "reward.scale_up_queue=3",
            "reward.max_score_attempts=4",
            "reward.fault_prob=0.25",
            "reward.functions.calc_math=pkg.mod:fn",
        ],
    ),
]


def _load(name: str, overrides: list[str]) -> Config:
    return load_config(REPO / "configs" / name, overrides)


@pytest.mark.parametrize(("name", "overrides"), CASES)
def test_trainer_settings_equal_the_explicit_mapping(name: str, overrides: list[str]) -> None:
    config = _load(name, overrides)
    t = config.trainer
    for lr in (t.sft_lr, t.lr):
        got = TrainerConfig.from_config(
            t, lr=lr, seed=config.run.seed, timeout_s=42.0, temperature=config.rollout.temperature
        )
        want = TrainerConfig(
            optim=OptimConfig(lr=lr, weight_decay=t.weight_decay, grad_clip=t.grad_clip),
            micro_batch_tokens=t.micro_batch_tokens,
            seed=config.run.seed,
            temperature=config.rollout.temperature,
            collective_timeout_s=42.0,
            ppo_epochs=t.ppo_epochs,
            num_minibatches=t.num_minibatches,
            tensor_parallel=t.tensor_parallel,
            pipeline_parallel=t.pipeline_parallel,
            sequence_parallel=t.sequence_parallel,
            loss_impl=t.loss_impl,
            distributed_optimizer=t.distributed_optimizer,
            overlap_grad_reduce=t.overlap_grad_reduce,
            precision=t.precision,
            attention=t.attention,
            recompute=t.recompute,
        )
        assert got == want
        assert (got.optim.betas, got.optim.eps, got.ddp_bucket_elements) == ((0.9, 0.999), 1e-8, None)


@pytest.mark.parametrize(("name", "overrides"), CASES)
def test_env_worker_and_agent_settings_equal_the_explicit_mapping(name: str, overrides: list[str]) -> None:
    config = _load(name, overrides)
    envs, f, r = config.envs, config.envs.faults, config.rollout
    want_worker = EnvWorkerConfig(
        num_slots=envs.num_slots,
        step_timeout_s=envs.step_timeout_s,
        episode_timeout_s=envs.episode_timeout_s,
        faults=FaultConfig(
            seed=config.run.seed,
            crash_prob=f.crash_prob,
            hang_prob=f.hang_prob,
            error_prob=f.error_prob,
            latency=LatencyConfig(dist=f.latency, scale_s=f.latency_scale_s, max_s=f.latency_max_s),
        ),
    )
    assert EnvWorkerConfig.from_config(envs, config.run.seed) == want_worker
    want_agent = AgentConfig(
        max_context_tokens=r.max_model_len,
        max_new_tokens=r.max_new_tokens,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
    )
    assert AgentConfig.from_config(r) == want_agent
    assert want_agent.min_new_tokens == AgentConfig.min_new_tokens


@pytest.mark.parametrize(("name", "overrides"), CASES)
def test_reward_pool_settings_equal_the_explicit_mapping(name: str, overrides: list[str]) -> None:
    config = _load(name, overrides)
    c = config.reward
    got = pool_config(c, 11, {"household": "won"}, ["/x"])
    want = RewardPoolConfig(
        fn_for_family={"household": "won", **c.functions},
        python_path=("/x",),
        max_workers=c.max_workers,
        executor=c.executor,
        idle_shutdown_s=c.idle_shutdown_s,
        scale_up_queue=c.scale_up_queue,
        max_score_attempts=c.max_score_attempts,
        fault_prob=c.fault_prob,
        fault_seed=11,
    )
    assert got == want


@pytest.mark.parametrize(("name", "overrides"), CASES)
@pytest.mark.parametrize("arm", [[], ['algo.name="spo"'], ['algo.name="grpo"', "controller.max_staleness=2"]])
def test_controller_core_settings_equal_the_explicit_mapping(
    name: str, overrides: list[str], arm: list[str]
) -> None:
    config = _load(name, [*overrides, *arm])
    c, a = config.controller, config.algo
    want = CoreSettings(
        batch_size=c.batch_size,
        max_staleness=c.staleness,
        mode=c.mode,
        num_steps=c.num_steps,
        rho=a.rho,
        sampler_epsilon=a.sampler_epsilon,
        max_in_flight_per_task=a.max_in_flight_per_task,
        tracker_kind=a.tracker,
        arrival_rho=SPORho(rho_min=a.arrival_rho_min, rho_max=a.arrival_rho_max),
        drift_per_version=a.arrival_drift_per_version,
        group_size=a.group_size if a.estimator == "group" else 0,
        redundancy=c.redundancy,
        sampler_balance=a.sampler_balance,
    )
    assert CoreSettings.from_config(c, a) == want


@pytest.mark.parametrize(("name", "overrides"), CASES)
def test_vllm_engine_settings_equal_the_explicit_mapping(name: str, overrides: list[str]) -> None:
    config = _load(name, overrides)
    r, t = config.rollout, config.trainer
    want = VLLMSettings(
        num_slots=r.num_slots,
        max_model_len=r.max_model_len,
        tensor_parallel_size=r.tensor_parallel_size,
        dtype=engine_dtype(r, t.precision),
        gpu_memory_utilization=r.vllm.gpu_memory_utilization,
        enforce_eager=True if r.vllm.enforce_eager else None,
        staging_bytes=int(t.bucket_mb * 2**20),
    )
    assert VLLMSettings.from_config(r, t) == want


def test_the_overridden_values_reach_the_components() -> None:
    """The last case's non-default values, as literals (so a section field read under a wrong name fails)."""
    config = _load(*CASES[-1])
    trainer = TrainerConfig.from_config(config.trainer, lr=1e-4, seed=3, timeout_s=5.0, temperature=0.7)
    assert (trainer.tensor_parallel, trainer.sequence_parallel, trainer.loss_impl) == (2, True, "eager")
    assert (trainer.attention, trainer.recompute, trainer.precision) == ("unfused", "selective", "bf16")
    assert (trainer.distributed_optimizer, trainer.overlap_grad_reduce) == (False, False)
    assert (trainer.ppo_epochs, trainer.num_minibatches, trainer.temperature) == (2, 4, 0.7)
    assert (trainer.optim.lr, trainer.optim.weight_decay, trainer.optim.grad_clip) == (1e-4, 0.01, 0.5)
    worker = EnvWorkerConfig.from_config(config.envs, 9)
    assert (worker.step_timeout_s, worker.episode_timeout_s, worker.faults.seed) == (12.0, 99.0, 9)
    assert (worker.faults.crash_prob, worker.faults.hang_prob, worker.faults.error_prob) == (0.1, 0.05, 0.02)
    assert worker.faults.latency == LatencyConfig(dist="pareto", scale_s=0.5, max_s=3.0)
    assert AgentConfig.from_config(config.rollout).temperature == 0.7
    pool = pool_config(config.reward)
    assert (pool.max_workers, pool.executor, pool.idle_shutdown_s, pool.scale_up_queue) == (
        5,
        "thread",
        7.0,
        3,
    )
    assert (pool.max_score_attempts, pool.fault_prob, pool.fn_for_family) == (
        4,
        0.25,
        {"calc_math": "pkg.mod:fn"},
    )


def test_the_shared_rules_are_one_line_usage_errors_in_both_places() -> None:
    with pytest.raises(UsageError, match=r"^trainer\.sequence_parallel: needs trainer\.tensor_parallel > 1$"):
        TrainerConfig(sequence_parallel=True)
    with pytest.raises(UsageError, match=r"^reward\.max_score_attempts: must be >= 1, got 0$"):
        RewardPoolConfig(max_score_attempts=0)
    with pytest.raises(UsageError, match=r"trainer\.loss_impl: 'chunked' is not one of fused, eager"):
        TrainerConfig(loss_impl="chunked")


@dataclass(frozen=True)
class _Section:
    a: int = 1
    b: str = "x"


@dataclass(frozen=True)
class _Other:
    c: float = 2.0


@dataclass(frozen=True)
class _Component:
    a: int = 0
    bee: str = ""
    c: float = 0.0
    seed: int = 0
    knob: bool = False


def test_derive_fills_by_name_rename_given_and_kept() -> None:
    d = derive(_Component, _Section, _Other, rename={"bee": "b"}, given=("seed",), kept=("knob",))
    assert d(_Section(a=5, b="y"), _Other(c=3.0), seed=7) == _Component(a=5, bee="y", c=3.0, seed=7)
    assert d.sources_of() == {"a": "_Section.a", "bee": "_Section.b", "c": "_Other.c"}
    doubled = derive(
        _Component, _Section, _Other, rename={"bee": "b"}, given=("seed",), kept=("knob",), convert={"a": abs}
    )
    assert doubled(_Section(a=-5, b="y"), _Other(), seed=0).a == 5


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"given": ("seed",), "kept": ("knob",)}, r"field 'bee' has no source \(no field 'bee' in _Section"),
        ({"rename": {"bee": "nope"}, "given": ("seed",), "kept": ("knob",)}, "no field 'nope'"),
        ({"rename": {"bee": "b"}, "given": ("seed",)}, "field 'knob' has no source"),
        ({"rename": {"bee": "b"}, "given": ("seed", "zzz"), "kept": ("knob",)}, "'zzz' is not a field"),
        (
            {"rename": {"bee": "b"}, "given": ("seed", "knob"), "kept": ("knob",)},
            r"\['knob'\] declared twice",
        ),
        (
            {"rename": {"bee": "b"}, "given": ("seed",), "kept": ("knob",), "convert": {"zz": abs}},
            "'zz' is not",
        ),
        (
            {"rename": {"bee": "b"}, "given": ("seed",), "kept": ("knob",), "convert": {"seed": abs}},
            r"\['seed'\] declared twice",
        ),
    ],
)
def test_a_declaration_without_a_source_for_every_field_fails_at_once(kwargs: dict, message: str) -> None:
    with pytest.raises(TypeError, match=message):
        derive(_Component, _Section, _Other, **kwargs)


def test_a_build_with_other_sections_or_given_values_fails() -> None:
    d = derive(_Component, _Section, _Other, rename={"bee": "b"}, given=("seed",), kept=("knob",))
    with pytest.raises(TypeError, match=r"expected sections \(_Section, _Other\), got \(_Other, _Section\)"):
        d(_Other(), _Section(), seed=1)
    with pytest.raises(TypeError, match=r"expected given values \['seed'\], got \[\]"):
        d(_Section(), _Other())
