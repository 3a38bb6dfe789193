"""The rollout contract shared by every engine (built-in torch engine, vLLM) and every caller.

Shaped like vLLM's: a request is a prompt of token ids plus sampling parameters; its output carries
the sampled token ids, the log-prob of each sampled token under the distribution actually sampled
from, the policy version that produced each token, and why it finished. Pure data: no torch import.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

FinishReason = Literal["stop", "length", "abort", "error"]


@dataclass(frozen=True)
class Sampling:
    """The distribution each token is drawn from. temperature 0 means greedy; top_k <= 0 and top_p >= 1
    disable them."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0


@dataclass(frozen=True)
class SamplingParams(Sampling):
    """How to sample one request: its distribution (`Sampling`), length, stop conditions and seed."""

    max_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {self.max_tokens}")


@dataclass
class RequestOutput:
    """The result (or a streamed partial result) of one request."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    text: str = ""
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None


class LLMClient(Protocol):
    """What an agent loop needs from a rollout engine: one awaitable generation per call."""

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams
    ) -> RequestOutput: ...

    async def abort(self, request_id: str) -> None: ...
