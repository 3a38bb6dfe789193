"""Projections from datasheets: the cost model's units, the synthetic workload's tail, RollArt's table from
the CLI, and one-line errors for bad hardware strings."""

from __future__ import annotations

import json
from collections.abc import Generator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import simpy

from rollart_hpc.contracts.errors import UsageError
from rollart_hpc.entry import cli
from rollart_hpc.plan.gpus import gpu_spec
from rollart_hpc.sim.hardware import (
    Efficiency,
    TrainerLayout,
    engine_cost,
    parse_hardware,
    read_model,
    trainer_step_s,
)
from rollart_hpc.sim.model import RewardGpus, Simulation, _Lockstep
from rollart_hpc.sim.workload import FAMILIES, Workload, sample_episode

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "configs/models/qwen2.5-7b/config.json"
FULL = Efficiency(prefill_mfu=1.0, decode_mbu=1.0, decode_mfu=1.0, train_mfu=1.0)


def test_model_shape_from_config_json():
    shape = read_model(MODEL)
    assert shape.params == 7_615_616_512  # Qwen2.5-7B's parameter count, as the memory plan counts it
    assert shape.kv_bytes_per_token == 2 * 28 * 4 * 128 * 2  # K and V, 28 layers, 4 KV heads of 128, bf16


def test_prefill_at_peak_and_decode_at_bandwidth():
    shape, h800 = read_model(MODEL), gpu_spec("h800")
    cost = engine_cost(h800, shape, tp=1, context=1000, eff=FULL)
    n = 4096
    assert n * cost.prefill_s_per_token == pytest.approx(n * 2 * shape.params / 989e12)
    assert cost.decode_s == pytest.approx(shape.params * 2 / 3.35e12)  # one read of the bf16 weights
    kv = 1000 * shape.kv_bytes_per_token / 3.35e12
    assert cost.decode_s_per_request == pytest.approx(kv + 2 * shape.params / 989e12)
    # the H20's decode step is faster (more bandwidth), its prefill ~6.7x slower (less compute)
    h20 = engine_cost(gpu_spec("h20"), shape, tp=1, context=1000, eff=FULL)
    assert h20.decode_s < cost.decode_s
    assert h20.prefill_s_per_token / cost.prefill_s_per_token == pytest.approx(989 / 148)
    tp2 = engine_cost(h800, shape, tp=2, context=1000, eff=FULL)
    assert tp2.prefill_s_per_token == pytest.approx(cost.prefill_s_per_token / 2)


def test_trainer_step_flops_and_communication():
    shape, h800 = read_model(MODEL), gpu_spec("h800")
    fixed, per_token = trainer_step_s(h800, shape, TrainerLayout(gpus=1), FULL)
    assert fixed == 0.0  # one GPU: no gradient reduction
    assert per_token == pytest.approx(8 * shape.params / 989e12)  # 6 + 2 (one recomputed forward)
    fixed8, per_token8 = trainer_step_s(h800, shape, TrainerLayout(gpus=8), FULL)
    assert per_token8 == pytest.approx(per_token / 8)
    assert fixed8 == pytest.approx(2 * shape.weight_bytes * 2 * 7 / 8 / (50e9 * 0.8))


def test_response_lengths_are_long_tailed():
    rng = np.random.default_rng(0)
    math_family = FAMILIES["gem_math"]
    lengths = [sample_episode(rng, math_family, Workload()).gen[0] for _ in range(512)]
    assert 5 * np.mean(lengths) < max(lengths) < 10 * np.mean(lengths)


@pytest.mark.parametrize("text", ["b300", "h800:x", "h800:-1", ",h20"])
def test_bad_hardware_is_a_usage_error(text):
    with pytest.raises(UsageError, match="--hardware"):
        parse_hardware(text)


def test_simulate_bad_hardware_is_one_line(capsys):
    code = cli.main(
        ["simulate", str(REPO / "configs/tiny.toml"), "--hardware", "h900", "--model", str(MODEL)]
    )
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "unknown GPU 'h900'" in err


