"""Tensor, pipeline and data parallelism across real processes (mpiexec, gloo), and checkpoints across layouts.

The worker is `tests/mpi_scripts/train_layout_check.py`. The model is the run's tiny shape: tied
embeddings (so PP > 1 keeps a second copy of the embedding on the last stage), qkv biases, 2 heads and 1
key/value group (so TP = 2 splits one fused qkv group over two ranks), stored as a sharded checkpoint
(several safetensors files and `model.safetensors.index.json`). A Qwen3 model (q/k layernorm,
head_dim != hidden_size / heads) checks tensor parallelism for that family.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

WORKER = Path(__file__).parent / "mpi_scripts" / "train_layout_check.py"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rollart_hpc.models.checkpoint import ShardWriter, load_weights
    from rollart_hpc.models.tiny import make_tiny_model

    folder = make_tiny_model(
        tmp_path_factory.mktemp("layouts") / "qwen2", family="qwen2", hidden_size=128, num_layers=2,
        num_heads=2, num_kv_heads=1, vocab_size=512, tie_word_embeddings=True,
    )  # fmt: skip
    # Stored as a sharded checkpoint (an index and several files): each rank reads only its stage's files
    # and its tensor-parallel slices (`model.read_shard`).
    weights = load_weights(folder)
    (folder / "model.safetensors").unlink()
    writer = ShardWriter(folder, 200_000)
    writer.add(weights)
    assert len(writer.close()) >= 3
    return folder


def _run(
    model_dir: Path,
    out: Path,
    tp: int,
    pp: int,
    dp: int,
    mbt: int = 48,
    load_from: str = "",
    save_to: str = "",
    sequence_parallel: bool = False,
) -> dict:
    from launching import mpiexec_run

    out.mkdir(parents=True)
    ranks = tp * pp * dp
    store = out / f"store-{uuid.uuid4().hex}"  # a file store: no port to race for
    env = {"OMP_NUM_THREADS": "1", "LAYOUT_SEQUENCE_PARALLEL": str(int(sequence_parallel))}
    mpiexec_run(ranks, WORKER, model_dir, out, store, tp, pp, mbt, load_from, save_to, env=env)
    return torch.load(out / "result.pt")


def _assert_same_step(got: dict, ref: dict, step: int) -> None:
    g, r = got["metrics"][step], ref["metrics"][step]
    assert g["num_action_tokens"] == r["num_action_tokens"] and g["num_tokens"] == r["num_tokens"]
    assert g["loss"] == pytest.approx(r["loss"], rel=1e-5)
    assert g["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-5)
    assert g["is_weight"] == pytest.approx(r["is_weight"], rel=1e-5)
    assert g["entropy"] == pytest.approx(r["entropy"], rel=1e-5)
    assert ("kl" in g) == ("kl" in r)
    # k1 is a mean of log-prob differences of ~1e-3: float32 noise of the log-probs (~1e-7) bounds it
    assert g.get("kl", 0.0) == pytest.approx(r.get("kl", 0.0), rel=1e-5, abs=1e-7)
    assert set(got["weights"][step]) == set(ref["weights"][step])
    for name, w in ref["weights"][step].items():
        diff = got["weights"][step][name] - w
        assert float(diff.norm() / w.norm()) < 1e-5, name
        # Adam divides by sqrt(v): reduction-order noise on near-zero gradients grows towards the lr
        # (1e-4) on single elements; 5e-6 still tells a different update apart.
        assert float(diff.abs().max()) < 5e-6, name


def test_tensor_pipeline_and_data_parallel_steps_match_one_rank(model_dir: Path, tmp_path: Path) -> None:
    """Two RL steps at TP2, PP2, TP2xDP2 (sequence parallel) and PP2xDP2 with uneven micro-batches (48
    padded tokens) give the losses, gradient norms and HF weights of one rank taking each batch as a
    single micro-batch: the global action-token denominator holds across micro-batches, stages and DP, and
    so do the second step's global trajectory count, sequence-level ratio, entropy bonus and KL term."""
    from rollart_hpc.models.checkpoint import load_weights

    ref = _run(model_dir, tmp_path / "ref", 1, 1, 1, mbt=4096)
    assert "kl" not in ref["metrics"][0] and ref["metrics"][1]["kl"] != 0.0  # the second step's KL term
    initial = load_weights(model_dir)
    assert not torch.equal(ref["weights"][0]["model.norm.weight"], initial["model.norm.weight"])
    for tp, pp, dp, sp in ((2, 1, 1, False), (1, 2, 1, False), (2, 1, 2, True), (1, 2, 2, False)):
        got = _run(model_dir, tmp_path / f"tp{tp}pp{pp}dp{dp}sp{sp:d}", tp, pp, dp, sequence_parallel=sp)
        for step in (0, 1):
            _assert_same_step(got, ref, step)
            # publication gathers unit by unit (one layer at most: 12 HF tensors with qwen2's qkv biases),
            # and the units together are the same model in the same order
            same, largest = got["units_match"][step]
            assert same and largest <= 12, (tp, pp, dp, largest)
        assert got["saved_match"]  # save_hf writes the gathered weights (no gather_object: it raises)


def test_a_checkpoint_resumes_at_another_layout(model_dir: Path, tmp_path: Path) -> None:
    """Saved at TP2/PP1/DP2 after step 1 (distributed optimizer), resumed at TP1/PP2/DP1: step 2 equals the
    saving world's own step 2, so the model and the Adam moments crossed the layouts."""
    ckpt = tmp_path / "ckpt"
    straight = _run(model_dir, tmp_path / "save", 2, 1, 2, save_to=str(ckpt))
    resumed = _run(model_dir, tmp_path / "resume", 1, 2, 1, load_from=str(ckpt))
    assert len(resumed["metrics"]) == 1
    _assert_same_step({k: v[1:] for k, v in straight.items() if isinstance(v, list)}, resumed, 0)


def test_qwen3_tensor_parallel_steps_match_one_rank(tmp_path: Path) -> None:
    """Qwen3 at TP2 with sequence parallelism: the q/k layernorm weights are replicated while each TP rank
    normalises only its own heads, so their gradients must be summed over TP; the steps then equal one
    rank's, and the trained norms are published under their HF names."""
    from rollart_hpc.models.checkpoint import load_weights
    from rollart_hpc.models.tiny import make_tiny_model

    model_dir = make_tiny_model(
        tmp_path / "qwen3", family="qwen3", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
        vocab_size=512, tie_word_embeddings=False,
    )  # fmt: skip
    ref = _run(model_dir, tmp_path / "ref", 1, 1, 1, mbt=4096)
    name = "model.layers.1.self_attn.k_norm.weight"
    assert not torch.equal(ref["weights"][0][name], load_weights(model_dir)[name])
    got = _run(model_dir, tmp_path / "tp2", 2, 1, 1, sequence_parallel=True)
    for step in (0, 1):
        _assert_same_step(got, ref, step)
        assert got["units_match"][step][0]
