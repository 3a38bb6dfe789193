"""Rollout pools (config, plan, SLURM components), the router (static, hash, adaptive, fallback) and the
adaptive affinity policy, without MPI. Golden: `UPDATE_GOLDEN=1 pytest tests/test_routing.py`."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from rollart_hpc.cluster.plan import make_plan
from rollart_hpc.cluster.sbatch import het_components
from rollart_hpc.config import load_config
from rollart_hpc.config.routing import RoutingConfig
from rollart_hpc.contracts.errors import UsageError
from rollart_hpc.contracts.records import RankLoad
from rollart_hpc.rollout.costs import CostProfile, StepMeter
from rollart_hpc.routing.affinity import FamilyWork, PoolCost, best_shares, decide, makespan, pool_cost
from rollart_hpc.routing.router import PoolSpec, Router, rollout_index
from tests.test_submit import _check_golden, _config_file, _render

TWO_POOLS = """\
[run]
name = "pools"
job = "rl"
[roles.controller]
partition = "cpu"
[[roles.rollout_pools]]
name = "compute"
num_ranks = 2
partition = "h800"
gpus_per_rank = 1
gpu_type = "h800"
tags = ["household"]
[[roles.rollout_pools]]
name = "bandwidth"
num_ranks = 3
partition = "h20"
gpus_per_rank = 1
gpu_type = "h20"
num_slots = 64
[roles.env]
partition = "cpu"
[roles.reward]
partition = "cpu"
[roles.trainer]
partition = "cpu"
[routing]
policy = "static"
families = { calc_math = "bandwidth" }
"""


def test_pools_expand_into_the_plan_and_one_component_each(tmp_path: Path) -> None:
    config = load_config(_config_file(tmp_path, TWO_POOLS))
    assert config.roles.rollout.num_ranks == 5
    plan = make_plan(config.roles)
    assert plan.pools() == {"compute": range(1, 3), "bandwidth": range(3, 6)}
    assert list(plan.ranks_of("rollout")) == [1, 2, 3, 4, 5] and list(plan.ranks_of("env")) == [6]
    assert plan.describe(4) == "rollout rank 4 (rollout #3, pool bandwidth)"
    assert "pool=compute (gpu=h800 tags=household)" in plan.table()
    components = het_components(plan)
    assert [c.roles for c in components] == [
        ("controller",),
        ("rollout:compute",),
        ("rollout:bandwidth",),
        ("env", "reward", "trainer"),
    ]
    assert [c.gpu_type for c in components[1:3]] == ["h800", "h20"]


def test_pools_on_one_partition_stay_separate_components(tmp_path: Path) -> None:
    text = TWO_POOLS.replace('"h800"', '"cpu"', 1).replace('partition = "h20"', 'partition = "cpu"')
    components = het_components(make_plan(load_config(_config_file(tmp_path, text)).roles))
    assert [c.roles for c in components] == [
        ("controller",),
        ("rollout:compute",),
        ("rollout:bandwidth",),
        ("env", "reward", "trainer"),
    ]


def test_golden_hetjob_two_pools(tmp_path: Path) -> None:
    script = _render(tmp_path, TWO_POOLS)
    _check_golden("hetjob_2_pools.sbatch", script)
    assert script.count("#SBATCH hetjob") == 3 and "--het-group=0,1,2,3 " in script
    assert "#SBATCH --gres=gpu:h800:2" in script and "#SBATCH --gres=gpu:h20:3" in script


def test_single_pool_configs_keep_their_plan(tmp_path: Path) -> None:
    config = load_config(_config_file(tmp_path, '[run]\nname = "one"\n[roles.rollout]\nnum_ranks = 2\n'))
    plan = make_plan(config.roles)
    assert plan.pools() == {"default": range(1, 3)} and [p.name for p in config.roles.pools()] == ["default"]
    assert all(r.pool == "" for r in plan.roles)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (("[roles.controller]", "[roles.rollout]\nnum_ranks = 3\n[roles.controller]"), "roles.rollout"),
        (('name = "bandwidth"', 'name = "compute"'), "roles.rollout_pools"),
        (('calc_math = "bandwidth"', 'calc_math = "h20"'), "routing.families.calc_math"),
        (('calc_math = "bandwidth"', 'frozenlake = "bandwidth"'), "routing.families.frozenlake"),
        (("num_slots = 64", "prefill_cost_scale = 0.5"), "roles.rollout_pools[1]"),
        (('policy = "static"', 'policy = "hash"'), "routing.policy"),
    ],
)
def test_bad_pool_configs_name_the_field(tmp_path: Path, change: tuple[str, str], field: str) -> None:
    with pytest.raises(UsageError, match=field.replace("[", r"\[").replace("]", r"\]")):
        load_config(_config_file(tmp_path, TWO_POOLS.replace(*change)))


POOLS = [PoolSpec("compute", (1, 2), slots=2, tags=("household",)), PoolSpec("bandwidth", (3,), slots=2)]


def _router(policy: str = "static", **kw: object) -> Router:
    families = {"calc_math": "bandwidth"} if policy != "hash" else {}
    return Router(RoutingConfig(policy=policy, families=families, **kw), POOLS)  # type: ignore[arg-type]


def test_static_routes_by_family_map_then_tags_to_the_least_loaded_rank() -> None:
    router = _router()
    router.begin("e1", "household", ("household", "pick"))
    router.begin("e2", "calc_math", ("calc_math",))
    assert router.route("e1/t0", 100, 10) in (1, 2)
    assert router.route("e2/t0", 10, 100) == 3
    router.begin("e3", "household", ("household",))
    first = router.last_rank["e1"]
    assert router.route("e3/t0", 100, 10) == 3 - first  # the other, less-loaded rank of the pool


def test_saturated_pool_falls_back_and_returns_when_load_drops() -> None:
    router = _router()
    for i in range(4):  # 2 ranks x 2 slots of pool compute
        router.begin(f"h{i}", "household", ("household",))
        assert router.route(f"h{i}/t0", 50, 10) in (1, 2)
    router.begin("h9", "household", ("household",))
    assert router.route("h9/t0", 50, 10) == 3
    assert router.counters["compute"].fallbacks_out == 1 and router.counters["bandwidth"].fallbacks_in == 1
    router.on_load(RankLoad(1, "compute", requests=0, tokens=0))  # rank 1 drained
    router.begin("h10", "household", ("household",))
    assert router.route("h10/t0", 50, 10) == 1


def test_sticky_keeps_an_episode_on_its_rank_until_saturated() -> None:
    router = _router(sticky=True)
    router.begin("e", "household", ("household",))
    rank = router.route("e/t0", 10, 10)
    router.on_output("e/t0", 5)
    router.on_load(RankLoad(rank, "compute", requests=1, tokens=500))  # busier than the other rank
    assert router.route("e/t1", 20, 10) == rank


def test_hash_policy_is_the_single_pool_behaviour() -> None:
    router = _router("hash")
    for i in range(20):
        router.begin(f"ep{i}", "calc_math", ())
        assert router.route(f"ep{i}/t3", 5, 5) == [1, 2, 3][rollout_index(f"ep{i}", 3)]


def test_in_flight_requests_are_released_once() -> None:
    router = _router()
    router.begin("e", "calc_math", ())
    router.route("e/t0", 10, 5)
    router.on_output("e/t0", 4)
    router.on_output("e/t0", 4)
    router.route("e/t1", 10, 5)
    router.forget("e/t1")
    assert not router.inflight and router.work["calc_math"] == [1, 10, 4]


def test_pool_cost_recovers_per_token_costs() -> None:
    rng, sums = random.Random(0), [0.0] * 5
    meter = StepMeter()
    for _ in range(50):
        p, d = rng.randint(0, 400), rng.randint(1, 16)
        meter.record(p, d, 2e-5 * p + 3e-3 * d)
    cost = pool_cost(meter.fit, ranks=2)
    assert cost is not None and cost.prefill_s == pytest.approx(2e-5) and cost.decode_s == pytest.approx(3e-3)
    assert pool_cost(tuple(sums), 1) is None  # type: ignore[arg-type]


def test_cost_profile_stretches_each_share() -> None:
    profile = CostProfile(prefill_scale=4.0, decode_scale=1.0)
    assert profile.stretch(1.0, prefill=30, decode=10) == pytest.approx(3.25)
    assert profile.stretch(1.0, 0, 0) == 1.0


COSTS = {"compute": PoolCost(1e-5, 4e-3, 2), "bandwidth": PoolCost(4e-5, 1e-3, 2)}
WORK = {"household": FamilyWork(100, 2000, 4), "calc_math": FamilyWork(100, 60, 80)}


def test_adaptive_maps_prefill_heavy_to_compute_and_decode_heavy_to_bandwidth() -> None:
    shares = best_shares(WORK, COSTS, min_share=0.05)
    assert shares["household"]["compute"] > 0.5 and shares["calc_math"]["bandwidth"] > 0.5
    assert all(v >= 0.05 - 1e-9 for split in shares.values() for v in split.values())
    wrong = {
        "household": {"compute": 0.05, "bandwidth": 0.95},
        "calc_math": {"compute": 0.95, "bandwidth": 0.05},
    }
    assert makespan(shares, WORK, COSTS) < makespan(wrong, WORK, COSTS) / 3


def test_adaptive_decision_has_hysteresis_and_its_numbers() -> None:
    best = best_shares(WORK, COSTS, min_share=0.05)
    kept = decide(best, WORK, COSTS, hysteresis=0.1, min_share=0.05)
    assert not kept.switched and kept.shares == best or kept.makespan_best >= kept.makespan_current * 0.9
    wrong = {"household": {"compute": 0.5, "bandwidth": 0.5}, "calc_math": {"compute": 0.5, "bandwidth": 0.5}}
    moved = decide(wrong, WORK, COSTS, hysteresis=0.1, min_share=0.05)
    assert moved.switched and moved.makespan_best < 0.9 * moved.makespan_current
    assert set(moved.to_dict()) == {
        "shares",
        "switched",
        "makespan_current_s",
        "makespan_best_s",
        "pool_load_s",
    }


def test_router_adapts_from_reported_costs() -> None:
    now = [0.0]
    router = Router(RoutingConfig(policy="adaptive", adapt_every_s=1.0), POOLS, clock=lambda: now[0])
    for rank, (a, b) in {1: (1e-5, 4e-3), 2: (1e-5, 4e-3), 3: (4e-5, 1e-3)}.items():
        meter = StepMeter()
        for p, d in [(400, 2), (0, 8), (100, 4), (30, 16)] * 15:
            meter.record(p, d, a * p + b * d)
        router.on_load(RankLoad(rank, router.pool_of_rank[rank], 0, 0, steps=meter.steps, fit=meter.fit))
    for i in range(40):
        family = "household" if i % 2 else "calc_math"
        router.begin(f"e{i}", family, (family,))
        router.route(f"e{i}/t0", 2000 if i % 2 else 60, 80)
        router.on_output(f"e{i}/t0", 4 if i % 2 else 80)
    now[0] = 2.0
    record = router.maybe_adapt()
    assert record is not None and record["switched"]
    assert router.shares["household"]["compute"] > 0.5 and router.shares["calc_math"]["bandwidth"] > 0.5
    assert router.decisions == [record] and "pool_cost_us_per_token" in record


class _CountingEngine:
    """A fake engine that keeps the built-in engine's token counters: each step prefills 30, decodes 10."""

    def __init__(self) -> None:
        self.prefill_tokens = self.decode_tokens = 0

    def step(self) -> list[object]:
        self.prefill_tokens += 30
        self.decode_tokens += 10
        return []


