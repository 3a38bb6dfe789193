"""A fake SLURM for tests of the adapter's callers: records every command and answers from a script."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Sequence

Answer = tuple[int, str, str]  # returncode, stdout, stderr


class FakeSlurm:
    """`answers` maps the start of a command line (its words joined by spaces, e.g. "sinfo", "squeue --steps")
    to (rc, stdout, stderr) or to a function of the whole argv; the longest matching key answers, and an
    unanswered command fails like a missing client."""

    def __init__(self, answers: dict[str, Answer | Callable[[Sequence[str]], Answer]]) -> None:
        self.answers = answers
        self.calls: list[list[str]] = []

    def __call__(self, argv: Sequence[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
        self.calls.append(list(argv))
        for key in sorted(self.answers, key=len, reverse=True):
            if " ".join(argv) == key or " ".join(argv).startswith(key + " "):
                answer = self.answers[key]
                rc, out, err = answer(argv) if callable(answer) else answer
                return subprocess.CompletedProcess(list(argv), rc, out, err)
        return subprocess.CompletedProcess(list(argv), 127, "", f"{argv[0]}: command not found")
