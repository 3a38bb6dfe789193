"""The weight-transport contract (`rollart_hpc.weights.transport`), one function per side.

Used by tests/mpi_scripts/weights_check.py (the group transport, one side per MPI rank). The sender publishes
`VERSIONS` in order and scribbles over its tensors right after each publish (the snapshot rule); each
receiver must get every version once, in order, bit-identical to what was published.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable

import torch

from rollart_hpc.weights.publisher import WeightPublisher, WeightReceiver

VERSIONS = (1, 2, 3)
Digest = dict[str, str]


def model(version: int) -> dict[str, torch.Tensor]:
    """Mixed dtypes and shapes, a scalar, an empty tensor and one tensor larger than the small buckets."""
    g = torch.Generator().manual_seed(1000 + version)
    return {
        "model.embed_tokens.weight": torch.randn(300, 64, generator=g),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(64, 64, generator=g).to(torch.bfloat16),
        "model.layers.0.input_layernorm.weight": torch.randn(64, generator=g).to(torch.float16),
        "model.layers.0.mlp.counter": torch.randint(0, 1 << 40, (7,), generator=g),
        "model.layers.0.mask": torch.rand(13, generator=g) > 0.5,
        "model.scale": torch.randn((), generator=g),
        "model.empty": torch.empty(0, 5),
        "lm_head.weight": torch.randn(3, 1, 11, generator=g, dtype=torch.float64),
    }


def digest(named: Iterable[tuple[str, torch.Tensor]]) -> Digest:
    return {
        n: hashlib.sha256(
            t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        ).hexdigest()
        + f"|{tuple(t.shape)}|{t.dtype}"
        for n, t in named
    }


def send_versions(sender: WeightPublisher, snapshot: bool = True, stream: bool = False) -> dict[int, Digest]:
    """Publish every version; returns the digest of what each publish was given. With `snapshot` the
    sender scribbles over its tensors right after each publish; without, it hands over fresh tensors
    that it never touches again (the hand-over rule of `publish(snapshot=False)`). With `stream` it
    publishes one chunk per tensor, in reverse order (`publish_stream`, a snapshot too)."""
    sent = {}
    handed_over = []
    for version in VERSIONS:
        named = model(version)
        if stream:
            sender.publish_stream(version, ({name: named[name]} for name in reversed(named)))
        else:
            sender.publish(version, named, snapshot=snapshot)
        sent[version] = digest(model(version).items())
        if snapshot:
            for t in named.values():  # the caller may step on at once: the snapshot is already taken
                t.zero_() if t.dtype != torch.bool else t.logical_not_()
        else:
            handed_over.append(named)
    sender.wait()
    return sent


Receive = Callable[[], tuple[int, list[tuple[str, torch.Tensor]]]]


def collect(receiver: WeightReceiver) -> tuple[int, list[tuple[str, torch.Tensor]]]:
    """One version from a `WeightReceiver`: a copy of each tensor as its bucket lands (layout order)."""
    got: dict[str, torch.Tensor] = {}
    version = receiver.receive(lambda views: got.update((n, v.clone()) for n, v in views))
    return version, [(slot.name, got[slot.name]) for slot in receiver.layout.slots]


def receive_versions(receive: Receive, announced: Callable[[], int] | None = None) -> dict[int, Digest]:
    """Receive every version (after its announcement, when `announced` reads it); digests by version."""
    got = {}
    for expected in VERSIONS:
        if announced is not None:
            assert announced() == expected
        version, named = receive()
        assert version == expected, f"received v{version}, expected v{expected}"
        got[version] = digest(named)
    return got
