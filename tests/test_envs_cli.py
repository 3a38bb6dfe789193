"""`launch.py envs check|play|prepare` through the CLI module."""

from __future__ import annotations

import argparse
import io

import pytest

from rollart_hpc.contracts.errors import UsageError
from rollart_hpc.envs import cli


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(argv)


def test_check_prints_solved(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(_parse(["check", "calc_math"])) == 0
    assert f"solved {cli.SAMPLE_SIZE}/{cli.SAMPLE_SIZE}" in capsys.readouterr().out
    assert cli.main(_parse(["check", "frozenlake", "--all"])) == 0
    assert "solved 18/18" in capsys.readouterr().out


def test_unknown_family_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="unknown env family"):
        cli.main(_parse(["check", "chess"]))
    with pytest.raises(UsageError, match="unknown frozenlake task id"):
        cli.main(_parse(["play", "frozenlake", "frozenlake/99x99"]))


def test_play_reads_stdin(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("right\nright\ndown\ndown\ndown\nright\n"))
    assert cli.main(_parse(["play", "frozenlake", "frozenlake/4x4"])) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("won") and "P___" in out


def test_play_stops_at_end_of_input(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO("<calc>2*3</calc>\n"))
    assert cli.main(_parse(["play", "calc_math", "calc_math/0000"])) == 0
    out = capsys.readouterr().out
    assert "= 6" in out and "(end of input)" in out


def test_sample_is_fixed_and_spread() -> None:
    ids = [str(i) for i in range(100)]
    assert cli.sample(ids, 5) == ["0", "25", "50", "74", "99"] and cli.sample(ids[:3], 5) == ids[:3]
