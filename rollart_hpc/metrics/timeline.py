"""Per-rank busy timelines: what each role rank was doing when, for plots and busy fractions.

Writers: every role loop owns one `Timeline`, records busy intervals from its own thread or asyncio
loop (`span()` or `add()`; no locks, one writer per Timeline), and writes it once when its loop ends to
`run_dir/timeline/rank-<r>.json` (atomic: temp file + rename, so a reader sees the whole file or none).
Readers (`launch.py report`, `bench e2e`) read whatever files exist, also while the run goes on.

Times are epoch seconds (`time.time()`), comparable across the ranks of one host and, with synchronised
clocks, across nodes. Intervals may overlap (an env rank runs many episodes at once): `busy_s` is the
sum of the recorded durations (work, counting overlaps), while `covered_s`/`busy_fraction` measure the
union (time during which at least one interval was open). To keep files small, an interval that starts
within `merge_gap_s` after the previous one ends is merged into it; `busy_s` stays exact.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Interval = tuple[float, float]
TIMELINE_DIR = "timeline"


class Timeline:
    """Busy intervals of one rank (one writer; see the module docstring)."""

    def __init__(
        self, role: str, rank: int, clock: Callable[[], float] = time.time, merge_gap_s: float = 0.0005
    ) -> None:
        if merge_gap_s < 0:
            raise ValueError(f"merge_gap_s must be >= 0, got {merge_gap_s}")
        self.role, self.rank, self.clock, self.merge_gap_s = role, rank, clock, merge_gap_s
        self.busy_s = 0.0
        self.num_spans = 0
        self.intervals: list[list[float]] = []

    def add(self, start: float, end: float) -> None:
        """Record one busy interval [start, end] (epoch seconds)."""
        if end < start:
            raise ValueError(f"interval ends before it starts: [{start}, {end}]")
        self.busy_s += end - start
        self.num_spans += 1
        last = self.intervals[-1] if self.intervals else None
        if last is not None and last[0] <= start <= last[1] + self.merge_gap_s:
            last[1] = max(last[1], end)
        else:
            self.intervals.append([start, end])

    @contextmanager
    def span(self) -> Iterator[None]:
        """Record the time spent in the `with` block as one busy interval."""
        start = self.clock()
        try:
            yield
        finally:
            self.add(start, self.clock())

    def to_dict(self) -> dict[str, Any]:
        return {
            "role": self.role,
            "rank": self.rank,
            "busy_s": self.busy_s,
            "num_spans": self.num_spans,
            "intervals": self.intervals,
        }

    def write(self, run_dir: Path) -> Path:
        """Write `run_dir/timeline/rank-<r>.json` atomically; returns its path."""
        from rollart_hpc.contracts.atomic import atomic_write_bytes

        path = Path(run_dir) / TIMELINE_DIR / f"rank-{self.rank}.json"
        atomic_write_bytes(path, json.dumps(self.to_dict()).encode())
        return path


@dataclass(frozen=True)
class RankTimeline:
    """One rank's timeline as read back from its file."""

    role: str
    rank: int
    busy_s: float
    intervals: list[Interval]


def read_timelines(run_dir: Path) -> list[RankTimeline]:
    """Every `timeline/rank-*.json` of a run, ordered by rank; [] when none exists yet."""
    folder = Path(run_dir) / TIMELINE_DIR
    out = []
    for path in sorted(folder.glob("rank-*.json")) if folder.is_dir() else []:
        data = json.loads(path.read_text(encoding="utf-8"))
        intervals = [(float(s), float(e)) for s, e in data["intervals"]]
        out.append(RankTimeline(str(data["role"]), int(data["rank"]), float(data["busy_s"]), intervals))
    return sorted(out, key=lambda t: t.rank)


def merge_intervals(intervals: Iterable[Interval]) -> list[Interval]:
    """The union of intervals as sorted, disjoint intervals."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def covered_s(intervals: Iterable[Interval], t0: float, t1: float) -> float:
    """Length of the union of intervals inside the window [t0, t1]."""
    return sum(max(0.0, min(e, t1) - max(s, t0)) for s, e in merge_intervals(intervals))


def busy_fraction(intervals: Iterable[Interval], t0: float, t1: float) -> float:
    """Share of the window [t0, t1] covered by at least one interval (0 for an empty window)."""
    return covered_s(intervals, t0, t1) / (t1 - t0) if t1 > t0 else 0.0


def utilisation(intervals: Sequence[Interval], t0: float, t1: float, num_bins: int) -> list[float]:
    """Busy fraction of each of `num_bins` equal bins of [t0, t1]."""
    if num_bins < 1 or t1 <= t0:
        raise ValueError(f"utilisation needs num_bins >= 1 and t1 > t0, got {num_bins}, [{t0}, {t1}]")
    width = (t1 - t0) / num_bins
    merged = merge_intervals(intervals)
    return [busy_fraction(merged, t0 + i * width, t0 + (i + 1) * width) for i in range(num_bins)]


def window(timelines: Sequence[RankTimeline]) -> Interval | None:
    """[earliest start, latest end] over every rank's intervals; None when nothing was recorded."""
    recorded = [t.intervals for t in timelines if t.intervals]
    if not recorded:
        return None
    return min(s for iv in recorded for s, _ in iv), max(e for iv in recorded for _, e in iv)


def role_busy_fractions(timelines: Sequence[RankTimeline], t0: float, t1: float) -> dict[str, float]:
    """Per role, the mean over its ranks of each rank's busy fraction in [t0, t1]."""
    by_role: dict[str, list[float]] = defaultdict(list)
    for t in timelines:
        by_role[t.role].append(busy_fraction(t.intervals, t0, t1))
    return {role: sum(v) / len(v) for role, v in sorted(by_role.items())}
