"""Question answering task sets read from a file ([[envs.datasets]]): one single-turn task per good row.

A row is a JSON object (one per line of a .jsonl file, or a row of a .parquet file read with pyarrow,
where a null reads as a missing field) with a non-empty text under `prompt_field` and a number or
non-empty text under `answer_field` (and, with `split_field`, 'train' or 'test' / 'heldout'). Any other
row is malformed: it is counted, named in `DatasetRows.malformed` (row number and reason) and logged once
per process, never trained on; a file without a single good row is an error. Row `i` (1-based line or
row number) is task `<name>/<i>`, so ids stay stable while the file does. Held-out rows: those whose split
says so, or, with `heldout_fraction`, those whose prompt hashes (sha256) below that fraction, so adding
rows never moves an old one between splits.

The episode: the prompt is the first observation; the agent replies `<answer>...</answer>` once, and the
answer is checked by calc_math's checker (`calc_math.answer_matches`: numbers within 1e-6, else texts up
to case and spaces); `info["won"]` reports it (the family's reward is the env's verdict).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollart_hpc.config.schema import DATASET_SYSTEM
from rollart_hpc.tasks.families.calc_math import answer_matches, parse_action
from rollart_hpc.tasks.types import Task

log = logging.getLogger(__name__)
STOP = ("</answer>",)
HELDOUT_SPLITS = ("test", "heldout")
MAX_REASONS = 5  # malformed rows named in a summary line (all are counted)


@dataclass(frozen=True)
class Row:
    number: int
    prompt: str
    answer: str
    heldout: bool


@dataclass(frozen=True)
class DatasetRows:
    """The good rows of a file and the malformed ones as (row number, reason)."""

    rows: tuple[Row, ...]
    malformed: tuple[tuple[int, str], ...]

    def summary(self, name: str) -> str:
        held = sum(r.heldout for r in self.rows)
        line = f"dataset {name}: {len(self.rows)} tasks ({len(self.rows) - held} train, {held} held-out)"
        if self.malformed:
            named = "; ".join(f"row {n}: {why}" for n, why in self.malformed[:MAX_REASONS])
            more = (
                f"; and {len(self.malformed) - MAX_REASONS} more" if len(self.malformed) > MAX_REASONS else ""
            )
            line += f", {len(self.malformed)} malformed rows skipped ({named}{more})"
        return line


class DatasetError(ValueError):
    """A dataset file that cannot be read or holds no good row (one line)."""


def _records(path: Path) -> list[Any]:
    """The file's rows in order: parsed JSON objects, or the text of a line that is not JSON."""
    if path.suffix == ".parquet":
        import pyarrow as pa  # the config checks that pyarrow is installed
        import pyarrow.parquet as pq

        try:
            return list(pq.read_table(path).to_pylist())
        except pa.ArrowException as exc:  # not a parquet file, or a broken one
            raise OSError(str(exc).splitlines()[0]) from None
    rows: list[Any] = []
    with path.open(encoding="utf-8") as fh:
        for line in fh:
            if not line.strip():
                rows.append(None)
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                rows.append(ValueError(f"not JSON ({exc.msg})"))
    return rows


def _hashed_heldout(prompt: str, fraction: float) -> bool:
    return int(hashlib.sha256(prompt.encode()).hexdigest()[:8], 16) / 2**32 < fraction


def _row(number: int, record: Any, fields: tuple[str, str, str], fraction: float) -> Row | str:
    """A good row, or the reason it is malformed."""
    prompt_field, answer_field, split_field = fields
    if isinstance(record, ValueError):
        return str(record)
    if not isinstance(record, dict):
        return "empty line" if record is None else f"not an object ({type(record).__name__})"
    prompt, answer = record.get(prompt_field), record.get(answer_field)
    if not isinstance(prompt, str) or not prompt.strip():
        return f"no text under {prompt_field!r}"
    if isinstance(answer, bool) or not isinstance(answer, int | float | str) or not str(answer).strip():
        return f"no number or text under {answer_field!r}"
    if split_field:
        split = record.get(split_field)
        if split != "train" and split not in HELDOUT_SPLITS:
            return f"{split_field!r} is {split!r}, not 'train', 'test' or 'heldout'"
        heldout = split in HELDOUT_SPLITS
    else:
        heldout = _hashed_heldout(prompt, fraction)
    return Row(number, prompt.strip(), str(answer).strip(), heldout)


