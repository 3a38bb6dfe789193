"""The built-in continuous-batching engine (vLLM-shaped; satisfies `rollart_hpc.inference.api.Engine`):
add_request / abort / step / update_weights / close.

Dataflow. `add_request` queues a request; each `step()`:
1. swaps in staged weights, if any (the only place the active snapshot changes);
2. reports requests that failed validation or were aborted since the last step;
3. decodes one token for every running slot whose KV cache is up to date (one batched forward);
4. admits waiting requests into free slots (copying the longest cached prefix of the prompt from the
   prefix cache into the slot, when there is one) and (re-)prefills every slot whose cache is behind
   (a new prompt past its cached prefix, or all running slots after a swap when `recompute_on_swap`);
5. samples, applies stop conditions, frees finished slots (keeping their KV rows in the prefix cache),
   and returns finished (and streamed) outputs.

Invariants:
- Slots: a fixed number, KV cache preallocated. Running requests occupy rows 0..n-1; a freed row is
  refilled at once by moving the last row into it, so decode always reads contiguous rows.
- Prefix cache (`prefix_cache_slots` > 0): rows num_slots.. hold the KV of ended requests (every token
  that went through the model), indexed by token blocks (`rollart_hpc.inference.prefix_cache`), least
  recently used evicted first. A new request starts from the longest cached prefix of its prompt
  (never the whole prompt). With `recompute_on_swap` a weight swap empties the cache, so a reused
  prefix was computed by the weights that are active. Off with `batch_invariant` (a reused prefix would
  make a request's numbers depend on what ran before it).
- Versions: all forward passes of one step read the same `PackedWeights` snapshot; `update_weights`
  (thread-safe, callable from any thread while another thread steps) only stages a new snapshot.
  With `recompute_on_swap` (default) every running request's cache is rebuilt under the new weights
  before its next token, so every token after the swap comes from the new version alone.
- Every token carries the version of the snapshot that produced it, and its log-prob under the
  distribution it was sampled from.
- With `batch_invariant`, a request's forward passes and samples are computed alone (one forward per
  segment, prefill chunks of `max_num_batched_tokens` whatever else runs), so its tokens and log-probs
  are a function of its own tokens, the weights and its generator: not of the other requests or the
  timing (CPU matmuls round differently for different shapes).

Per-request errors (empty prompt, prompt of max_model_len tokens or more, token id outside the
vocabulary, stop strings without a tokenizer) do not raise: the next `step()` returns that request
with finish_reason "error" and a message, and the engine keeps serving the others. Programming
errors (a duplicate request id) raise ValueError.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rollart_hpc.contracts.generation import FinishReason, RequestOutput, SamplingParams
from rollart_hpc.inference.api import land_whole
from rollart_hpc.inference.decoder import Decoder, Segment, SlotKVCache
from rollart_hpc.inference.packed import (
    Linear,
    PackedWeights,
    pack_weights,
    relink_weights,
    resolve_backend,
    unpack_weights,
)
from rollart_hpc.inference.prefix_cache import PrefixIndex
from rollart_hpc.inference.sampling import sample
from rollart_hpc.models.checkpoint import check_weights, drop_tied_head, load_weights
from rollart_hpc.models.config import ModelConfig, load_config


@dataclass(eq=False)
class _Request:
    request_id: str
    prompt: list[int]
    sampling: SamplingParams
    stop_ids: frozenset[int]
    stream: bool
    generator: torch.Generator | None
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    cached: int = 0
    stop_text: str | None = None

    def tokens(self) -> list[int]:
        return self.prompt + self.output


class LLMEngine:
    """Continuous batching over `num_slots` slots of up to `max_model_len` tokens each (prompt + output)."""

    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        tokenizer: Any | None = None,
        num_slots: int = 16,
        max_model_len: int = 2048,
        dtype: torch.dtype = torch.float32,
        version: int = 0,
        seed: int = 0,
        eos_token_ids: Iterable[int] | None = None,
        recompute_on_swap: bool = True,
        max_num_batched_tokens: int = 2048,
        linear_backend: str = "auto",
        batch_invariant: bool = False,
        prefix_cache_slots: int = 0,
    ) -> None:
        if max_num_batched_tokens <= num_slots:
            raise ValueError(
                f"max_num_batched_tokens ({max_num_batched_tokens}) must exceed num_slots ({num_slots})"
            )
        if prefix_cache_slots and batch_invariant:
            raise ValueError("a prefix cache and batch_invariant exclude each other")
        self.max_num_batched_tokens = max_num_batched_tokens
        self.config = config
        self.tokenizer = tokenizer
        self.num_slots = num_slots
        self.max_model_len = max_model_len
        self.dtype = dtype
        self.recompute_on_swap = recompute_on_swap
        self.batch_invariant = batch_invariant
        self.eos_token_ids = frozenset(config.eos_token_ids if eos_token_ids is None else eos_token_ids)
        self._decoder = Decoder(config, max_model_len, dtype)
        self._cache = SlotKVCache(config, num_slots + prefix_cache_slots, max_model_len, dtype)
        self._prefix = PrefixIndex(prefix_cache_slots)
        self._prefix_rows = list(range(num_slots, num_slots + prefix_cache_slots))
        self.prefill_tokens = 0  # tokens computed in prefill segments, over the engine's lifetime
        self.decode_tokens = 0
        check_weights(config, drop_tied_head(config, dict(weights)), complete=True)
        self.linear_backend = resolve_backend(linear_backend, dtype)
        self._weights = pack_weights(config, weights, dtype, self.linear_backend)
        self._version = version
        self._default_generator = torch.Generator().manual_seed(seed)
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._pending: list[RequestOutput] = []
        self._known: set[str] = set()
        self._stage_lock = threading.Lock()
        self._update_lock = threading.Lock()
        self._staged: tuple[PackedWeights, int] | None = None
        self._spare: PackedWeights | None = None  # the staging half of the double buffer

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, **kwargs: Any) -> LLMEngine:
        """Load config, weights and (if present) tokenizer from an HF safetensors directory."""
        config = load_config(model_dir)
        tokenizer = kwargs.pop("tokenizer", None) or _load_tokenizer(Path(model_dir))
        return cls(config, load_weights(model_dir, config), tokenizer=tokenizer, **kwargs)

    # ----- public API -----
    @property
    def version(self) -> int:
        """The policy version of the active weights (staged weights become active at the next step)."""
        return self._version

    def has_unfinished(self) -> bool:
        """True while any request is waiting, running, or has an unreported result."""
        return bool(self._waiting or self._running or self._pending)

    def has_staged_weights(self) -> bool:
        with self._stage_lock:
            return self._staged is not None

    def num_running(self) -> int:
        return len(self._running)

    def prefix_stats(self) -> dict[str, int | float]:
        """Prefix-cache lookups, hits, prompt tokens reused, evictions, and the tokens computed."""
        return {
            **self._prefix.stats.to_dict(),
            "prefill_tokens": self.prefill_tokens,
            "decode_tokens": self.decode_tokens,
        }

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams, stream: bool = False
    ) -> None:
        """Queue a request; with `stream`, `step()` also returns a partial output after each new token."""
        if request_id in self._known:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        error = self._validate(prompt_token_ids, sampling)
        if error is not None:
            out = RequestOutput(
                request_id, list(prompt_token_ids), finished=True, finish_reason="error", error=error
            )
            self._pending.append(out)
            return
        gen = None if sampling.seed is None else torch.Generator().manual_seed(sampling.seed)
        stop_ids = self.eos_token_ids | frozenset(sampling.stop_token_ids)
        self._waiting.append(_Request(request_id, list(prompt_token_ids), sampling, stop_ids, stream, gen))
        self._known.add(request_id)

    def abort(self, request_id: str) -> bool:
        """Stop a request; the next `step()` returns it (tokens so far) with finish_reason "abort"."""
        for req in self._waiting:
            if req.request_id == request_id:
                self._waiting.remove(req)
                self._pending.append(self._finish(req, "abort"))
                return True
        for row, req in enumerate(self._running):
            if req.request_id == request_id:
                self._pending.append(self._finish(req, "abort"))
                self._release([row])
                return True
        return False

    def begin_weights(self, version: int) -> _Landing:
        """Open the landing of `version` into the staging snapshot (see `_Landing`); a second landing
        waits until this one is committed or aborted. Thread-safe; generation continues meanwhile."""
        self._update_lock.acquire()
        try:
            with self._stage_lock:
                staged, self._staged = self._staged, None
            if staged is not None:  # not yet swapped in: land over it (it already holds the newest)
                return _Landing(self, staged[0], version, base=None)
            if self._spare is None:
                self._spare = _empty_like(self._weights)
            return _Landing(self, self._spare, version, base=self._weights)
        except BaseException:
            self._update_lock.release()
            raise

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Stage new weights (HF names; a subset updates only those) to be swapped in before the next step.

        Thread-safe; generation continues meanwhile. A later call before the swap lands over the staged
        snapshot (merging over it). For a tied head, `lm_head.weight` is dropped (it is the embedding).
        """
        land_whole(self.begin_weights(version), named_tensors)

    def close(self) -> None:
        """Nothing to release (no threads, processes or shared buffers); part of the `Engine` contract."""

    def weights(self) -> dict[str, torch.Tensor]:
        """HF-named views of the active weights (read-only use)."""
        return unpack_weights(self.config, self._weights)

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Run one engine iteration; return finished outputs (and partial ones of streaming requests)."""
        self._swap_staged()
        outputs, self._pending = self._pending, []
        self._admit()
        stepped = self._forward_step()
        return outputs + self._collect(stepped)

    # ----- internals -----
    def _validate(self, prompt: list[int], sampling: SamplingParams) -> str | None:
        if not prompt:
            return "empty prompt"
        if len(prompt) >= self.max_model_len:
            return f"prompt has {len(prompt)} tokens; the context limit is {self.max_model_len} (prompt + output)"
        if min(prompt) < 0 or max(prompt) >= self.config.vocab_size:
            return f"prompt token id outside the vocabulary [0, {self.config.vocab_size})"
        if sampling.stop and self.tokenizer is None:
            return "stop strings need a tokenizer; the engine has none"
        return None

    def _swap_staged(self) -> None:
        with self._stage_lock:
            staged, self._staged = self._staged, None
        if staged is None:
            return
        self._spare = self._weights  # no forward reads it any more: the next version lands in it
        self._weights, self._version = staged
        if self.recompute_on_swap:
            self._prefix.clear()
            for req in self._running:
                req.cached = 0

    def _admit(self) -> None:
        while self._waiting and len(self._running) < self.num_slots:
            req = self._waiting.popleft()
            hit = self._prefix.lookup(req.prompt) if self._prefix_rows else None
            if hit is not None:
                row, matched = hit
                self._cache.move(row, len(self._running), matched)
                req.cached = matched
            self._running.append(req)

    def _plan(self) -> tuple[list[Segment], list[int], list[int]]:
        """This step's segments (decodes first), their token ids, and which segments end in a sample."""
        segments: list[Segment] = []
        token_ids: list[int] = []
        sampled: list[int] = []
        for row, req in enumerate(self._running):
            if req.cached == len(req.prompt) + len(req.output) - 1:
                sampled.append(len(segments))
                segments.append(Segment(row, req.cached, 1))
                token_ids.append(req.tokens()[-1])
        budget = self.max_num_batched_tokens - len(segments)
        for row, req in enumerate(self._running):
            tokens = req.tokens()
            todo = len(tokens) - req.cached
            if self.batch_invariant:  # the chunk must not depend on the other requests
                budget = self.max_num_batched_tokens
            if todo <= 1 or budget <= 0:
                continue
            n = min(todo, budget)
            if n == todo:
                sampled.append(len(segments))
            segments.append(Segment(row, req.cached, n))
            token_ids.extend(tokens[req.cached : req.cached + n])
            budget -= n
        return segments, token_ids, sampled

    def _forward_step(self) -> list[_Request]:
        """One forward pass over all planned segments; returns the requests that got a new token."""
        segments, token_ids, sampled = self._plan()
        if not segments:
            return []
        if self.batch_invariant:
            logits, offset = [], 0
            for seg in segments:
                ids = torch.tensor(token_ids[offset : offset + seg.length])
                logits.append(self._decoder.forward(self._weights, self._cache, ids, [seg]))
                offset += seg.length
            rows = torch.cat(logits)
        else:
            rows = self._decoder.forward(self._weights, self._cache, torch.tensor(token_ids), segments)
        for seg in segments:
            self._running[seg.slot].cached = seg.start + seg.length
        decodes = sum(1 for seg in segments if seg.length == 1)
        self.decode_tokens += decodes
        self.prefill_tokens += len(token_ids) - decodes
        reqs = [self._running[segments[i].slot] for i in sampled]
        if self.batch_invariant:
            for i, req in zip(sampled, reqs, strict=True):
                self._append_samples([req], rows[i : i + 1])
        else:
            self._append_samples(reqs, rows[sampled])
        return reqs

    def _append_samples(self, reqs: list[_Request], logits: torch.Tensor) -> None:
        params = [req.sampling for req in reqs]
        gens = [req.generator for req in reqs]
        tokens, logprobs = sample(logits, params, gens, self._default_generator)
        for req, tok, lp in zip(reqs, tokens, logprobs, strict=True):
            req.output.append(tok)
            req.logprobs.append(lp)
            req.versions.append(self._version)

    def _finish_reason(self, req: _Request) -> FinishReason | None:
        if req.output[-1] in req.stop_ids:
            return "stop"
        if req.sampling.stop and self._match_stop_string(req):
            return "stop"
        if (
            len(req.output) >= req.sampling.max_tokens
            or len(req.prompt) + len(req.output) >= self.max_model_len
        ):
            return "length"
        return None

    def _match_stop_string(self, req: _Request) -> bool:
        text = self._decode_text(req.output)
        hits = [i for i in (text.find(s) for s in req.sampling.stop) if i >= 0]
        if hits:
            req.stop_text = text[: min(hits)]
        return bool(hits)

    def _decode_text(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=True))

    def _collect(self, stepped: list[_Request]) -> list[RequestOutput]:
        outputs, done = [], []
        rows = {id(req): row for row, req in enumerate(self._running)}
        for req in stepped:
            row = rows[id(req)]
            reason = self._finish_reason(req)
            if reason is not None:
                outputs.append(self._finish(req, reason))
                done.append(row)
            elif req.stream:
                outputs.append(self._snapshot(req, finished=False, reason=None))
        self._release(done)
        return outputs

    def _snapshot(self, req: _Request, finished: bool, reason: FinishReason | None) -> RequestOutput:
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=list(req.prompt),
            token_ids=list(req.output),
            logprobs=list(req.logprobs),
            versions=list(req.versions),
            text=self._decode_text(req.output) if req.stop_text is None else req.stop_text,
            finished=finished,
            finish_reason=reason,
        )

    def _finish(self, req: _Request, reason: FinishReason) -> RequestOutput:
        self._known.discard(req.request_id)
        return self._snapshot(req, finished=True, reason=reason)

    def _release(self, rows: list[int]) -> None:
        """Free `rows`, keeping running requests in rows 0..n-1 by moving tail rows into the holes."""
        if not rows:
            return
        for row in rows:
            self._retain(row)
        freed = set(rows)
        keep = len(self._running) - len(freed)
        holes = [r for r in sorted(freed) if r < keep]
        movers = [r for r in range(keep, len(self._running)) if r not in freed]
        for hole, src in zip(holes, movers, strict=True):
            self._cache.move(src, hole, self._running[src].cached)
            self._running[hole] = self._running[src]
        del self._running[keep:]

    def _retain(self, row: int) -> None:
        """Keep an ending request's KV row in the prefix cache (when it has one and a block to keep)."""
        req = self._running[row]
        if not self._prefix_rows or req.cached < self._prefix.block:
            return
        dst = self._prefix.victim(self._prefix_rows)
        self._cache.move(row, dst, req.cached)
        self._prefix.store(dst, req.tokens()[: req.cached])


