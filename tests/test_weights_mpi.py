"""Weight broadcast in a real MPI world (mpiexec, 1 publisher + 2 receivers, standalone gloo group).

"roundtrip" runs the transport contract (mpi_scripts/weights_contract.py) over `WeightPublisher`/
`WeightReceiver`, announced over MPI."""

import json
from pathlib import Path

import pytest
from launching import mpiexec_run

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "tests" / "mpi_scripts" / "weights_check.py"
TIMEOUT_S = 3.0
pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("weights")
    mpiexec_run(3, SCRIPT, TIMEOUT_S, out, timeout=240)
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(3)]


def test_receivers_get_bit_identical_tensors_for_three_versions(results):
    runs = [r["roundtrip"]["runs"] for r in results]
    assert [run["bucket_bytes"] for run in runs[0]] == [256, 4096, 1 << 20, 4096, 256, 256, 1 << 20]
    assert [run["stream"] for run in runs[0]] == [False] * 5 + [True, False]  # chunks in reverse, checksums
    assert runs[0][2]["num_buckets"] == 1 and runs[0][0]["num_buckets"] >= 5
    assert runs[0][6]["num_buckets"] == 3  # direct 1 KiB: the embedding and the projection alone
    # Snapshots are always packed; handed-over and streamed tensors alone in a bucket go out without a
    # copy: the 300x64 float32 embedding and the 64x64 bf16 projection, in each of the 3 versions, and at
    # 256-byte buckets also the 264-byte float64 head (larger than a bucket; its alignment padding is not
    # sent); in 1 MiB buckets with `direct_mb` at 1 KiB, the embedding and the projection (checksummed).
    assert [run["direct_sends"] for run in runs[0]] == [0, 0, 0, 2 * 3, 3 * 3, 3 * 3, 2 * 3]
    for index, published in enumerate(runs[0]):
        assert sorted(published["versions"]) == ["1", "2", "3"]
        assert published["versions"]["1"] != published["versions"]["2"]
        for receiver in (1, 2):
            assert runs[receiver][index]["num_buckets"] == published["num_buckets"]
            assert runs[receiver][index]["versions"] == published["versions"]


def test_publish_returns_before_the_broadcast_completes(results):
    """With a send depth as large as the model's 8 buckets (the publisher then holds them all)."""
    pub = results[0]["nonblocking"]
    assert pub["in_flight_after_publish"] is True
    assert pub["publish_s"] < 2.0  # receivers join 3 s late (margin for a loaded machine)
    assert pub["delivered_s"] >= 2.9
    assert results[1]["nonblocking"]["ok"] and results[2]["nonblocking"]["ok"]


def test_silent_receiver_makes_publisher_raise_named_timeout(results):
    pub = results[0]["silent"]
    assert "never joined: rollout rank 2 (rollout #1)" in pub["error"]
    assert "rollout rank 1" not in pub["error"]
    assert pub["error"].startswith(
        "trainer rank 0 (trainer #0): weights v1 header did not complete within 3s"
    )
    assert TIMEOUT_S - 0.5 < pub["elapsed_s"] < TIMEOUT_S + 5
