"""Peak GPU memory and step time of the trainer's GPTModel, forward+backward, per core attention x recompute.

    python scripts/gpu_train_memory.py --out OUT.json [--precision fp32|bf16] [--layers N] [--repeats R]

A random-init GPTModel of a Qwen2.5-1.5B-like shape by default (hidden 1536, 28 layers, 12 heads, 2 KV
heads, FFN 8960, vocabulary 151936, qkv bias, tied embeddings), built through the trainer's own path
(`train.model.build_gpt`) on one rank, for attention {sdpa, unfused} x recompute {none, selective, full}
on micro-batches of 1 x 4096 and 4 x 4096 tokens: `torch.cuda.max_memory_allocated` of the timed steps
(peak statistics reset after the warm-up) and the median step time (CUDA events), each step the forward,
the trainer's fused LM-head log-probs and the backward. A cell that runs out of memory is recorded as OOM.
`--precision bf16` builds bf16 parameters with Megatron's bf16 config, as the trainer does (there is no
optimizer here, so no fp32 main parameters or gradients). Writes the JSON to --out and prints a table last. `--device cpu` with a toy shape runs
the same code on CPU (each cell in a fresh process, peak RSS). What is measured:
`rollart_hpc/bench/activations.py`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

QWEN25_15B = {
    "hidden": 1536,
    "layers": 28,
    "heads": 12,
    "kv_heads": 2,
    "ffn": 8960,
    "vocab": 151936,
    "micro_batches": "1x4096,4x4096",
    "repeats": 3,
}


def main(argv: list[str] | None = None) -> int:
    from rollart_hpc.bench import activations

    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    activations.add_arguments(parser, QWEN25_15B, json_flag="--out")
    return activations.main(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
