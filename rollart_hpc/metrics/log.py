"""Per-rank logging: one line per event on stdout with role and rank, mirrored to run_dir/logs/rank-<r>.log."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from rollart_hpc.contracts.rundir import RunLayout


def rank_logger(role: str, rank: int, run_dir: Path | None = None) -> logging.Logger:
    logger = logging.getLogger(f"rollart.{role}.{rank}")
    if logger.handlers:
        return logger
    logger.setLevel(logging.INFO)
    logger.propagate = False
    fmt = logging.Formatter(f"%(asctime)s [{role} {rank}] %(message)s", datefmt="%H:%M:%S")
    stream = logging.StreamHandler(sys.stdout)
    stream.setFormatter(fmt)
    logger.addHandler(stream)
    if run_dir is not None:
        RunLayout(run_dir).logs.mkdir(parents=True, exist_ok=True)
        file_handler = logging.FileHandler(RunLayout(run_dir).logs / f"rank-{rank}.log")
        file_handler.setFormatter(fmt)
        logger.addHandler(file_handler)
    return logger
