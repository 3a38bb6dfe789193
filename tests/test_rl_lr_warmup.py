"""`trainer.rl_lr_warmup_steps`: the RL learning rate rises linearly to `trainer.lr`, then stays."""

from pathlib import Path

import pytest

from rollart_hpc.config import load_config
from rollart_hpc.contracts.errors import UsageError
from rollart_hpc.train.main import rl_lr

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.toml"


def test_no_warmup_is_the_configured_lr_from_the_first_step():
    config = load_config(TINY, ["trainer.lr=2e-4"])
    assert [rl_lr(config, k) for k in (0, 1, 50)] == [2e-4, 2e-4, 2e-4]


def test_warmup_rises_linearly_then_holds():
    config = load_config(TINY, ["trainer.lr=4e-4", "trainer.rl_lr_warmup_steps=4"])
    got = [rl_lr(config, k) for k in range(7)]
    assert got == pytest.approx([1e-4, 2e-4, 3e-4, 4e-4, 4e-4, 4e-4, 4e-4])


def test_negative_warmup_is_a_one_line_error():
    with pytest.raises(UsageError, match=r"trainer\.rl_lr_warmup_steps: must be >= 0, got -1"):
        load_config(TINY, ["trainer.rl_lr_warmup_steps=-1"])
