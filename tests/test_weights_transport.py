"""The weight-transport contract (tests/mpi_scripts/weights_contract.py) for the in-process transport.

The group transport passes the same contract under mpiexec (tests/test_weights_mpi.py, "roundtrip").
"""

from __future__ import annotations

import importlib.util
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from rollart_hpc.contracts.errors import PeerTimeoutError
from rollart_hpc.weights.transport import InProcessWeightTransport, announce_to


def _load_contract() -> ModuleType:
    path = Path(__file__).resolve().parent / "mpi_scripts" / "weights_contract.py"
    spec = importlib.util.spec_from_file_location("weights_contract", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


contract = _load_contract()


class _RecordingMessenger:
    """A mailbox stand-in: records (event, version, rank) in the shared event log."""

    def __init__(self, events: list[tuple[str, int, int]]) -> None:
        self.events = events
        self.announced: dict[int, list[int]] = {}
        self.cond = threading.Condition()

    def send(self, payload: Any, dest: int, tag: Any) -> None:
        assert tag == "WEIGHTS" and payload["kind"] == "announcement"
        with self.cond:
            self.events.append(("announce", payload["version"], dest))
            self.announced.setdefault(dest, []).append(payload["version"])
            self.cond.notify_all()

    def next_for(self, rank: int) -> int:
        with self.cond:
            assert self.cond.wait_for(lambda: self.announced.get(rank), timeout=10)
            return self.announced[rank].pop(0)


@pytest.mark.parametrize("stream", [False, True], ids=["publish", "publish_stream"])
def test_in_process_transport_passes_the_contract_with_two_receivers(stream: bool) -> None:
    events: list[tuple[str, int, int]] = []
    messenger = _RecordingMessenger(events)
    transport = InProcessWeightTransport(num_receivers=2, timeout_s=10)
    message = lambda version: {"kind": "announcement", "version": version}  # noqa: E731
    sender = transport.sender(announce_to(messenger, [1, 2], "WEIGHTS", message))
    got: dict[int, dict[int, Any]] = {}

    def receive(rank: int) -> None:
        source = transport.receiver(rank - 1)
        got[rank] = contract.receive_versions(source, lambda: messenger.next_for(rank))
        events.extend(("received", v, rank) for v in got[rank])

    threads = [threading.Thread(target=receive, args=(rank,)) for rank in (1, 2)]
    for t in threads:
        t.start()
    sent = contract.send_versions(sender, stream=stream)
    for t in threads:
        t.join(10)
    assert got == {1: sent, 2: sent}
    assert sent[1] != sent[2]
    for rank in (1, 2):
        for version in contract.VERSIONS:
            assert events.index(("announce", version, rank)) < events.index(("received", version, rank))


def test_publish_returns_before_delivery_and_keeps_one_version_in_flight() -> None:
    transport = InProcessWeightTransport(num_receivers=1, timeout_s=10)
    sender, source = transport.sender(), transport.receiver()
    start = time.monotonic()
    sender.publish(7, {"w": torch.ones(4)})
    assert sender.in_flight and time.monotonic() - start < 1.0
    received: list[tuple[int, float]] = []

    def late_receiver() -> None:
        time.sleep(0.5)
        for _ in range(2):
            version, named = source.receive()
            received.append((version, float(dict(named)["w"].sum())))

    thread = threading.Thread(target=late_receiver)
    thread.start()
    sender.publish(8, [("w", torch.full((4,), 2.0))])  # waits until v7 was delivered
    assert time.monotonic() - start >= 0.45
    sender.wait()
    thread.join(10)
    assert received == [(7, 4.0), (8, 8.0)] and not sender.in_flight


def test_silent_receiver_makes_wait_raise_and_receive_times_out() -> None:
    transport = InProcessWeightTransport(num_receivers=2, timeout_s=0.3)
    sender = transport.sender()
    sender.publish(1, {"w": torch.ones(2)})
    assert transport.receiver(0).receive()[0] == 1
    with pytest.raises(PeerTimeoutError, match=r"weights v1 not received within 0.3s by receivers \[1\]"):
        sender.wait()
    with pytest.raises(PeerTimeoutError, match="receiver 0: no weights delivered"):
        transport.receiver(0).receive()
