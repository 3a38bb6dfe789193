"""calc_math: multi-step arithmetic word problems solved with a calculator tool, each with a gold answer.

Problem `i` of the canonical set is a pure function of `i` (seeded `random.Random(f"calc_math:{i}")`),
so task ids are stable across processes and `PYTHONHASHSEED`. Problem `i` has `1 + i % 3` operations
on small numbers (start 2..20, addends 1..20, factors and divisors 2..5, every intermediate a
non-negative integer <= 200). The difficulty knob `max_ops` keeps only problems with at most that many
operations; ids do not change. Problems `1500 ..` (made the same way) are the held-out split:
`heldout_tasks(n)` gives the first `n` of them of at most `max_ops` operations whose text differs from
every canonical problem's; `tasks()`, which the
warm start and the task sampler draw from, never holds them.

Tool syntax: the model writes `<calc>EXPR</calc>` and observes `= VALUE` (or `error: ...`), and ends
with `<answer>NUMBER</answer>`; the episode is done after the first answer, reward 1.0 if it equals the
gold answer. The calculator is `rollart_hpc.tasks.families.calculator.evaluate` (restricted, bounded, never
executes code).
"""

from __future__ import annotations

import functools
import random
from dataclasses import dataclass
from typing import Any

from rollart_hpc.config.choices import CALC_MAX_OPS
from rollart_hpc.config.schema import HELDOUT_MAX
from rollart_hpc.tasks.families.calculator import CalcError, evaluate, format_number
from rollart_hpc.tasks.rewards import RewardInput, RewardOutput
from rollart_hpc.tasks.types import Task

FAMILY = "calc_math"
NUM_PROBLEMS = 1500
NUM_HELDOUT = HELDOUT_MAX[FAMILY]  # held-out problems: ids NUM_PROBLEMS .. NUM_PROBLEMS + NUM_HELDOUT - 1
SYSTEM = "Solve it. Compute with <calc>expression</calc>. Reply <answer>number</answer> at the end."
STOP = ("</calc>", "</answer>")  # a turn ends with its tool call
FORMAT_HINT = "error: reply <calc>expression</calc> or <answer>number</answer>"
_NAMES = ("Ana", "Ben", "Cleo", "Dev", "Eva", "Finn", "Gus", "Hana", "Ivo", "Jade", "Kai", "Lena")
_ITEMS = ("apples", "coins", "books", "cards", "eggs", "pens", "shells", "stamps", "cups", "beads")


@dataclass(frozen=True)
class Problem:
    index: int
    text: str
    expression: str
    answer: int
    num_ops: int


def task_id(index: int) -> str:
    return f"{FAMILY}/{index:04d}"


def parse_task_id(tid: str) -> int:
    prefix, _, number = tid.partition("/")
    if prefix != FAMILY or not number.isdigit() or not 0 <= int(number) < NUM_PROBLEMS + NUM_HELDOUT:
        raise KeyError(f"unknown {FAMILY} task id {tid!r}")
    return int(number)


def num_ops(index: int) -> int:
    """How many operations problem `index` has (1..CALC_MAX_OPS, in turn)."""
    return 1 + index % CALC_MAX_OPS


def generate_problem(index: int) -> Problem:
    """The canonical problem `index` (deterministic)."""
    rng = random.Random(f"{FAMILY}:{index}")
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    value = rng.randint(2, 20)
    sentences = [f"{name} has {value} {item}."]
    expr, additive = str(value), False
    for _ in range(num_ops(index)):
        op, n = _pick_op(rng, value)
        if op in "*/" and additive:
            expr = f"({expr})"
        expr += f"{op}{n}"
        additive = additive or op in "+-"
        value = _apply(op, value, n)
        sentences.append(_sentence(op, n))
    sentences.append(f"How many {item} does {name} have now?")
    return Problem(index, " ".join(sentences), expr, value, num_ops(index))


@functools.cache
def heldout_ids() -> list[int]:
    """Held-out problem ids: those from NUM_PROBLEMS on whose text is no canonical problem's text."""
    seen = {generate_problem(i).text for i in range(NUM_PROBLEMS)}
    ids = range(NUM_PROBLEMS, NUM_PROBLEMS + NUM_HELDOUT)
    return [i for i in ids if generate_problem(i).text not in seen]


def _pick_op(rng: random.Random, value: int) -> tuple[str, int]:
    options: list[tuple[str, int]] = [("+", rng.randint(1, 20))]
    if value >= 2:
        options.append(("-", rng.randint(1, value - 1)))
    factor = rng.randint(2, 5)
    if value * factor <= 200:
        options.append(("*", factor))
    divisors = [d for d in range(2, 6) if value % d == 0]
    if divisors:
        options.append(("/", rng.choice(divisors)))
    return rng.choice(options)