class _Landing:
    """One version landing in the engine's staging snapshot, the half of the double buffer that no
    forward reads: `targets` are its HF-named dense views (contiguous), `land` copies tensors into them,
    `commit` fills what did not land from the active snapshot (a partial update), re-derives the linear
    backend's private layouts and stages it; `abort` leaves it unstaged. Holds the engine's update lock
    from `begin_weights` until `commit` or `abort`."""

    def __init__(self, engine: LLMEngine, staging: PackedWeights, version: int, base: PackedWeights | None):
        self.engine, self.staging, self.version, self.base = engine, staging, version, base
        self.targets: dict[str, torch.Tensor] = unpack_weights(engine.config, staging)
        self.landed: set[str] = set()
        self._open = True

    def land(self, named: list[tuple[str, torch.Tensor]]) -> None:
        tensors = drop_tied_head(self.engine.config, dict(named))
        check_weights(self.engine.config, tensors, complete=False)
        with torch.no_grad():
            for name, tensor in tensors.items():
                self.targets[name].copy_(tensor)
        self.landed.update(tensors)

    def commit(self, direct: Iterable[str] = ()) -> None:
        """Stage the version; `direct`: the names the caller wrote straight into `targets`."""
        engine = self.engine
        self._check_open()
        try:
            done = self.landed | set(direct)
            if self.base is not None and len(done) < len(self.targets):
                with torch.no_grad():
                    for name, tensor in unpack_weights(engine.config, self.base).items():
                        if name not in done:
                            self.targets[name].copy_(tensor)
            staged = relink_weights(self.staging, engine.linear_backend)
            with engine._stage_lock:
                engine._staged = (staged, self.version)
        finally:
            self._close()

    def abort(self) -> None:
        """Leave the staging unstaged (a version staged before this landing, landed over, is dropped)."""
        self._check_open()
        self._close()

    def _check_open(self) -> None:
        if not self._open:
            raise RuntimeError(f"the landing of weights v{self.version} is already closed")

    def _close(self) -> None:
        self._open = False
        self.engine._update_lock.release()


