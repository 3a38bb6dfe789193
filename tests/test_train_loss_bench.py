"""`bench kernel --trainer-loss`: the trainer's loss entry point, fused against eager, on CPU."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def test_trainer_loss_bench_measures_both_paths_and_their_agreement(tmp_path: Path) -> None:
    from rollart_hpc.bench import kernel

    parser = argparse.ArgumentParser()
    kernel.add_arguments(parser)
    out = tmp_path / "k.json"
    argv = ["--trainer-loss", "--json", str(out), "--tokens", "96", "--hidden", "32", "--vocab", "1000"]
    assert kernel.main(parser.parse_args([*argv, "--repeats", "2", "--warmup", "1"])) == 0
    result = json.loads(out.read_text())
    assert (result["mode"], result["T"], result["V"]) == ("trainer_loss", 96, 1000)
    for impl in ("fused", "eager"):
        assert result[impl]["time_ms"] > 0 and result[impl]["peak_rss_mib_above_start"] >= 0
    assert result["max_rel_err_fwd"] <= 1e-5 and result["max_rel_err_grad"] <= 1e-5
