"""The calculator evaluates arithmetic only, within bounds, and rejects everything else quickly."""

from __future__ import annotations

import time

import pytest

from rollart_hpc.tasks.families.calc_math import CalcMathEnv, task_id
from rollart_hpc.tasks.families.calculator import CalcError, CalcLimits, evaluate, format_number

HOSTILE = [
    "__import__('os').system('touch /tmp/rollart_pwned')",
    "import os",
    "exec('print(1)')",
    "eval('1+1')",
    "open('/etc/passwd').read()",
    "().__class__.__bases__[0].__subclasses__()",
    "(1).__class__",
    "x",
    "__builtins__",
    "globals()",
    "lambda: 1",
    "[x for x in range(10**9)]",
    "{x: 1 for x in range(10)}",
    "(x for x in iter(int, 1))",
    "[1, 2, 3][0]",
    "'a' * 10**9",
    "b'abc'",
    "9**9**9**9",
    "10**10**10",
    "2**1000",
    "(2**64)**64",
    "99999999999**99",
    "1" + "*99" * 40,
    "2*3*4*5*6*7*8*9*10*11*12*13*14*15*16*17*18*19*20*21*22*23",
    "(" * 500 + "1" + ")" * 500,
    "-" * 150 + "1",
    "1+" * 5000 + "1",
    "1e400",
    "1e308*10",
    "1e-300**-2",
    "1e-5**-64",
    "(1/3)**-64",
    "1e15/1e-300",
    "1e15//1e-300",
    "-(1e-300**-2)",
    "1/0",
    "5 % 0",
    "0**-1",
    "(-8)**0.5",
    "True + True",
    "1 if 1 else 0",
    "1 < 2",
    "1 << 10000",
    "~1",
    "1 & 3",
    "a := 5",
    "while True: pass",
    "for i in iter(int, 1): pass",
    "[]",
    "None",
    "...",
    "1j",
    "f'{1}'",
    "",
    "   ",
]


def test_at_least_thirty_hostile_inputs() -> None:
    assert len(set(HOSTILE)) >= 30


@pytest.mark.parametrize("text", HOSTILE)
def test_hostile_input_is_rejected_fast(text: str) -> None:
    started = time.monotonic()
    with pytest.raises(CalcError):
        evaluate(text)
    assert time.monotonic() - started < 0.5


@pytest.mark.parametrize("text", HOSTILE)
def test_hostile_input_gives_error_observation(text: str) -> None:
    env = CalcMathEnv()
    env.reset(task_id(0))
    obs, reward, done, info = env.step(f"<calc>{text}</calc>")
    assert obs.startswith("error:") and reward == 0.0 and not done and not info["won"]


def test_nothing_executes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    marker = tmp_path / "pwned"
    for text in (f"__import__('pathlib').Path('{marker}').touch()", f"open('{marker}', 'w')"):
        with pytest.raises(CalcError):
            evaluate(text)
    assert not marker.exists()


@pytest.mark.parametrize(
    "text,value",
    [
        ("1+2*3", 7),
        ("(12+5)*3", 51),
        ("7/2", 3.5),
        ("7//2", 3),
        ("-3+10", 7),
        ("2**10", 1024),
        ("10%4", 2),
        ("1.5*4", 6.0),
        (" ( 1 + 1 ) ", 2),
    ],
)
def test_arithmetic(text: str, value: float) -> None:
    assert evaluate(text) == value


def test_format_number() -> None:
    assert format_number(4.0) == "4"
    assert format_number(1 / 3) == "0.333333"
    assert format_number(-12) == "-12"


def test_limits_are_configurable() -> None:
    with pytest.raises(CalcError, match="longer than"):
        evaluate("1+1+1", CalcLimits(max_chars=3))
    with pytest.raises(CalcError, match="too large"):
        evaluate("1000*1000", CalcLimits(max_abs=1e5))
    assert evaluate("1000*1000") == 1_000_000


def test_the_parsers_syntax_warnings_stay_off_the_console() -> None:
    """`1and 2` makes Python's parser warn ("invalid decimal literal"); the calculator refuses it quietly."""
    import subprocess
    import sys

    code = (
        "from rollart_hpc.tasks.families.calculator import CalcError, evaluate\n"
        "try:\n    evaluate('1and 2')\nexcept CalcError as exc:\n    print('refused:', exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-W", "default", "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "refused: not allowed: BoolOp" and "SyntaxWarning" not in out.stderr, out
