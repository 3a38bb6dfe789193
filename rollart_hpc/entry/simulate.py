"""`launch.py simulate CONFIG --calibrate RUN_DIR [overrides] [--check RUN_DIR ...] [--modes ...] [--staleness ...]`.

Calibrates the discrete-event model (`rollart_hpc.sim`) on a measured run's controller trace, then:
- validation: predicts the calibration run itself and every `--check` run (other sizes or modes measured on
  the same machine), each from its own resolved config, and reports the relative errors of
  trajectories/s and step time against what the run measured;
- projection: predicts CONFIG with its overrides (any size: rollout, env and trainer ranks, slots, batch),
  on hardware `--rollout-speed`/`--trainer-speed`/`--env-speed` times the calibration machine's, for each
  of `--modes` and, in async mode, each bound of `--staleness`.
Prints a table; `--json OUT` writes everything.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rollart_hpc.contracts.errors import UsageError

MODES = ("sync", "one_step_off", "async")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="TOML config of the pipeline to project")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. roles.rollout.num_ranks=128")
    parser.add_argument("--calibrate", required=True, help="run directory whose trace calibrates the model")
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


def main(args: argparse.Namespace) -> int:
    from rollart_hpc.config import load_config
    from rollart_hpc.sim.model import Scenario, refine, simulate
    from rollart_hpc.sim.profile import calibrate

    modes, bounds = _check_args(args)
    base = load_config(args.config, args.overrides)
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
