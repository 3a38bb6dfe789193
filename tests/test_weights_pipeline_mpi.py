"""Pipelined receive under mpiexec (1 publisher + 2 receivers, standalone gloo group): buckets of uneven
sizes holding bf16 and fp32 tensors, each bucket handed to `on_bucket` as it lands while the next ones
are on the wire, bit-identical to what was published, for both snapshot modes of `publish`; a consumer
error is raised only after the version's broadcasts drained, and the next version still arrives. Then a
second publisher with a direct layout (tensors of at least `DIRECT_BYTES` in buckets of their own) and
checksums: receiver 1 lands those straight in its staged tensors (`receive(into=...)`), receiver 2 in
its own buffers; both bit-identical, in both snapshot modes.

The same file is the MPI program: `python test_weights_pipeline_mpi.py TIMEOUT OUT_DIR` on every rank.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

TIMEOUT_S = 20.0
BUCKET_BYTES = 4096
VERSIONS = (1, 2, 3, 4)
FAILING_VERSION = 5  # receiver rank 1's consumer raises on its second bucket
LAST_VERSION = 6
DIRECT_BYTES = 1024
DIRECT_VERSIONS = (7, 8)  # 7: a snapshot (lone buckets packed), 8: handed over (sent from the tensors)


def model(version: int) -> dict[str, torch.Tensor]:
    """Uneven bf16/fp32 tensors: some share a bucket, one is larger than a bucket, sizes not aligned."""
    g = torch.Generator().manual_seed(500 + version)
    shapes = [((100, 7), torch.float32), ((333,), torch.bfloat16), ((1500,), torch.float32),
              ((3, 5), torch.bfloat16), ((41, 9), torch.float32), ((2048,), torch.bfloat16),
              ((1,), torch.float32), ((700,), torch.float32), ((129,), torch.bfloat16)]  # fmt: skip
    return {f"model.layers.{i}.w": torch.randn(s, generator=g).to(dt) for i, (s, dt) in enumerate(shapes)}


def digest(named: dict[str, torch.Tensor] | list[tuple[str, torch.Tensor]]) -> dict[str, str]:
    items = named.items() if isinstance(named, dict) else named
    return {
        n: hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest() for n, t in items
    }


# ----- the MPI program -----
def _publish(world: Any, group: Any, result: dict[str, Any]) -> None:
    from rollart_hpc.weights.buckets import layout_for
    from rollart_hpc.weights.publisher import WeightPublisher

    named = model(0)
    pub = WeightPublisher(group, layout_for(named.items(), BUCKET_BYTES))
    result["bucket_nbytes"] = list(pub.layout.bucket_nbytes)
    result["published"] = {}
    for version in (*VERSIONS, FAILING_VERSION, LAST_VERSION):
        for name, tensor in model(version).items():
            named[name].copy_(tensor)
        snapshot = version % 2 == 1
        pub.publish(version, named, snapshot=snapshot)
        if not snapshot:
            pub.wait_packed()
        result["published"][str(version)] = digest(named)
        for tensor in named.values():
            tensor.fill_(-1.0)  # the snapshot rule: changing the tensors now must not reach the receivers
        pub.wait()
    direct = WeightPublisher(group, layout_for(named.items(), BUCKET_BYTES, DIRECT_BYTES), checksum=True)
    result["direct_bucket_nbytes"] = list(direct.layout.bucket_nbytes)
    for version in DIRECT_VERSIONS:
        fresh = model(version)
        direct.publish(version, fresh, snapshot=version == DIRECT_VERSIONS[0])
        direct.wait()
        result["published"][str(version)] = digest(fresh)
    result["direct_sends"] = direct.direct_sends


def _receive_direct(world: Any, group: Any, result: dict[str, Any]) -> None:
    from rollart_hpc.weights.publisher import WeightReceiver

    rec = WeightReceiver(group, 0)
    staged = {n: torch.empty_like(t) for n, t in model(0).items()}
    pointers = {n: t.data_ptr() for n, t in staged.items()}
    result["in_place"], result["copied"] = {}, {}
    for _ in DIRECT_VERSIONS:
        copied: list[str] = []

        def stage(views: list[tuple[str, torch.Tensor]], copied: list[str] = copied) -> None:
            for name, view in views:
                copied.append(name)
                staged[name].copy_(view)

        got = rec.receive(stage, into=rec.landable(staged) if world.rank == 1 else None)
        result["received"][str(got)] = digest(staged)
        result["in_place"][str(got)] = sorted(set(staged) - set(copied))
        result["copied"][str(got)] = sorted(copied)
        assert all(t.data_ptr() == pointers[n] for n, t in staged.items())
    result["direct_ring_bytes"] = rec.allocated_bytes


def _receive(world: Any, group: Any, result: dict[str, Any]) -> None:
    from rollart_hpc.weights.publisher import WeightReceiver

    rec = WeightReceiver(group, 0)
    staged = {n: torch.empty_like(t) for n, t in model(0).items()}
    result["received"], result["views"], result["bucket_calls"] = {}, {}, {}
    result["ring_bytes"] = []
    for version in (*VERSIONS, FAILING_VERSION, LAST_VERSION):
        calls: list[list[str]] = []
        seen: dict[str, str] = {}

        def stage(
            views: list[tuple[str, torch.Tensor]],
            calls: list[list[str]] = calls,
            version: int = version,
            seen: dict[str, str] = seen,
        ) -> None:
            calls.append([n for n, _ in views])
            seen.update(digest(views))
            if version == FAILING_VERSION and world.rank == 1 and len(calls) == 2:
                raise ValueError("consumer failed")
            for name, view in views:
                staged[name].copy_(view)

        try:
            got = rec.receive(stage)
        except ValueError as exc:
            result["consumer_error"] = str(exc)
            continue
        finally:
            result["ring_bytes"].append(rec.allocated_bytes)
        result["received"][str(got)] = digest(staged)
        result["views"][str(got)] = seen
        result["bucket_calls"][str(got)] = calls
    _receive_direct(world, group, result)


def main() -> None:
    from rollart_hpc.cluster.env import read_process_env
    from rollart_hpc.cluster.plan import RoleRange, RunPlan
    from rollart_hpc.cluster.world import make_world
    from rollart_hpc.weights.group import make_standalone_group

    timeout, out_dir = float(sys.argv[1]), Path(sys.argv[2])
    plan = RunPlan((RoleRange("trainer", 0, 1, ""), RoleRange("rollout", 1, 2, "")))
    world = make_world(plan, read_process_env(), timeout)
    group = make_standalone_group(world, [0, 1, 2], "gloo", timeout)
    result: dict[str, Any] = {"rank": world.rank}
    (_publish if world.rank == 0 else _receive)(world, group, result)
    group.close()
    (out_dir / f"rank-{world.rank}.json").write_text(json.dumps(result))


# ----- the tests -----
@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    from launching import mpiexec_run

    out = tmp_path_factory.mktemp("weights-pipeline")
    mpiexec_run(3, __file__, TIMEOUT_S, out, timeout=240)
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(3)]


@pytest.mark.mpi
def test_layout_has_several_uneven_buckets(results: list[dict[str, Any]]) -> None:
    sizes = results[0]["bucket_nbytes"]
    assert len(sizes) >= 4 and len(set(sizes)) >= 3
    assert max(sizes) > BUCKET_BYTES  # the tensor larger than a bucket has its own


@pytest.mark.mpi
def test_staged_copies_and_views_are_bit_identical_in_both_snapshot_modes(
    results: list[dict[str, Any]],
) -> None:
    published = results[0]["published"]
    assert published["1"] != published["2"]
    for rank in (1, 2):
        for version in (*VERSIONS, LAST_VERSION):
            assert results[rank]["received"][str(version)] == published[str(version)]
            assert results[rank]["views"][str(version)] == published[str(version)]


@pytest.mark.mpi
def test_receiver_holds_only_the_buckets_in_flight(results: list[dict[str, Any]]) -> None:
    """The receive buffers are a ring of two buckets (the default depth), each as large as the largest
    bucket that lands in one, not one buffer per bucket: below the model's bytes."""
    sizes, direct = results[0]["bucket_nbytes"], results[0]["direct_bucket_nbytes"]
    for rank in (1, 2):
        assert set(results[rank]["ring_bytes"]) == {2 * max(sizes)}
        assert 2 * max(sizes) < sum(sizes)
    # Landing the lone buckets in place, receiver 1's ring holds only the shared bucket (the smallest).
    assert results[1]["direct_ring_bytes"] == 2 * min(direct) < results[2]["direct_ring_bytes"]
    assert results[2]["direct_ring_bytes"] == 2 * max(direct)


