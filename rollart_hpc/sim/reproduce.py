"""RollArt's results (arXiv 2512.22560 v2 §7) projected by the simulator from datasheets, not measured.

Setting (the same for every row unless the row says otherwise):
- Model: the shipped Qwen2.5-7B config.json (the paper's smallest model is Qwen3-8B, of the same size).
- Workload: `sim.workload.Workload()`, the five task families sampled uniformly (§7.1).
- Scale: the paper's clusters divided by `SCALE` (8: 128 GPUs -> 16, batch 512 -> 64), which keeps the
  GPU-per-trajectory ratio; the controller, rollout and trainer are the simulator's.
- Split: RollArt gives half of its H800s to the trainer; its H800 pool serves the prefill-heavy families and
  its H20 pool the decode-heavy ones (§4.1). Disaggregated baselines split their H800s in half; Sync+ is
  colocated: every GPU generates, then every GPU trains (no overlap in sync mode).
- Reward (row e): three concurrent GEM-math jobs (Qwen2.5-7B policy, a 7B reward model as in §7.1), each
  with 4 rollout, 4 trainer and 4 dedicated reward H800 (§3.1's 4-GPU reward model), against the same jobs
  with 8 rollout H800 each and one shared serverless reward pool; a reward scores its trajectory's tokens
  as a prefill on one H800. Serverless instances start after `COLD_START_S` and stay for `KEEP_ALIVE_S`.
- AReaL-style: asynchronous with bound 1 on H800 only, no hardware affinity (the paper's re-implementation
  shares everything else; what remains is the hardware mapping).
Each row names what it compares; nothing is fitted to the paper's values.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import simpy

from rollart_hpc.config import load_config
from rollart_hpc.plan.gpus import gpu_spec
from rollart_hpc.sim.hardware import Efficiency, GpuPool, HardwareProfile, TrainerLayout, read_model
from rollart_hpc.sim.model import RewardGpus, Simulation, simulate
from rollart_hpc.sim.workload import DECODE_HEAVY, FAMILIES, PREFILL_HEAVY, Workload, sample

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "configs/models/qwen2.5-7b/config.json"
BASE = REPO / "configs/tiny.toml"
SCALE = 8
BATCH = 512 // SCALE
STEPS = 6
TOKENS_PER_EVENT = 32
DATE = "2026-12-04"
JOBS = 3
# Knative Serving's default scale-to-zero grace period (docs: "scale-to-zero-grace-period", 30s).
KEEP_ALIVE_S = 30.0
# Starting a 7B model server: this model's choice, of the order ServerlessLLM (arXiv 2401.14351) reports for
# loading a checkpoint of that size with standard loaders.
COLD_START_S = 10.0
# Knative's default target of concurrent requests per instance (docs: "container-concurrency-target-default").
TARGET_CONCURRENCY = 100


def config(mode: str, staleness: int = -1, batch: int = BATCH) -> Any:
    return load_config(
        BASE,
        [
            f"controller.mode={mode}",
            f"controller.max_staleness={staleness}",
            f"controller.batch_size={batch}",
            f"controller.num_steps={STEPS}",
            "controller.checkpoint_every_steps=0",
            "controller.eval_every_steps=0",
            f"envs.num_slots={4 * batch}",
            f"envs.num_tasks={{calc_math = {4 * batch}}}",
        ],
    )


@dataclass(frozen=True)
class Cluster:
    """GPUs by type; `trainer` of them (of `trainer_gpu`) train, the rest generate."""

    h800: int
    h20: int
    trainer: int
    trainer_gpu: str = "h800"
    affinity: bool = True

    def profile(self) -> HardwareProfile:
        model = read_model(MODEL)
        h800_gen = self.h800 - (self.trainer if self.trainer_gpu == "h800" else 0)
        h20_gen = self.h20 - (self.trainer if self.trainer_gpu == "h20" else 0)
        both = h800_gen > 0 and h20_gen > 0 and self.affinity
        pools = (
            GpuPool("h800", gpu_spec("h800"), h800_gen, families=PREFILL_HEAVY if both else ()),
            GpuPool("h20", gpu_spec("h20"), h20_gen, families=DECODE_HEAVY if both else ()),
        )
        return HardwareProfile(
            model, pools, gpu_spec(self.trainer_gpu), TrainerLayout(self.trainer, tp=1, pp=1)
        )


def run(cluster: Cluster, mode: str, staleness: int = -1, workload: Workload | None = None,
        lockstep: int = 0, colocated: bool = False, seeds: int = 2) -> dict[str, Any]:  # fmt: skip
    """One projected setting: mean step seconds, trajectories/s and busy shares over `seeds` runs."""
    episodes = sample(workload or Workload(), 4 * BATCH * (STEPS + 2), seed=1)
    hw = cluster.profile()
    if colocated:  # every GPU generates and every GPU trains, in turn
        hw = HardwareProfile(
            hw.model,
            tuple(
                GpuPool(
                    p.name,
                    p.gpu,
                    p.gpus + (cluster.trainer if p.name == cluster.trainer_gpu else 0),
                    p.tp,
                    p.families,
                )
                for p in hw.pools
            ),  # fmt: skip
            hw.trainer_gpu,
            TrainerLayout(cluster.h800 + cluster.h20),
            hw.efficiency,
        )
    scenario, profile = hw.scenario(
        config(mode, staleness), episodes, lockstep=lockstep, tokens_per_event=TOKENS_PER_EVENT
    )
    return simulate(scenario, profile, seeds)


def reward_utilisation(serverless: bool, seeds: int = 2) -> float:
    """Mean reward-GPU utilisation of `JOBS` concurrent math jobs (module docstring)."""
    model = read_model(MODEL)
    s_per_token = 2 * model.params / (gpu_spec("h800").bf16_flops * Efficiency().prefill_mfu)
    math_only = Workload(families=(FAMILIES["gem_math"],))
    values = []
    for seed in range(seeds):
        env = simpy.Environment()
        shared = RewardGpus(s_per_token, cold_start_s=COLD_START_S, keep_alive_s=KEEP_ALIVE_S,
                            target_concurrency=TARGET_CONCURRENCY)  # fmt: skip
        sims, pools = [], []
        for job in range(JOBS):
            rollout = 8 if serverless else 4
            pool = shared if serverless else RewardGpus(s_per_token, gpus=4)
            hw = Cluster(h800=rollout + 4, h20=0, trainer=4, affinity=False).profile()
            episodes = sample(math_only, 4 * BATCH * (STEPS + 2), seed=10 * seed + job)
            scenario, profile = hw.scenario(
                config("async", 1), episodes, tokens_per_event=TOKENS_PER_EVENT, reward_pool=pool
            )
            sims.append(Simulation(scenario, profile, seed=seed * JOBS + job, env=env))
            pools.append(pool)
        for sim in sims:
            sim.start()
        env.run(until=simpy.AllOf(env, [sim.finished for sim in sims]))
        end = float(env.now)
        values.append(
            shared.utilisation(end) if serverless else sum(p.utilisation(end) for p in pools) / JOBS
        )
    return sum(values) / len(values)


def _row(
    name: str, paper: tuple[float, float], simulated: float, setting: str, note: str = ""
) -> dict[str, Any]:
    lo, hi = paper
    error = (
        0.0
        if lo <= simulated <= hi
        else (simulated - (lo if simulated < lo else hi)) / (lo if simulated < lo else hi)
    )
    return {"result": name, "paper": [lo, hi], "simulated": simulated, "relative_error": error,
            "within_25pct": abs(error) <= 0.25, "setting": setting, "note": note}  # fmt: skip


def reproduce(seeds: int = 2) -> list[dict[str, Any]]:
    s = SCALE
    rollart = Cluster(h800=96 // s, h20=32 // s, trainer=48 // s)
    h800_only = Cluster(h800=128 // s, h20=0, trainer=64 // s, affinity=False)
    ra = run(rollart, "async", 1, seeds=seeds)
    sync = run(h800_only, "sync", colocated=True, seeds=seeds)
    off = run(h800_only, "one_step_off", seeds=seeds)
    areal = run(h800_only, "async", 1, seeds=seeds)
    rows = []
    setting = (f"Qwen2.5-7B, 5-family mix, batch {BATCH}; RollArt {rollart.h800} H800 ({rollart.trainer} train) + "
               f"{rollart.h20} H20, async bound 1; baselines on {h800_only.h800} H800")  # fmt: skip
    for name, base, paper in (("Sync+", sync, 2.05), ("One-off", off, 1.35), ("AReaL", areal, 1.31)):
        rows.append(_row(f"(a) step-time reduction vs {name}", (paper, paper), base["step_s"] / ra["step_s"],
                         setting))  # fmt: skip
    rows.append(_row("(b) throughput over Sync+", (2.65, 4.58), ra["trajectories_per_s"] / sync["trajectories_per_s"],
                     setting, "the paper's range spans models and tasks; one setting here"))  # fmt: skip
    ratios = []
    for std in (1.0, 10.0):
        w = Workload().with_env(10.0, std)
        batch_level = run(rollart, "async", 1, workload=w, lockstep=BATCH // 4, seeds=seeds)
        traj_level = run(rollart, "async", 1, workload=w, seeds=seeds)
        ratios.append(batch_level["step_s"] / traj_level["step_s"])
    rows.append(_row("(c) trajectory- over batch-level env, std 1 s", (1.23, 1.23), ratios[0],
                     f"RollArt setting, env latency normal(10 s, 1 s), batch-level in groups of {BATCH // 4}"))  # fmt: skip
    rows.append(_row("(c) trajectory- over batch-level env, std 10 s", (2.27, 2.27), ratios[1],
                     "as above with std 10 s"))  # fmt: skip
    mixed = run(Cluster(h800=64 // s, h20=24 // s, trainer=32 // s), "async", 1, seeds=seeds)
    h20 = run(
        Cluster(h800=0, h20=208 // s, trainer=104 // s, trainer_gpu="h20", affinity=False),
        "async",
        1,
        seeds=seeds,
    )
    h800 = run(Cluster(h800=72 // s, h20=0, trainer=36 // s, affinity=False), "async", 1, seeds=seeds)
    h800_cost, h20_cost = gpu_spec("h800").cost, gpu_spec("h20").cost
    costs = (64 * h800_cost + 24 * h20_cost, 208 * h20_cost, 72 * h800_cost)
    het = (f"async bound 1, {64 // s} H800 + {24 // s} H20 vs {208 // s} H20 vs {72 // s} H800, half the GPUs "
           f"train; full-size cost {costs[0]:.0f} / {costs[1]:.0f} / {costs[2]:.0f} H20-hours per hour")  # fmt: skip
    rows.append(_row("(d) 64 H800 + 24 H20 over 208 H20", (1.30, 1.68), h20["step_s"] / mixed["step_s"], het))
    rows.append(
        _row("(d) 64 H800 + 24 H20 over 72 H800", (1.12, 1.37), h800["step_s"] / mixed["step_s"], het)
    )
    reward = (f"{JOBS} concurrent GEM-math jobs, batch {BATCH}, 7B reward model; serverless: cold start "
              f"{COLD_START_S:.0f} s, keep-alive {KEEP_ALIVE_S:.0f} s")  # fmt: skip
    rows.append(_row("(e) reward GPU utilisation, 4 dedicated GPUs per job", (0.06, 0.06),
                     reward_utilisation(False, seeds), reward, "paper: 6% (and 7.4% in §3.1)"))  # fmt: skip
    rows.append(_row("(e) reward GPU utilisation, shared serverless pool", (0.88, 0.88),
                     reward_utilisation(True, seeds), reward))  # fmt: skip
    return rows


# Why a row may miss by more than 25% (shown with the row when it does).
MISS_REASONS = {
    "(a) step-time reduction vs One-off": "the simulated One-off overlaps a whole step and loads weights as "
    "RollArt does; the paper's re-implementation keeps batch-level env interaction and blocking weight sync",
    "(b) throughput over Sync+": "one model and one mix here; the paper's upper end comes from its larger "
    "models and longer-tailed tasks, where the sync barrier waits longer",
    "(c) trajectory- over batch-level env, std 10 s": "batch-level groups are this model's choice "
    "(a quarter of the batch); a larger group waits for a slower straggler",
    "(e) reward GPU utilisation, 4 dedicated GPUs per job": "the reward model here only prefills the "
    "trajectory; a judge that also decodes a verdict holds its GPUs longer",
    "(e) reward GPU utilisation, shared serverless pool": "three jobs' rewards keep about one warm instance "
    "a quarter busy; the paper's pool is shared more widely than the three jobs it reports",
}


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["result | paper | simulated | rel. error | setting", "--- | --- | --- | --- | ---"]
    for r in rows:
        lo, hi = r["paper"]
        paper = f"{lo:.2f}" if lo == hi else f"{lo:.2f}-{hi:.2f}"
        sim = "n/a" if r["simulated"] != r["simulated"] else f"{r['simulated']:.2f}"
        err = "n/a" if r["simulated"] != r["simulated"] else f"{r['relative_error']:+.0%}"
        notes = [r["note"]] if r["note"] else []
        if r["simulated"] == r["simulated"] and not r["within_25pct"]:
            notes.append("misses: " + MISS_REASONS.get(r["result"], "see the setting"))
        note = f" ({'; '.join(notes)})" if notes else ""
        lines.append(f"{r['result']} | {paper} | {sim} | {err} | {r['setting']}{note}")
    return "\n".join(lines)


def benchmarks_section(rows: list[dict[str, Any]]) -> str:
    return (f"\n## RollArt's results, projected ({DATE})\n\nProjected by the simulator, not measured "
            f"(`python launch.py simulate --reproduce rollart`; assumptions in `rollart_hpc/sim/reproduce.py`, "
            f"`sim/hardware.py`, `sim/workload.py`). No parameter was set to meet a paper value: the "
            f"efficiency factors are the public measurements named in `sim/hardware.py`, the task families' costs "
            f"the model's own choices in `sim/workload.py`; a row outside 25% says why.\n\n{table(rows)}\n")  # fmt: skip


def today() -> str:
    return datetime.date.today().isoformat()
