"""`bench controller` at a small size: real ControllerCore, tracker and sampler, synthetic trajectories."""

import argparse
import json
import random

from rollart_hpc.bench import controller as bench
from rollart_hpc.entry.cli import main as cli_main


def small_args(tmp_path, **over):
    values = dict(
        json=str(tmp_path / "ctl.json"),
        tasks="20,60",
        batch=8,
        steps=5,
        budget_s=30.0,
        in_flight=400,
        in_flight_tasks=20,
        cycles=2,
        seed=0,
        no_profile=False,
    )
    values.update(over)
    return argparse.Namespace(**values)


def test_controller_bench_small(tmp_path):
    result = bench.run_bench(small_args(tmp_path))
    assert [t["num_tasks"] for t in result["throughput"]] == [20, 60]
    for t in result["throughput"]:
        assert t["steps_done"] == 5 and t["trained"] == 40 and t["balanced"]
        assert set(t["per_op_us"]) == {"dispatch", "receive_admit", "batch", "publish"}
        assert t["calls"]["receive_admit"] >= 40 and t["trajectories_per_s"] > 0
    # neither goal task count (10,000, 100,000) was measured: no headline, goal not met
    assert result["trajectories_per_s"] is None and result["meets_goal"] is False
    by_tasks = result["trajectories_per_s_by_num_tasks"]
    assert by_tasks == {str(t["num_tasks"]): t["trajectories_per_s"] for t in result["throughput"]}
    f = result["in_flight"]
    assert f["in_flight"] == 400 and len(f["dispatch_us_by_in_flight"]) == bench.NUM_BINS
    assert len(f["receive_admit_us_by_in_flight"]) == bench.NUM_BINS
    mem = f["memory"]
    assert 0 < mem["bytes_per_ticket_in_flight"] < 10_000
    assert mem["tracemalloc_peak_bytes"] > 0 and len(mem["rss_bytes_after_cycle"]) == 2
    assert any("sampler.py" in h["function"] for h in result["hot_spots"])


def test_headline_and_goal_are_judged_at_the_goal_task_counts():
    def rows(**per_s):
        return [{"num_tasks": int(n[1:]), "trajectories_per_s": v} for n, v in per_s.items()]

    fast_small = bench.headline(rows(n100=90_000.0, n10000=25_000.0, n100000=19_000.0))
    assert fast_small["trajectories_per_s"] == 25_000.0 and fast_small["meets_goal"] is False
    assert fast_small["trajectories_per_s_by_num_tasks"] == {
        "100": 90_000.0,
        "10000": 25_000.0,
        "100000": 19_000.0,
    }
    assert bench.headline(rows(n10000=21_000.0, n100000=20_000.0))["meets_goal"] is True
    missing = bench.headline(rows(n10000=50_000.0))
    assert missing["trajectories_per_s"] == 50_000.0 and missing["meets_goal"] is False
    assert "100,000 tasks not measured" in bench.goal_line(missing)


def test_due_in_flight_index_agrees_with_waiting_for():
    core = bench.make_core(num_tasks=10, cap=3, batch=6, steps=50, seed=1)
    results, rng = bench.Results(1), random.Random(1)
    for _ in range(400):
        op = rng.random()
        if op < 0.5:
            core.dispatch()
        elif op < 0.9 and core.in_flight:
            ticket = rng.choice(list(core.in_flight.values()))
            core.on_result(results.make(ticket))
        elif (batch := core.next_batch()) is not None:
            core.on_published(batch.step + 1)
            core.on_rollout_version(batch.step + 1)
        assert core._due_in_flight() == bool(core.waiting_for())
    state = core.state_dict()
    restored = bench.make_core(num_tasks=10, cap=3, batch=6, steps=50, seed=1)
    restored.load_state_dict(state)
    assert restored._in_flight_by_version == core._in_flight_by_version


def test_controller_bench_cli(tmp_path, capsys):
    out = tmp_path / "ctl.json"
    argv = ["bench", "controller", "--json", str(out), "--tasks", "10", "--steps", "2", "--batch", "4"]
    argv += ["--in-flight", "100", "--in-flight-tasks", "10", "--no-profile"]
    assert cli_main(argv) == 0
    data = json.loads(out.read_text())
    assert data["throughput"][0]["trained"] == 8 and "hot_spots" not in data
    assert cli_main(["bench", "controller", "--json", str(out), "--tasks", "ten"]) == 2
    assert "--tasks: expected comma-separated integers" in capsys.readouterr().err
