"""An agent of our own, written against the OpenAI chat-completions API: it answers the arithmetic
questions of tasks.jsonl with a calculator tool, and returns its reward (1.0 for the right number).

The run names it as `envs.agent = "calc_agent:run"`; it would run unmodified against any
OpenAI-compatible server.
"""

from __future__ import annotations

import ast
import json
import operator
import re
from pathlib import Path
from typing import Any

import openai

from rollart_hpc.api import Outcome, Task, answer_matches

TASKS = Path(__file__).resolve().parent.parent / "tasks.jsonl"
GOLD = {row["question"]: row["answer"] for row in map(json.loads, TASKS.read_text().splitlines())}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression of numbers, + - * / and parentheses.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]
OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _eval(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        return float(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in OPS:
        return float(OPS[type(node.op)](_eval(node.left), _eval(node.right)))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_eval(node.operand)
    raise ValueError("only numbers, + - * / and parentheses")


def calculator(expression: str) -> str:
    """The tool: the value of `expression`, or an error the model can read."""
    try:
        value = _eval(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError) as exc:
        return f"error: {exc}"
    return str(int(value)) if value.is_integer() else str(value)


def call_tool(name: str, arguments: str) -> str:
    try:
        args = json.loads(arguments)
    except ValueError:
        return "error: arguments are not JSON"
    if name != "calculator" or not isinstance(args, dict):
        return f"error: no tool {name!r}"
    return calculator(str(args.get("expression", "")))


async def run(client: openai.AsyncOpenAI, task: Task) -> Outcome:
    """Ask, run the calculator for every tool call, and score the last reply's last number."""
    messages: list[Any] = [
        {"role": "system", "content": "Answer with a number. Use the calculator tool for arithmetic."},
        {"role": "user", "content": task.prompt},
    ]
    content = ""
    for _ in range(task.max_turns):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        content = message.content or ""
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            result = call_tool(call.function.name, call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    numbers = NUMBER.findall(content)
    won = bool(numbers) and answer_matches(numbers[-1], GOLD[task.prompt])
    return Outcome(1.0 if won else 0.0, success=won)