def _empty_like(weights: PackedWeights) -> PackedWeights:
    """A snapshot of the same structure with fresh (uninitialised) tensors: the staging half."""

    def fresh(linear: Linear) -> Linear:
        bias = None if linear.bias is None else torch.empty_like(linear.bias)
        return Linear(torch.empty_like(linear.weight), bias)

    layers = tuple(
        dataclasses.replace(
            layer,
            input_norm=torch.empty_like(layer.input_norm),
            post_norm=torch.empty_like(layer.post_norm),
            qkv=fresh(layer.qkv),
            o_proj=fresh(layer.o_proj),
            gate_up=fresh(layer.gate_up),
            down=fresh(layer.down),
            q_norm=None if layer.q_norm is None else torch.empty_like(layer.q_norm),
            k_norm=None if layer.k_norm is None else torch.empty_like(layer.k_norm),
        )
        for layer in weights.layers
    )
    embed = torch.empty_like(weights.embed)
    tied = weights.lm_head.weight is weights.embed
    head = Linear(embed) if tied else fresh(weights.lm_head)
    return PackedWeights(embed, layers, torch.empty_like(weights.norm), head)


def _load_tokenizer(model_dir: Path) -> Any | None:
    if not (model_dir / "tokenizer.json").is_file() and not (model_dir / "tokenizer_config.json").is_file():
        return None
    from rollart_hpc.models.tokenizer import load_tokenizer

    return load_tokenizer(model_dir)