def test_reproduce_rollart_json_has_every_result(tmp_path):
    out = tmp_path / "rollart.json"
    bench = tmp_path / "BENCH.md"
    assert cli.main(["simulate", "--reproduce", "rollart", "--seeds", "1", "--json", str(out),
                     "--benchmarks", str(bench)]) == 0  # fmt: skip
    rows = json.loads(out.read_text())["rows"]
    assert {r["result"][:3] for r in rows} == {"(a)", "(b)", "(c)", "(d)", "(e)"}
    for r in rows:
        assert set(r) >= {"paper", "simulated", "relative_error", "setting"}
    ratios = [r for r in rows if not r["result"].startswith("(e)")]
    assert all(r["simulated"] > 1.0 for r in ratios)  # each RollArt mechanism helps in the model
    dedicated, serverless = (r["simulated"] for r in rows if r["result"].startswith("(e)"))
    assert 0.0 < dedicated < serverless < 1.0
    assert "not measured" in bench.read_text()


def _drive(pool: RewardGpus, env: simpy.Environment, at: float, tokens: int) -> Generator[Any, Any, None]:
    yield env.timeout(at)
    yield env.process(pool.score(tokens))


def test_dedicated_reward_gpus_utilisation():
    env = simpy.Environment()
    pool = RewardGpus(s_per_token=0.01, gpus=2)
    pool.bind(env)
    for _ in range(4):
        env.process(_drive(pool, env, 0.0, 100))  # 1 s each, two at a time
    env.run()
    assert env.now == pytest.approx(2.0)
    assert pool.utilisation(4.0) == pytest.approx(4.0 / (2 * 4.0))


def test_serverless_instances_start_cold_and_expire_after_keep_alive():
    env = simpy.Environment()
    pool = RewardGpus(s_per_token=0.01, cold_start_s=1.0, keep_alive_s=2.0, target_concurrency=1)
    pool.bind(env)
    env.process(_drive(pool, env, 0.0, 100))  # cold start 1 s, busy 1 s, idle from 2 s, gone at 4 s
    env.process(_drive(pool, env, 10.0, 100))  # a new instance: 10 s to 12 s, held until 14 s
    env.run()
    assert env.now == pytest.approx(12.0)
    assert pool.utilisation(14.0) == pytest.approx(2.0 / (4.0 + 4.0))


def test_lockstep_waits_for_every_running_member():
    env = simpy.Environment()
    group = _Lockstep(env, 3)
    first = group.arrive(0)
    assert not first.triggered
    group.arrive(0)
    assert not first.triggered
    group.leave()  # the third member finished its last turn: the other two go on
    assert first.triggered


def test_simulate_projects_a_config_on_datasheet_hardware(tmp_path):
    out = tmp_path / "proj.json"
    tiny = str(REPO / "configs/tiny.toml")
    code = cli.main(["simulate", tiny, "controller.num_steps=3", "--hardware", "h800", "--model", str(MODEL),
                     "--modes", "sync,async", "--seeds", "1", "--json", str(out)])  # fmt: skip
    assert code == 0
    result = json.loads(out.read_text())
    sync, async_ = result["projection"]
    assert (
        result["validation"] == [] and result["profile"]["prefill_s_per_token"] == 0.0
    )  # costs in the pools
    assert async_["trajectories_per_s"] > sync["trajectories_per_s"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--hardware", "h800:8"], "one GPU type without a count"),
        (["--hardware", "h800"], "needs --model"),
        (["--hardware", "h800", "--calibrate", "runs/x"], "exactly one of"),
    ],
)
def test_simulate_hardware_usage_errors(argv, message, capsys):
    args = ["simulate", str(REPO / "configs/tiny.toml"), *argv]
    if message != "needs --model":
        args += ["--model", str(MODEL)]
    assert cli.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and message in err


def test_pools_serve_their_families_only():
    from rollart_hpc.sim.hardware import GpuPool, HardwareProfile
    from rollart_hpc.sim.reproduce import config
    from rollart_hpc.sim.workload import sample

    shape = read_model(MODEL)
    pools = (
        GpuPool("prefill", gpu_spec("h800"), 2, families=("swe",)),
        GpuPool("decode", gpu_spec("h20"), 2, families=("gem_math",)),
    )
    hw = HardwareProfile(shape, pools, gpu_spec("h800"), TrainerLayout(2))
    math_only = Workload(families=(FAMILIES["gem_math"],))
    scenario, profile = hw.scenario(config("async", 1, batch=8), sample(math_only, 64), tokens_per_event=32)
    busy = Simulation(scenario, profile).run().busy
    assert busy["pool:prefill"] == 0.0 and busy["pool:decode"] > 0.0