def _apply(op: str, value: int, n: int) -> int:
    return {"+": value + n, "-": value - n, "*": value * n, "/": value // n}[op]


def _sentence(op: str, n: int) -> str:
    return {
        "+": f"Then they get {n} more.",
        "-": f"Then they give {n} away.",
        "*": f"Then they get {n} times as many.",
        "/": f"Then they split them into {n} equal groups and keep one group.",
    }[op]


def parse_action(text: str) -> tuple[str, str]:
    """Split a model reply into (kind, body): kind is "calc", "answer" or "" (no tool call found)."""
    found = [(text.find(f"<{k}>"), k) for k in ("calc", "answer")]
    found = [(pos, k) for pos, k in found if pos >= 0]
    if not found:
        return "", ""
    pos, kind = min(found)
    start = pos + len(kind) + 2
    end = text.find(f"</{kind}>", start)
    body = text[start:] if end < 0 else text[start:end]
    return kind, body.strip()


def answer_matches(body: str, gold: int | float | str) -> bool:
    """True if `body` equals `gold`: as numbers within 1e-6 when `gold` is one (thousands commas
    allowed), else as texts up to case and surrounding whitespace."""
    try:
        gold_number = float(str(gold).replace(",", ""))
    except ValueError:
        return " ".join(body.split()).casefold() == " ".join(str(gold).split()).casefold()
    try:
        return abs(float(body.replace(",", "")) - gold_number) < 1e-6
    except ValueError:
        return False


def score(inp: RewardInput) -> RewardOutput:
    """The calc_math reward: 1.0 if the final reply holds `<answer>` equal to the gold answer,
    recomputed from the task id."""
    if not inp.actions:
        return RewardOutput(0.0, False)
    kind, body = parse_action(inp.actions[-1])
    ok = kind == "answer" and answer_matches(body, generate_problem(parse_task_id(inp.task_id)).answer)
    return RewardOutput(1.0 if ok else 0.0, ok)


class CalcMathEnv:
    """One calc_math episode at a time (see the module docstring for the protocol)."""

    def __init__(self) -> None:
        self._problem: Problem | None = None

    def reset(self, task_id: str) -> str:
        self._problem = generate_problem(parse_task_id(task_id))
        return self._problem.text

    def step(self, action_text: str) -> tuple[str, float, bool, dict[str, Any]]:
        if self._problem is None:
            raise RuntimeError("step before reset")
        kind, body = parse_action(action_text)
        if kind == "answer":
            won = answer_matches(body, self._problem.answer)
            self._problem = None
            return ("correct" if won else "wrong"), float(won), True, {"won": won}
        if kind == "calc":
            return _calc_observation(body), 0.0, False, {"won": False}
        return FORMAT_HINT, 0.0, False, {"won": False}

    def close(self) -> None:
        self._problem = None


def _calc_observation(body: str) -> str:
    try:
        return "= " + format_number(evaluate(body))
    except CalcError as exc:
        return f"error: {exc}"


class CalcMathFamily:
    """The calc_math task set; `max_ops` (1..3) keeps the problems with at most that many operations."""

    name = FAMILY

    def __init__(self, max_ops: int = CALC_MAX_OPS, max_turns: int = 4) -> None:
        if not 1 <= max_ops <= CALC_MAX_OPS:
            raise ValueError(f"calc_math max_ops must be 1..{CALC_MAX_OPS}, got {max_ops}")
        self.max_ops = max_ops
        self.max_turns = max_turns

    def tasks(self) -> list[Task]:
        return [self.task(task_id(i)) for i in range(NUM_PROBLEMS) if num_ops(i) <= self.max_ops]

    def heldout_tasks(self, count: int) -> list[Task]:
        """The first `count` held-out problems of at most `max_ops` operations (fewer if fewer exist):
        never in `tasks()`."""
        if count < 0:
            raise ValueError(f"{FAMILY}: {count} held-out problems asked")
        ids = [i for i in heldout_ids() if num_ops(i) <= self.max_ops][:count]
        return [self.task(task_id(i)) for i in ids]

    def task(self, tid: str) -> Task:
        p = generate_problem(parse_task_id(tid))
        tags = (FAMILY, f"ops{p.num_ops}")
        return Task(tid, FAMILY, tags, self.max_turns, SYSTEM, p.text, STOP)

    def make_env(self) -> CalcMathEnv:
        return CalcMathEnv()

    def oracle(self, tid: str) -> list[str]:
        p = generate_problem(parse_task_id(tid))
        return [f"<calc>{p.expression}</calc>", f"<answer>{p.answer}</answer>"]

    def gold_answer(self, tid: str) -> int:
        return generate_problem(parse_task_id(tid)).answer