def test_step_meter_stretches_steps_by_the_profile_and_records_tokens() -> None:
    import time

    meter = StepMeter(CostProfile(prefill_scale=1.0, decode_scale=1.0))
    engine = _CountingEngine()
    meter.run_step(engine)  # type: ignore[arg-type]
    assert (meter.prefill_tokens, meter.decode_tokens, meter.steps) == (30, 10, 1)
    slow = StepMeter(CostProfile(prefill_scale=1.0, decode_scale=1.0 + 4 * 200.0))  # decode share 1/4
    start = time.perf_counter()
    slow.run_step(engine)  # type: ignore[arg-type]
    took = time.perf_counter() - start
    assert took >= slow.busy_s > 0  # the step really took its stretched time (201x the measured)
    assert slow.sums[0] == 30 * 30 and slow.sums[2] == 10 * 10


def test_shipped_two_pool_config_renders_one_component_per_pool() -> None:
    repo = Path(__file__).resolve().parent.parent
    config = load_config(repo / "configs" / "gpu_2pools.toml")
    components = het_components(make_plan(config.roles))
    pools = [c for c in components if c.roles[0].startswith("rollout:")]
    assert [(c.roles, c.partition, c.gpu_type, c.num_ranks) for c in pools] == [
        (("rollout:compute",), "h800", "h800", 8),
        (("rollout:bandwidth",), "h20", "h20", 8),
    ]
    assert config.routing.policy == "adaptive" and config.rollout.engine == "vllm"