@functools.cache
def read_rows(
    path: str, prompt_field: str, answer_field: str, split_field: str = "", heldout_fraction: float = 0.0
) -> DatasetRows:
    """The rows of the file at `path` (cached per process; see the module docstring)."""
    try:
        records = _records(Path(path))
    except (OSError, UnicodeDecodeError) as exc:
        raise DatasetError(f"cannot read {path}: {exc}") from None
    rows, malformed = [], []
    fields = (prompt_field, answer_field, split_field)
    for number, record in enumerate(records, start=1):
        got = _row(number, record, fields, heldout_fraction)
        if isinstance(got, Row):
            rows.append(got)
        elif record is not None:  # blank lines are layout, not rows
            malformed.append((number, got))
    if not rows:
        first = f"; row {malformed[0][0]}: {malformed[0][1]}" if malformed else ""
        raise DatasetError(f"{path} holds no good row ({len(malformed)} malformed{first})")
    return DatasetRows(tuple(rows), tuple(malformed))


class DatasetEnv:
    """One question at a time: the first reply ends the episode, won if its answer matches."""

    def __init__(self, answers: dict[str, str], prompts: dict[str, str]) -> None:
        self._answers, self._prompts = answers, prompts
        self._gold: str | None = None

    def reset(self, task_id: str) -> str:
        if task_id not in self._prompts:
            raise KeyError(f"unknown dataset task id {task_id!r}")
        self._gold = self._answers[task_id]
        return self._prompts[task_id]

    def step(self, action_text: str) -> tuple[str, float, bool, dict[str, Any]]:
        if self._gold is None:
            raise RuntimeError("step before reset")
        kind, body = parse_action(action_text)
        won = kind == "answer" and answer_matches(body, self._gold)
        self._gold = None
        return ("correct" if won else "wrong"), float(won), True, {"won": won}

    def close(self) -> None:
        self._gold = None


class DatasetFamily:
    """The tasks of one [[envs.datasets]] table (its fields are this constructor's arguments)."""

    def __init__(
        self,
        name: str,
        path: str,
        prompt_field: str = "prompt",
        answer_field: str = "answer",
        split_field: str = "",
        heldout_fraction: float = 0.0,
        system: str = DATASET_SYSTEM,
        max_turns: int = 1,
    ) -> None:
        self.name, self.system, self.max_turns = name, system, max_turns
        self.data = read_rows(path, prompt_field, answer_field, split_field, heldout_fraction)
        if self.data.malformed:
            _log_once(self.data.summary(name))
        self._rows = {f"{name}/{r.number}": r for r in self.data.rows}

    def tasks(self) -> list[Task]:
        return [self.task(tid) for tid, r in self._rows.items() if not r.heldout]

    def heldout_tasks(self, count: int) -> list[Task]:
        if count < 0:
            raise ValueError(f"{self.name}: {count} held-out tasks asked")
        return [self.task(tid) for tid, r in self._rows.items() if r.heldout][:count]

    def task(self, tid: str) -> Task:
        if tid not in self._rows:
            raise KeyError(f"unknown {self.name} task id {tid!r}")
        return Task(tid, self.name, (self.name,), self.max_turns, self.system, self._rows[tid].prompt, STOP)

    def make_env(self) -> DatasetEnv:
        prompts = {tid: r.prompt for tid, r in self._rows.items()}
        return DatasetEnv({tid: r.answer for tid, r in self._rows.items()}, prompts)

    def oracle(self, tid: str) -> list[str]:
        return [f"<answer>{self._rows[tid].answer}</answer>"]


@functools.cache
def _log_once(line: str) -> None:
    log.warning(line)
