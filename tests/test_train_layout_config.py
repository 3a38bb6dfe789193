"""The trainer's parallel layout in the config: validation, the trainer settings, resume overrides."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollart_hpc.contracts.errors import UsageError

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny.toml"


def test_layout_fields_reach_the_trainer_settings() -> None:
    from rollart_hpc.config.resolve import load_config
    from rollart_hpc.train.config import TrainerConfig

    config = load_config(
        TINY, ["roles.trainer.num_ranks=8", "trainer.tensor_parallel=2", "trainer.pipeline_parallel=2"]
    )
    assert config.trainer.loss_impl == "fused"
    cfg = TrainerConfig.from_config(config.trainer, lr=1e-3, seed=0, timeout_s=60)
    assert (cfg.tensor_parallel, cfg.pipeline_parallel, cfg.loss_impl) == (2, 2, "fused")
    assert cfg.distributed_optimizer and cfg.overlap_grad_reduce


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["roles.trainer.num_ranks=3", "trainer.tensor_parallel=2"],
            "trainer.tensor_parallel x trainer.pipeline",
        ),
        (["trainer.pipeline_parallel=0"], "trainer.pipeline_parallel: must be >= 1"),
        (["trainer.loss_impl=chunked"], "loss_impl"),
        (["trainer.sequence_parallel=true"], "trainer.sequence_parallel: needs trainer.tensor_parallel > 1"),
    ],
)
def test_bad_layouts_are_one_line_errors_naming_the_field(overrides: list[str], message: str) -> None:
    from rollart_hpc.config.resolve import load_config

    with pytest.raises(UsageError, match=message) as info:
        load_config(TINY, overrides)
    assert "\n" not in str(info.value)


def test_resume_overrides_may_change_only_the_trainer_layout(tmp_path: Path) -> None:
    from rollart_hpc.config.resolve import load_config, read_resolved, write_resolved
    from rollart_hpc.entry.resume import _relayout

    write_resolved(load_config(TINY, ["roles.trainer.num_ranks=4", "trainer.tensor_parallel=2"]), tmp_path)
    with pytest.raises(UsageError, match="only the trainer layout may change"):
        _relayout(tmp_path, ["trainer.lr=0.1"])
    _relayout(
        tmp_path, ["roles.trainer.num_ranks=2", "trainer.tensor_parallel=1", "trainer.pipeline_parallel=2"]
    )
    config = read_resolved(tmp_path)
    assert (
        config.roles.trainer.num_ranks,
        config.trainer.tensor_parallel,
        config.trainer.pipeline_parallel,
    ) == (2, 1, 2)
    assert "num_ranks = 2" in (tmp_path / "role-trainer.toml").read_text()
