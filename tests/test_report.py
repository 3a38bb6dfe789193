"""Per-rank timelines and the run report on synthetic run directories (no MPI, no model)."""

import json

import pytest

from rollart_hpc.contracts.errors import UsageError
from rollart_hpc.entry.cli import main as cli_main
from rollart_hpc.metrics.report import load_run, step_throughput, write_report
from rollart_hpc.metrics.run_metrics import read_rows
from rollart_hpc.metrics.timeline import (
    Timeline,
    busy_fraction,
    covered_s,
    merge_intervals,
    read_timelines,
    role_busy_fractions,
    utilisation,
    window,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class FakeClock:
    def __init__(self, t=100.0):
        self.t = t

    def __call__(self):
        return self.t


def test_timeline_merges_close_intervals_and_keeps_exact_busy_time():
    tl = Timeline("rollout", 1, merge_gap_s=0.01)
    tl.add(0.0, 1.0)
    tl.add(1.005, 2.0)  # within the gap: merged
    tl.add(3.0, 4.0)
    tl.add(2.5, 5.0)  # starts before the last interval: kept apart, the union merges it on read
    assert tl.intervals == [[0.0, 2.0], [3.0, 4.0], [2.5, 5.0]]
    assert tl.busy_s == pytest.approx(1.0 + 0.995 + 1.0 + 2.5)
    assert tl.num_spans == 4
    assert merge_intervals([tuple(i) for i in tl.intervals]) == [(0.0, 2.0), (2.5, 5.0)]
    with pytest.raises(ValueError, match="ends before"):
        tl.add(2.0, 1.0)


def test_timeline_span_uses_its_clock_even_when_the_block_raises():
    clock = FakeClock()
    tl = Timeline("env", 2, clock=clock)
    with tl.span():
        clock.t = 102.5
    with pytest.raises(RuntimeError), tl.span():
        clock.t = 104.0
        raise RuntimeError("episode bug")
    assert tl.intervals == [[100.0, 104.0]]  # second span starts where the first ended: merged
    assert tl.busy_s == pytest.approx(4.0)


def test_timeline_write_read_round_trip(tmp_path):
    a = Timeline("trainer", 4)
    a.add(10.0, 12.0)
    b = Timeline("env", 2)
    b.add(9.0, 11.0)
    b.add(9.5, 13.0)
    path = a.write(tmp_path)
    b.write(tmp_path)
    assert path == tmp_path / "timeline" / "rank-4.json"
    assert not list((tmp_path / "timeline").glob("*.tmp"))
    read = read_timelines(tmp_path)
    assert [(t.role, t.rank) for t in read] == [("env", 2), ("trainer", 4)]
    assert read[0].busy_s == pytest.approx(5.5) and read[1].intervals == [(10.0, 12.0)]
    assert window(read) == (9.0, 13.0)
    assert read_timelines(tmp_path / "missing") == [] and window([]) is None


def test_busy_fraction_and_utilisation_clip_to_the_window():
    intervals = [(0.0, 1.0), (0.5, 2.0), (3.0, 4.0)]
    assert covered_s(intervals, 0.0, 4.0) == pytest.approx(3.0)
    assert covered_s(intervals, 1.5, 3.5) == pytest.approx(1.0)
    assert busy_fraction(intervals, 0.0, 4.0) == pytest.approx(0.75)
    assert busy_fraction(intervals, 1.0, 1.0) == 0.0
    assert utilisation(intervals, 0.0, 4.0, 4) == pytest.approx([1.0, 1.0, 0.0, 1.0])
    with pytest.raises(ValueError):
        utilisation(intervals, 0.0, 4.0, 0)


def test_role_busy_fractions_average_over_ranks(tmp_path):
    for rank, (s, e) in enumerate([(0.0, 10.0), (0.0, 5.0)], start=1):
        tl = Timeline("rollout", rank)
        tl.add(s, e)
        tl.write(tmp_path)
    tl = Timeline("trainer", 3)
    tl.add(8.0, 10.0)
    tl.write(tmp_path)
    fractions = role_busy_fractions(read_timelines(tmp_path), 0.0, 10.0)
    assert fractions == pytest.approx({"rollout": 0.75, "trainer": 0.2})


# ---- the report -----------------------------------------------------------------------------------
CONFIG = """
[run]
name = "synthetic"
[controller]
mode = "async"
max_staleness = -1
batch_size = 4
num_steps = 4
"""


def metric_row(step, wall, success, math, house):
    return {
        "step": step,
        "version": step + 1,
        "wall_s": wall,
        "trained_trajectories": 4,
        "tokens": 400,
        "train_success": success,
        "train_success/calc_math": math,
        "train_success/household": house,
        "mean_staleness": 0.5,
        "loss": 0.0,
    }


def synthetic_run(tmp_path, finished=True):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.resolved.toml").write_text(CONFIG)
    rows = [
        metric_row(0, 2.0, 0.25, 0.5, 0.0),
        metric_row(1, 4.0, 0.5, 0.5, 0.5),
        metric_row(2, 8.0, 0.75, 1.0, 0.5),
    ]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if finished:
        rows.append(metric_row(3, 10.0, 1.0, 1.0, 1.0))
        text += json.dumps(rows[-1]) + "\n"
        summary = {
            "staleness": {"0": 6, "1": 10},
            "trajectories": {"dispatched": 16, "trained": 16},
            "balanced": True,
        }
        (run / "summary.json").write_text(json.dumps(summary))
        for role, rank, (s, e) in [("rollout", 1, (1000.0, 1010.0)), ("trainer", 2, (1005.0, 1007.5))]:
            tl = Timeline(role, rank)
            tl.add(s, e)
            tl.write(run)
    else:
        text += '{"step": 3, "wall'  # the controller is writing this line
    (run / "metrics.jsonl").write_text(text)
    return run


def test_step_throughput_uses_time_since_the_previous_step():
    rows = [metric_row(0, 2.0, 0, 0, 0), metric_row(1, 6.0, 0, 0, 0)]
    per_step = step_throughput(rows)
    assert [p["step_s"] for p in per_step] == [2.0, 4.0]
    assert [p["trajectories_per_s"] for p in per_step] == [2.0, 1.0]
    assert [p["tokens_per_s"] for p in per_step] == [200.0, 100.0]


def test_report_of_a_finished_run(tmp_path):
    run = synthetic_run(tmp_path)
    md_path = write_report(run)
    assert md_path == run / "report" / "report.md"
    for name in ("success", "throughput", "staleness", "timeline"):
        assert (run / "report" / f"{name}.png").read_bytes()[:8] == PNG_MAGIC
    md = md_path.read_text()
    assert "state: finished; steps 4 / 4" in md
    assert "max_staleness 1" in md  # the mode's own bound, not the -1 placeholder
    assert "| household | 0.000 | 1.000 |" in md and "| calc_math | 0.500 | 1.000 |" in md
    assert "| rollout rank 1 | 100.0% |" in md and "| trainer rank 2 | 25.0% |" in md
    assert "1.600 trajectories/s, 160.0 tokens/s" in md  # 16 trajectories, 1600 tokens in 10 s
    assert "| trained with staleness 1 | 10 |" in md and "not drawn" not in md


def test_report_of_a_running_run_skips_the_line_being_written(tmp_path):
    run = synthetic_run(tmp_path, finished=False)
    assert len(read_rows(run / "metrics.jsonl")) == 3
    md = write_report(run, tmp_path / "out").read_text()
    assert "state: running" in md and "steps 3 / 4" in md
    assert "not drawn: timeline" in md
    assert (tmp_path / "out" / "staleness.png").exists() and not (tmp_path / "out" / "timeline.png").exists()
    assert load_run(run).summary is None


def test_report_rejects_a_corrupt_line_before_the_last(tmp_path):
    run = synthetic_run(tmp_path)
    (run / "metrics.jsonl").write_text("not json\n" + json.dumps(metric_row(0, 1.0, 0, 0, 0)) + "\n")
    with pytest.raises(UsageError, match="line 1 is not JSON"):
        load_run(run)


def test_report_cli_names_a_directory_that_is_not_a_run(tmp_path, capsys):
    assert cli_main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: {tmp_path} is not a run directory (no config.resolved.toml)"
    run = synthetic_run(tmp_path)
    assert cli_main(["report", str(run)]) == 0
    assert (run / "report" / "report.md").exists()


def test_metrics_rows_are_tensorboard_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from rollart_hpc.metrics.run_metrics import MetricsWriter

    writer = MetricsWriter(tmp_path)
    writer.log({"step": 0, "loss": 0.5, "trained_trajectories": 4, "balanced": True, "arm": "spo"})
    writer.log({"step": 1, "loss": 0.25, "trained_trajectories": 8})
    writer.close()
    assert [row["step"] for row in read_rows(tmp_path / "metrics.jsonl")] == [0, 1]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["loss", "trained_trajectories"]  # numbers only, not the step
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(0, 0.5), (1, 0.25)]
    assert [(e.step, e.value) for e in events.Scalars("trained_trajectories")] == [(0, 4.0), (1, 8.0)]
