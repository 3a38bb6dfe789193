"""`launch.py simulate CONFIG --calibrate RUN_DIR [overrides] [--check RUN_DIR ...] [--modes ...] [--staleness ...]`.

Calibrates the discrete-event model (`rollart_hpc.sim`) on a measured run's controller trace, then:
- validation: predicts the calibration run itself and every `--check` run (other sizes or modes measured on
  the same machine), each from its own resolved config, and reports the relative errors of
  trajectories/s and step time against what the run measured;
- projection: predicts CONFIG with its overrides (any size: rollout, env and trainer ranks, slots, batch),
  on hardware `--rollout-speed`/`--trainer-speed`/`--env-speed` times the calibration machine's, for each
  of `--modes` and, in async mode, each bound of `--staleness`.
Prints a table; `--json OUT` writes everything.

Past the calibration machine: `--hardware h800 --model CONFIG_JSON` replaces `--calibrate` with a cost profile
from datasheets and the model's shape (`rollart_hpc.sim.hardware`) and a synthetic workload
(`rollart_hpc.sim.workload`); `--reproduce rollart` projects RollArt's results (`rollart_hpc.sim.reproduce`)
and, with `--benchmarks FILE`, appends them to FILE as a dated section.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rollart_hpc.contracts.errors import UsageError

MODES = ("sync", "one_step_off", "async")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", help="TOML config of the pipeline to project")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. roles.rollout.num_ranks=128")
    parser.add_argument("--calibrate", help="run directory whose trace calibrates the model")
    parser.add_argument("--hardware", help="instead of --calibrate: GPU type of every role, e.g. h800")
    parser.add_argument("--model", help="with --hardware: the model's config.json")
    parser.add_argument("--reproduce", choices=["rollart"], help="project a paper's results")
    parser.add_argument("--benchmarks", help="with --reproduce: append the table to this file")
    parser.add_argument("--check", action="append", default=[], help="another measured run to predict")
    parser.add_argument(
        "--modes", default="", help="comma-separated modes to project (default: the config's)"
    )
    parser.add_argument(
        "--staleness", default="", help="comma-separated async bounds to project, e.g. 0,1,2,4"
    )
    parser.add_argument("--rollout-speed", type=float, default=1.0, help="rollout hardware speed factor")
    parser.add_argument("--trainer-speed", type=float, default=1.0, help="trainer hardware speed factor")
    parser.add_argument("--env-speed", type=float, default=1.0, help="env hardware speed factor")
    parser.add_argument("--seeds", type=int, default=3, help="simulated runs per prediction (default 3)")
    parser.add_argument("--json", help="write the results here")


def _int_list(text: str, name: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"--{name} must be comma-separated integers, got {text!r}") from None
    if any(v < 0 for v in values):
        raise UsageError(f"--{name} values must be >= 0, got {text!r}")
    return values


def _check_args(args: argparse.Namespace) -> tuple[list[str], list[int]]:
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise UsageError(f"--modes: unknown mode {unknown[0]!r}; choose from {', '.join(MODES)}")
    for name in ("rollout_speed", "trainer_speed", "env_speed"):
        if getattr(args, name) <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if args.seeds < 1:
        raise UsageError(f"--seeds must be >= 1, got {args.seeds}")
    return modes, _int_list(args.staleness, "staleness")


def _run_config(run_dir: Path) -> Any:
    from rollart_hpc.config import read_resolved
    from rollart_hpc.config.resolve import RESOLVED_NAME

    if not (run_dir / RESOLVED_NAME).is_file():
        raise UsageError(f"{run_dir} is not a run directory (no {RESOLVED_NAME})")
    return read_resolved(run_dir)


def _error(predicted: float, measured: float) -> float:
    return (predicted - measured) / measured


def validate(run_dir: Path, profile: Any, seeds: int) -> dict[str, Any]:
    """Predict a measured run from its own config with `profile`; the relative errors."""
    from rollart_hpc.sim.model import Scenario, simulate
    from rollart_hpc.sim.profile import measured, read_trace

    config = _run_config(run_dir)
    done = measured(read_trace(run_dir))
    predicted = simulate(Scenario(config), profile, seeds)
    return {
        "run_dir": str(run_dir),
        "mode": config.controller.mode,
        "staleness": config.controller.staleness,
        "measured": {"trajectories_per_s": done.trajectories_per_s, "step_s": done.step_s},
        "predicted": predicted,
        "error": {
            "trajectories_per_s": _error(predicted["trajectories_per_s"], done.trajectories_per_s),
            "step_s": _error(predicted["step_s"], done.step_s),
        },
    }


def _reproduce(args: argparse.Namespace) -> int:
    from rollart_hpc.sim.reproduce import benchmarks_section, reproduce, table

    rows = reproduce(seeds=args.seeds)
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"paper": "rollart", "rows": rows}, indent=2))
    if args.benchmarks:
        with open(args.benchmarks, "a") as out:
            out.write(benchmarks_section(rows))
    return 0


def hardware_profile(config: Any, hardware: str, model: str) -> tuple[Any, Any]:
    """(hardware profile, synthetic episodes) for `config` on `hardware`: every rollout rank one engine of
    that GPU, the trainer ranks one GPU each."""
    from rollart_hpc.sim.hardware import GpuPool, HardwareProfile, TrainerLayout, parse_hardware, read_model
    from rollart_hpc.sim.workload import Workload, sample

    parsed = parse_hardware(hardware)
    if len(parsed) != 1 or parsed[0][1]:
        raise UsageError(
            f"--hardware: simulate takes one GPU type without a count, e.g. h800; got {hardware!r}"
        )
    gpu = parsed[0][0]
    shape = read_model(model)
    hw = HardwareProfile(
        shape,
        (GpuPool(gpu.name, gpu, config.roles.rollout.num_ranks, max_slots=config.rollout.num_slots),),
        gpu,
        TrainerLayout(max(config.roles.trainer.num_ranks, 1)),
    )
    episodes = sample(Workload(), 4 * config.controller.batch_size * (config.controller.num_steps + 2))
    return hw, episodes


def main(args: argparse.Namespace) -> int:
    from rollart_hpc.config import load_config
    from rollart_hpc.sim.model import Scenario, refine, simulate
    from rollart_hpc.sim.profile import calibrate

    if args.reproduce:
        return _reproduce(args)
    if not args.config:
        raise UsageError("simulate: give a CONFIG (or --reproduce rollart)")
    if bool(args.calibrate) == bool(args.hardware):
        raise UsageError("simulate: give exactly one of --calibrate RUN_DIR and --hardware GPU")
    if args.hardware and not args.model:
        raise UsageError("--hardware needs --model CONFIG_JSON (the model's shape)")
    if args.hardware and (args.rollout_speed != 1.0 or args.trainer_speed != 1.0):
        raise UsageError(
            "--rollout-speed/--trainer-speed scale a calibrated profile; --hardware sets the GPUs"
        )
    modes, bounds = _check_args(args)
    base = load_config(args.config, args.overrides)
    checks: list[dict[str, Any]] = []
    hw = None
    if args.hardware:
        hw, episodes = hardware_profile(base, args.hardware, args.model)
        _, profile = hw.scenario(base, episodes)
    else:
        source = Path(args.calibrate).resolve()
        run_config = _run_config(source)
        profile, _ = calibrate(source, run_config.roles.rollout.num_ranks)
        profile = refine(profile, Scenario(run_config))
        checks = [validate(source, profile, args.seeds)]
        checks += [validate(Path(d).resolve(), profile, args.seeds) for d in args.check]

    projections = []
    for mode in modes or [base.controller.mode]:
        for bound in (bounds or [-1]) if mode == "async" else [-1]:
            config = load_config(
                args.config, [*args.overrides, f"controller.mode={mode}", f"controller.max_staleness={bound}"]
            )
            if hw is not None:
                scenario, _ = hw.scenario(config, episodes, env_speed=args.env_speed, tokens_per_event=32)
            else:
                scenario = Scenario(config, args.rollout_speed, args.trainer_speed, args.env_speed)
            projections.append(
                {
                    "mode": mode,
                    "staleness": config.controller.staleness,
                    **simulate(scenario, profile, args.seeds),
                }
            )
    result = {"profile": profile.summary(), "validation": checks, "projection": projections}
    print(_table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


def _table(result: dict[str, Any]) -> str:
    lines = [
        "validation (predicted vs measured)",
        "run | mode | traj/s measured | predicted | error | step s measured | predicted | error",
    ]
    for c in result["validation"]:
        m, p, e = c["measured"], c["predicted"], c["error"]
        lines.append(
            f"{Path(c['run_dir']).name} | {c['mode']} | {m['trajectories_per_s']:.2f} | {p['trajectories_per_s']:.2f} | "
            f"{e['trajectories_per_s']:+.1%} | {m['step_s']:.2f} | {p['step_s']:.2f} | {e['step_s']:+.1%}"
        )
    lines += ["", "projection", "mode | staleness | traj/s | step s | rollout busy | trainer busy"]
    for p in result["projection"]:
        lines.append(
            f"{p['mode']} | {p['staleness']} | {p['trajectories_per_s']:.2f} | {p['step_s']:.2f} | "
            f"{p['busy']['rollout']:.2f} | {p['busy']['trainer']:.2f}"
        )
    return "\n".join(lines)
