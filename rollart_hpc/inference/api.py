"""The engine contract the rollout rank loop (`rollart_hpc.rollout.main.serve`) drives.

Every engine behind `rollout.engine` (the built-in `LLMEngine`, the vLLM adapter `VLLMEngine`) satisfies
`Engine` structurally; `rollart_hpc.inference.engines.build_engine` constructs one from the config.

Contract (checked for both engines by tests/engine_contract.py):
- every added request yields exactly one finished output through `step()` (finish_reason stop, length,
  abort or error); `has_unfinished()` stays true until that output was returned;
- each output token carries its log-prob under the distribution it was sampled from (finite, <= 0) and
  the policy version of the weights that produced it;
- `begin_weights(version)` opens a `WeightLanding`: the receiver lands a version in it bucket by bucket
  (`land`, and straight into `targets` where the engine offers its own staging tensors), then
  `commit()` stages it (or `abort()` drops it); `update_weights(named, version)` is the same for tensors
  already at hand. Neither copies the whole model anywhere but into the engine's own staging;
- `update_weights` (and a landing) may be called from another thread while the caller steps; the new weights take
  effect between two steps (no forward mixes versions), `version` changes when they do, and every token
  sampled after that carries the new version; `has_staged_weights()` is true while a version is staged
  or loading and not yet active;
- `abort` makes a later `step()` return the request (tokens so far) with finish_reason "abort"; it
  returns False for an unknown or already finished request;
- `close()` releases the engine's threads and processes; calling it again does nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Protocol

from rollart_hpc.contracts.generation import RequestOutput, SamplingParams

if TYPE_CHECKING:
    import torch


class WeightLanding(Protocol):
    """One version landing in an engine (see the module docstring); used from one thread."""

    @property
    def targets(self) -> Mapping[str, torch.Tensor]:
        """HF-named tensors of the engine's staging that whole tensors may land in directly (may be
        empty); the caller writes each at most once and reads none."""
        ...

    def land(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Copy these tensors (HF names; valid only during the call) into the staging."""
        ...

    def commit(self, direct: Iterable[str] = ()) -> None:
        """Everything landed (`direct`: the names the caller wrote straight into `targets`): the version
        takes effect between two steps."""
        ...

    def abort(self) -> None:
        """Drop what landed; the engine keeps its weights."""
        ...


class Engine(Protocol):
    """A synchronous, continuously batching inference engine (see the module docstring)."""

    @property
    def version(self) -> int:
        """The policy version of the weights the engine samples from now."""
        ...

    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams) -> None:
        """Queue a request; its finished output comes out of a later `step()`."""
        ...

    def abort(self, request_id: str) -> bool:
        """Stop a request; True if it was in the engine."""
        ...

    def step(self) -> list[RequestOutput]:
        """Advance the engine; return the outputs finished since the last call."""
        ...

    def has_unfinished(self) -> bool:
        """True while any request is in the engine or has an output not yet returned by `step()`."""
        ...

    def has_staged_weights(self) -> bool:
        """True while new weights are staged or loading and not yet active."""
        ...

    def begin_weights(self, version: int) -> WeightLanding:
        """Open the landing of `version` (a later landing waits until this one is committed or aborted)."""
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Install new weights (HF names) as `version`; they take effect between two steps."""
        ...

    def close(self) -> None:
        """Release threads, processes and buffers; idempotent."""
        ...


def land_whole(landing: WeightLanding, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Land tensors already at hand in one piece and commit them; abort the landing if that fails."""
    try:
        landing.land(list(named_tensors))
    except BaseException:
        landing.abort()
        raise
    landing.commit()
