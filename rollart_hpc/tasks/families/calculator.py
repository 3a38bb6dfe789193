"""A restricted arithmetic evaluator for model-written calculator calls; it never executes code.

The input is parsed with `ast.parse(mode="eval")` and walked by an interpreter that knows only number
literals (int/float, not bool or complex), unary +/- and the binary operators + - * / // % **. Names,
attributes, calls, subscripts, comprehensions, lambdas, strings and everything else are rejected before
any evaluation. Bounds are checked before each operation, so no single operation can be expensive:
expression length, parenthesis nesting, AST node count, magnitude of every intermediate value, size of
exponents, and a wall-clock deadline checked at every node. Every rejection is a `CalcError` whose text
is safe to show to the model as an observation.
"""

from __future__ import annotations

import ast
import math
import operator
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass

Number = int | float


class CalcError(ValueError):
    """The expression was rejected or could not be evaluated; the message is shown to the model."""


@dataclass(frozen=True)
class CalcLimits:
    """Bounds on what the calculator accepts."""

    max_chars: int = 200
    max_depth: int = 12
    max_nodes: int = 64
    max_abs: float = 1e15
    max_exponent: int = 64
    timeout_s: float = 0.05


# The model's text is parsed under this file name, so that the SyntaxWarnings the parser raises on it
# ("invalid decimal literal" for `1and 2`, ...) stay out of the console: the text is refused or
# evaluated all the same, and the model sees the outcome.
_SOURCE = "<calc>"
warnings.filterwarnings("ignore", category=SyntaxWarning, module=_SOURCE)

_BINOPS = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.FloorDiv, ast.Mod, ast.Pow)
_UNARY = (ast.UAdd, ast.USub)


def evaluate(text: str, limits: CalcLimits | None = None) -> Number:
    """Evaluate an arithmetic expression under `limits`; raise CalcError on anything else."""
    lim = limits or CalcLimits()
    if not isinstance(text, str):
        raise CalcError("expression must be text")
    expr = text.strip()
    _check_text(expr, lim)
    try:
        tree = ast.parse(expr, filename=_SOURCE, mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError) as exc:
        raise CalcError(f"syntax error ({type(exc).__name__})") from None
    _check_tree(tree, lim)
    return _Interpreter(lim).run(tree.body)


def format_number(value: Number) -> str:
    """Canonical text of a result: integers without a decimal point, floats rounded to 6 places."""
    if isinstance(value, int):
        return str(value)
    if value.is_integer():
        return str(int(value))
    return f"{value:.6f}".rstrip("0").rstrip(".")


def _check_text(expr: str, lim: CalcLimits) -> None:
    if not expr:
        raise CalcError("empty expression")
    if len(expr) > lim.max_chars:
        raise CalcError(f"expression longer than {lim.max_chars} characters")
    depth = 0
    for ch in expr:
        depth += (ch == "(") - (ch == ")")
        if depth > lim.max_depth:
            raise CalcError(f"parentheses nested deeper than {lim.max_depth}")


def _check_tree(tree: ast.Expression, lim: CalcLimits) -> None:
    nodes = 0
    for node in ast.walk(tree.body):
        nodes += 1
        if nodes > lim.max_nodes:
            raise CalcError(f"expression has more than {lim.max_nodes} parts")
        if isinstance(node, ast.BinOp | ast.UnaryOp) or isinstance(node, _BINOPS + _UNARY):
            continue
        if isinstance(node, ast.Constant) and _is_number(node.value):
            continue
        raise CalcError(f"not allowed: {type(node).__name__}")


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


_ARITHMETIC: dict[type[ast.operator], Callable[[Number, Number], Number]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}


def _guarded(compute: Callable[[], Number | complex]) -> Number | complex:
    """Run one bounded operation; an arithmetic exception of the float library becomes a CalcError."""
    try:
        return compute()
    except OverflowError:
        raise CalcError("number too large") from None
    except (ZeroDivisionError, ValueError) as exc:
        raise CalcError(f"cannot compute ({exc})") from None


class _Interpreter:
    """Walks a checked tree; bounds every intermediate value before and after each operation."""

    def __init__(self, lim: CalcLimits) -> None:
        self.lim = lim
        self.deadline = time.monotonic() + lim.timeout_s

    def run(self, node: ast.expr) -> Number:
        if time.monotonic() > self.deadline:
            raise CalcError("time limit exceeded")
        if isinstance(node, ast.Constant) and _is_number(node.value):
            return self._bounded(node.value)  # type: ignore[arg-type]
        if isinstance(node, ast.UnaryOp):
            value = self.run(node.operand)
            return -value if isinstance(node.op, ast.USub) else value
        if isinstance(node, ast.BinOp):
            return self._binop(node.op, self.run(node.left), self.run(node.right))
        raise CalcError(f"not allowed: {type(node).__name__}")

    def _bounded(self, value: Number) -> Number:
        if isinstance(value, float) and not math.isfinite(value):
            raise CalcError("result is not a finite number")
        if abs(value) > self.lim.max_abs:
            raise CalcError("number too large")
        return value

    def _binop(self, op: ast.operator, a: Number, b: Number) -> Number:
        if isinstance(op, ast.Pow):
            return self._power(a, b)
        if isinstance(op, ast.Div | ast.FloorDiv | ast.Mod) and b == 0:
            raise CalcError("division by zero")
        result = _guarded(lambda: _ARITHMETIC[type(op)](a, b))
        assert not isinstance(result, complex)  # + - * / // % of real numbers are real
        return self._bounded(result)

    def _power(self, base: Number, exp: Number) -> Number:
        if abs(exp) > self.lim.max_exponent:
            raise CalcError(f"exponent larger than {self.lim.max_exponent}")
        if base == 0 and exp < 0:
            raise CalcError("division by zero")
        if base < 0 and not float(exp).is_integer():
            raise CalcError("fractional power of a negative number")
        if base != 0 and exp * math.log10(abs(base)) > math.log10(self.lim.max_abs):
            raise CalcError("number too large")  # also a tiny base to a negative power (1e-300**-2)
        result = _guarded(lambda: base**exp)
        if isinstance(result, complex):
            raise CalcError("result is not a real number")
        return self._bounded(result)
