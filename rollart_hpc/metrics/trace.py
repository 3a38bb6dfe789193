"""The controller's event trace of a run, `timeline/controller.jsonl`: what the scale simulator calibrates on.

One JSON object per line, each with `e` (the event) and `t` (Unix time, the controller's clock, the same one
that stamps a ticket's dispatch time):
- `start`: the RL phase begins (`num_steps`, `batch_size`).
- `result`: a training episode reached the controller: `id` (its requests' rollout rank follows from it,
  `rollart_hpc.routing.router`), `status`, `dispatch_t`, `reset_s`, and per turn `prompt` (new prompt tokens: the observation and
  template the turn appended), `gen` (tokens generated), `llm_s` (time from request to answer, queueing
  in the engine included) and `env_s` (the env step); `tokens`, the trajectory's length.
- `batch`: the controller handed step `step` to the trainers (`tokens` in the batch).
- `trained`: step `step` came back trained and published.
- `loaded`: rollout rank `rank` loaded version `version`.
- `checkpoint`: a checkpoint at version `version` took `s` seconds (the controller is blocked meanwhile).
- `checkpoint_complete`: that checkpoint got its marker `s` seconds after it began (later than its
  `checkpoint` row when the trainers write in the background), with its trainer bytes per rank.

Writes are line-buffered appends: a crash loses at most the line being written, and a resumed run appends
to the same file (each attempt starts with its own `start`). Standard library only.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from rollart_hpc.contracts.records import Trajectory

TRACE_FILE = "timeline/controller.jsonl"


def turn_segments(action_mask: Sequence[int]) -> list[tuple[int, int]]:
    """(new prompt tokens, generated tokens) of each turn: a run of 0s in the action mask followed by its
    run of 1s. A trailing run of 0s (the last observation, never answered) is not a turn."""
    turns: list[tuple[int, int]] = []
    prompt = gen = 0
    for bit in action_mask:
        if bit:
            gen += 1
        elif gen:
            turns.append((prompt, gen))
            prompt, gen = 1, 0
        else:
            prompt += 1
    if gen:
        turns.append((prompt, gen))
    return turns


class TraceWriter:
    """Appends events to RUN_DIR/timeline/controller.jsonl (see the module docstring)."""

    def __init__(self, run_dir: Path, clock: Any = time.time) -> None:
        path = run_dir / TRACE_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        self.clock = clock
        self.file: IO[str] = path.open("a", buffering=1)

    def write(self, event: str, **fields: Any) -> None:
        self.file.write(json.dumps({"e": event, "t": self.clock(), **fields}, separators=(",", ":")) + "\n")

    def result(self, traj: Trajectory, dispatch_time: float) -> None:
        turns = turn_segments(traj.action_mask)
        n = min(len(turns), len(traj.llm_s), len(traj.env_s))
        self.write(
            "result",
            id=traj.episode_id,
            status=traj.status,
            dispatch_t=dispatch_time,
            reset_s=round(traj.reset_s, 6),
            prompt=[p for p, _ in turns[:n]],
            gen=[g for _, g in turns[:n]],
            llm_s=[round(s, 6) for s in traj.llm_s[:n]],
            env_s=[round(s, 6) for s in traj.env_s[:n]],
            tokens=len(traj.token_ids),
        )

    def close(self) -> None:
        self.file.close()
