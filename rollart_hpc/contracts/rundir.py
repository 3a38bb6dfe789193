"""The run directory's layout: one named path for everything a run writes and its readers read.

Every writer and reader goes through `RunLayout(run_dir)`; nothing else spells these names. Files other
processes or a restart read are written atomically (`contracts.atomic`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, overload


class _Under:
    """A named path in the run directory: on a `RunLayout`, `root / name`; `doc` says what it holds."""

    def __init__(self, name: str, doc: str = "") -> None:
        self.name, self.__doc__ = name, doc

    @overload
    def __get__(self, layout: None, owner: type) -> _Under: ...

    @overload
    def __get__(self, layout: RunLayout, owner: type) -> Path: ...

    def __get__(self, layout: RunLayout | None, owner: type) -> Path | _Under:
        return self if layout is None else layout.root / self.name


@dataclass(frozen=True)
class RunLayout:
    """The paths of one run directory `root`."""

    root: Path

    CONFIG_NAME = "config.resolved.toml"
    METRICS_NAME = "metrics.jsonl"
    SUMMARY_NAME = "summary.json"
    TRAJECTORIES_NAME = "trajectories.h5"
    RESTARTS_NAME = "restarts.jsonl"
    EVAL_RESULT_NAME = "eval.json"

    config = _Under(
        CONFIG_NAME, "The resolved config (`launch.py run` writes it; every rank and `resume` read it)."
    )
    metrics = _Under(
        METRICS_NAME, "One JSON row per optimizer step and per evaluation round (`metrics.run_metrics`)."
    )
    summary = _Under(SUMMARY_NAME, "The end-of-run summary; its presence marks a finished `rl` run.")
    trajectories = _Under(TRAJECTORIES_NAME, "The HDF5 trajectory store.")
    restarts = _Under(RESTARTS_NAME, "One row per automatic restart, with its cause.")
    eval_result = _Under(EVAL_RESULT_NAME, "The result of an `eval` job (`launch.py eval`).")
    failures = _Under("failures", "One report per rank that failed in this attempt (`failure(rank)`).")
    pids = _Under("pids", "Each rank's pid file and exit file of this attempt (`pid_file`, `exit_file`).")
    checkpoints = _Under("checkpoints")
    logs = _Under("logs")
    tensorboard = _Under("tensorboard")
    model = _Under("model", "The run's model directories (the initial model, the warm start, HF exports).")
    routing = _Under("routing", "Each env rank's routing decisions.")
    reward = _Under("reward", "Each reward rank's statistics.")
    evals = _Under("evals", "The worlds of `launch.py eval`, one per evaluated checkpoint.")
    report = _Under("report", "`launch.py report`'s default output folder.")
    redundant = _Under("redundant.jsonl", "The controller's log of redundant dispatches.")
    job_script = _Under("job.sbatch", "The sbatch script `launch.py submit` wrote for this run.")

    def failure(self, rank: int) -> Path:
        return self.failures / f"rank-{rank}.json"

    def pid_file(self, rank: int) -> Path:
        return self.pids / f"rank-{rank}.pid"

    def exit_file(self, rank: int) -> Path:
        return self.pids / f"rank-{rank}.exit"


RUN_OUTPUTS = (RunLayout.TRAJECTORIES_NAME, RunLayout.METRICS_NAME, RunLayout.SUMMARY_NAME)
"""Files whose presence means a run directory already holds a run's results."""


def read_restarts(run_dir: Path) -> list[dict[str, Any]]:
    """The rows of the run's restart log (one per restart: `restart`, `step`, `cause`, `time`)."""
    path = RunLayout(run_dir).restarts
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
