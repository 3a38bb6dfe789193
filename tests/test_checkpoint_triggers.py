"""Checkpoints by time (`controller.checkpoint_every_s`) and on SIGTERM within `cluster.sigterm_grace_s`:
when a checkpoint is due, the SIGTERM stop request and its deadline, the config checks."""

import os
import signal
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from rollart_hpc.cluster import signals
from rollart_hpc.config import load_config
from rollart_hpc.contracts.errors import UsageError
from rollart_hpc.controller import recovery

TINY = Path(__file__).resolve().parent.parent / "configs" / "tiny.toml"


@pytest.fixture
def sigterm_restored():
    previous = signal.getsignal(signal.SIGTERM)
    yield
    signals.STOP_REQUESTED.clear()
    signals.install_sigterm(0.0)
    signal.signal(signal.SIGTERM, previous)


def fake_controller(version, last_checkpoint, last_at, *overrides):
    config = load_config(TINY, ["controller.checkpoint_every_steps=0", *overrides])
    return SimpleNamespace(
        config=config,
        core=SimpleNamespace(version=version),
        last_checkpoint=last_checkpoint,
        last_checkpoint_at=last_at,
        stop_requested=threading.Event(),
    )


def test_checkpoint_every_s_is_due_after_the_interval_at_a_new_version():
    c = fake_controller(3, 2, 100.0, "controller.checkpoint_every_s=10")
    assert not recovery.checkpoint_due(c, now=109.0)
    assert recovery.checkpoint_due(c, now=110.0)
    c.last_checkpoint = 3  # nothing trained since the last checkpoint: not due however long ago
    assert not recovery.checkpoint_due(c, now=500.0)


def test_time_trigger_off_by_default_and_steps_trigger_unchanged():
    c = fake_controller(4, 2, 0.0, "controller.checkpoint_every_steps=2")
    assert recovery.checkpoint_due(c, now=1.0)
    c = fake_controller(3, 2, 0.0)
    assert not recovery.checkpoint_due(c, now=1e9)
    c.stop_requested.set()
    assert recovery.checkpoint_due(c, now=0.0)


def test_sigterm_requests_a_stop_with_a_deadline(sigterm_restored):
    signals.install_sigterm(5.0)
    os.kill(os.getpid(), signal.SIGTERM)  # handled: the test process lives on
    assert signals.STOP_REQUESTED.is_set()
    at = signals._sigterm["at"]
    assert not signals.past_grace(now=at + 4.9)
    assert signals.past_grace(now=at + 5.1)


def test_past_grace_fails_the_controller_without_a_checkpoint(sigterm_restored, monkeypatch):
    signals.install_sigterm(0.01)
    os.kill(os.getpid(), signal.SIGTERM)
    monkeypatch.setitem(signals._sigterm, "at", signals._sigterm["at"] - 1.0)
    with pytest.raises(RuntimeError, match="no checkpoint within cluster.sigterm_grace_s"):
        recovery.check_stop_grace()


def test_without_grace_sigterm_keeps_its_handler(sigterm_restored):
    before = signal.getsignal(signal.SIGTERM)
    signals.install_sigterm(0.0)
    assert signal.getsignal(signal.SIGTERM) is before and not signals.past_grace()


@pytest.mark.parametrize(
    "override",
    ["controller.checkpoint_every_s=-1", "cluster.sigterm_grace_s=-0.5", "cluster.max_restarts=-1"],
)
def test_negative_values_are_refused(override):
    with pytest.raises(UsageError):
        load_config(TINY, [override])