@pytest.mark.mpi
def test_on_bucket_sees_each_bucket_once_in_layout_order(results: list[dict[str, Any]]) -> None:
    names = list(model(0))
    for rank in (1, 2):
        for calls in results[rank]["bucket_calls"].values():
            assert len(calls) == len(results[0]["bucket_nbytes"])
            assert [n for call in calls for n in call] == names


@pytest.mark.mpi
def test_consumer_error_is_raised_and_the_next_version_still_arrives(results: list[dict[str, Any]]) -> None:
    assert results[1]["consumer_error"] == "consumer failed"
    assert str(FAILING_VERSION) not in results[1]["received"]
    assert results[2]["received"][str(FAILING_VERSION)] == results[0]["published"][str(FAILING_VERSION)]
    assert results[1]["received"][str(LAST_VERSION)] == results[0]["published"][str(LAST_VERSION)]


@pytest.mark.mpi
def test_direct_layout_lands_large_tensors_in_place_and_both_receivers_agree(
    results: list[dict[str, Any]],
) -> None:
    published = results[0]["published"]
    sizes = results[0]["direct_bucket_nbytes"]
    big = {n for n, t in model(0).items() if t.numel() * t.element_size() >= DIRECT_BYTES}
    assert len(big) == 5 and len(sizes) == len(big) + 1  # the large tensors alone, the four small together
    assert results[0]["direct_sends"] == len(big)  # only the handed-over version, sent from its tensors
    for version in map(str, DIRECT_VERSIONS):
        for rank in (1, 2):
            assert results[rank]["received"][version] == published[version]
        assert set(results[1]["in_place"][version]) == big  # landed straight in the staged tensors
        assert set(results[1]["copied"][version]) == set(model(0)) - big
        assert results[2]["in_place"][version] == [] and set(results[2]["copied"][version]) == set(model(0))


if __name__ == "__main__":
    main()
