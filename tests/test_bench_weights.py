"""`bench weights`: the top-level figures derived from the per-size rows, and the worker's config."""

from __future__ import annotations

import argparse

import pytest

from rollart_hpc.bench.weights import add_arguments, headline, worker_config
from rollart_hpc.contracts.errors import UsageError


def _row(nbytes: int, ratio: float, blocked_s: float, ours_s: float, pause_s: float) -> dict[str, float]:
    return {"bytes": nbytes, "ratio_vs_raw": ratio, "trainer_blocked_s": blocked_s,
            "trainer_blocked_fraction": blocked_s / ours_s, "receiver_pause_s": pause_s}  # fmt: skip


def test_headline_reports_per_size_figures_and_the_worst_ratio_from_100_mb() -> None:
    rows = [_row(10_000_000, 0.5, 0.01, 0.02, 0.001), _row(100_000_000, 0.9, 0.02, 0.2, 0.002),
            _row(1_000_000_000, 0.85, 0.1, 2.0, 0.003)]  # fmt: skip
    top = headline(rows)
    assert top["ratio_vs_raw"] == {"10": 0.5, "100": 0.9, "1000": 0.85}
    assert top["min_ratio_vs_raw_from_100mb"] == 0.85  # the 10 MB row does not count
    assert top["trainer_blocked_s"] == {"10": 0.01, "100": 0.02, "1000": 0.1}
    assert top["trainer_blocked_fraction"]["1000"] == pytest.approx(0.05)
    assert top["max_trainer_blocked_fraction"] == pytest.approx(0.5)
    assert top["receiver_pause_s"] == {"10": 0.001, "100": 0.002, "1000": 0.003}


def test_headline_without_large_sizes_has_no_minimum() -> None:
    assert headline([_row(10_000_000, 0.5, 0.01, 0.02, 0.001)])["min_ratio_vs_raw_from_100mb"] is None


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--json", "out.json", *argv])


def test_worker_config_carries_the_modes_and_checks_sizes() -> None:
    default = worker_config(_parse())
    assert default["stream"] is True and default["snapshot"] is False  # what the trainer does
    config = worker_config(_parse("--deferred-pack", "--sizes-mb", "10,100"))
    assert config["snapshot"] is False and config["stream"] is False
    assert worker_config(_parse("--publish", "deferred")) == worker_config(_parse("--deferred-pack"))
    assert worker_config(_parse("--publish", "snapshot"))["snapshot"] is True
    assert worker_config(_parse("--stream")) == default
    for both in (("--stream", "--deferred-pack"), ("--publish", "snapshot", "--deferred-pack")):
        with pytest.raises(SystemExit):  # argparse: not allowed with argument ...
            _parse(*both)
    assert config["sizes_bytes"] == [10_000_000, 100_000_000]
    with pytest.raises(UsageError):
        worker_config(_parse("--sizes-mb", "0"))
    assert default["direct_bytes"] == 1_000_000
    assert worker_config(_parse("--direct-mb", "0"))["direct_bytes"] is None
    for bad in ("-1", "0.00001"):
        with pytest.raises(UsageError, match="--direct-mb"):
            worker_config(_parse("--direct-mb", bad))
