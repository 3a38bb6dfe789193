"""The run directory's layout: one named path for everything a run writes and its readers read.

Every writer and reader goes through `RunLayout(run_dir)`; nothing else spells these names. Files other
processes or a restart read are written atomically (`contracts.atomic`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


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

    @property
    def config(self) -> Path:
        """The resolved config (`launch.py run` writes it; every rank and `resume` read it)."""
        return self.root / self.CONFIG_NAME

    @property
    def metrics(self) -> Path:
        """One JSON row per optimizer step and per evaluation round (`metrics.run_metrics`)."""
        return self.root / self.METRICS_NAME

    @property
    def summary(self) -> Path:
        """The end-of-run summary; its presence marks a finished `rl` run."""
        return self.root / self.SUMMARY_NAME

    @property
    def trajectories(self) -> Path:
        """The HDF5 trajectory store."""
        return self.root / self.TRAJECTORIES_NAME

    @property
    def restarts(self) -> Path:
        """One row per automatic restart, with its cause."""
        return self.root / self.RESTARTS_NAME

    @property
    def eval_result(self) -> Path:
        """The result of an `eval` job (`launch.py eval`)."""
        return self.root / self.EVAL_RESULT_NAME

    @property
    def failures(self) -> Path:
        """One report per rank that failed in this attempt (`failure(rank)`)."""
        return self.root / "failures"

    def failure(self, rank: int) -> Path:
        return self.failures / f"rank-{rank}.json"

    @property
    def pids(self) -> Path:
        """Each rank's pid file and exit file of this attempt (`pid_file`, `exit_file`)."""
        return self.root / "pids"

    def pid_file(self, rank: int) -> Path:
        return self.pids / f"rank-{rank}.pid"

    def exit_file(self, rank: int) -> Path:
        return self.pids / f"rank-{rank}.exit"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def tensorboard(self) -> Path:
        return self.root / "tensorboard"

    @property
    def model(self) -> Path:
        """The run's model directories (the initial model, the warm start, HF exports)."""
        return self.root / "model"

    @property
    def routing(self) -> Path:
        """Each env rank's routing decisions."""
        return self.root / "routing"

    @property
    def reward(self) -> Path:
        """Each reward rank's statistics."""
        return self.root / "reward"

    @property
    def evals(self) -> Path:
        """The worlds of `launch.py eval`, one per evaluated checkpoint."""
        return self.root / "evals"

    @property
    def report(self) -> Path:
        """`launch.py report`'s default output folder."""
        return self.root / "report"

    @property
    def redundant(self) -> Path:
        """The controller's log of redundant dispatches."""
        return self.root / "redundant.jsonl"

    @property
    def job_script(self) -> Path:
        """The sbatch script `launch.py submit` wrote for this run."""
        return self.root / "job.sbatch"


RUN_OUTPUTS = (RunLayout.TRAJECTORIES_NAME, RunLayout.METRICS_NAME, RunLayout.SUMMARY_NAME)
"""Files whose presence means a run directory already holds a run's results."""


def read_restarts(run_dir: Path) -> list[dict[str, Any]]:
    """The rows of the run's restart log (one per restart: `restart`, `step`, `cause`, `time`)."""
    path = RunLayout(run_dir).restarts
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
