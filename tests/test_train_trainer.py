"""Trainer on one rank: log-probs, SFT, RL step direction, micro-batch invariance, checkpoints, HF export.

On the trainer's device (gloo on the CPU, NCCL on CUDA: tests/train_device.py); float32 tolerances from
`train_device.tol` / `assert_close`, which widen them where CUDA runs fp32 matmuls in TF32."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from train_device import BACKEND, DEVICE, assert_close, tol

from rollart_hpc.algo.loss import LossConfig, packed_policy_loss
from rollart_hpc.train import parallel
from rollart_hpc.train.batch import PackedBatch, from_sequences, micro_batch_groups, select
from rollart_hpc.train.config import OptimConfig, TrainerConfig
from rollart_hpc.train.trainer import Trainer

# Against transformers on the CPU: the trainer on CUDA runs fp32 matmuls in TF32 (10-bit mantissa), which
# moves a log-prob by a few 1e-4 (3e-4 measured on an H200); on the CPU both are fp32.
HF_LOGPROB_ATOL = tol(1e-5)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    import torch.distributed as dist
    from megatron.core import parallel_state

    from rollart_hpc.models.tiny import make_tiny_model

    # One rank, no port. NCCL where the trainer runs on CUDA: Megatron's distributed optimizer gathers its
    # parameters with a coalesced all-gather that gloo does not implement for CUDA tensors (a segfault).
    dist.init_process_group(BACKEND, store=dist.HashStore(), rank=0, world_size=1)
    folder = make_tiny_model(
        tmp_path_factory.mktemp("tiny") / "llama", family="llama", hidden_size=128, num_layers=2,
        num_heads=2, num_kv_heads=1, tie_word_embeddings=True,
    )  # fmt: skip
    yield folder
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _batch(
    vocab: int,
    lengths: list[int],
    advantages: list[float],
    seed: int = 0,
    behaviour: torch.Tensor | None = None,
) -> PackedBatch:
    gen = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]
    masks = [[0] * (n // 3) + [1] * (n - n // 3) for n in lengths]
    adv = [[a * m for m in mask] for a, mask in zip(advantages, masks, strict=True)]
    blp = [[0.0] * n for n in lengths]
    batch = from_sequences(tokens, masks, blp, adv)
    if behaviour is None:
        return batch
    return PackedBatch(batch.tokens, batch.cu_seqlens, batch.action_mask, behaviour, batch.advantages)


def _with_behaviour(batch: PackedBatch, logprobs: torch.Tensor) -> PackedBatch:
    blp = torch.where(batch.action_mask, logprobs, 0.0)
    return PackedBatch(batch.tokens, batch.cu_seqlens, batch.action_mask, blp, batch.advantages)


def _trainer(
    model_dir: Path,
    lr: float = 1e-3,
    micro_batch_tokens: int = 4096,
    ppo_epochs: int = 1,
    num_minibatches: int = 1,
    precision: str = "fp32",
    distributed_optimizer: bool = True,
) -> Trainer:
    optim = OptimConfig(lr=lr, weight_decay=0.01, grad_clip=1.0)
    cfg = TrainerConfig(
        optim=optim,
        micro_batch_tokens=micro_batch_tokens,
        ppo_epochs=ppo_epochs,
        num_minibatches=num_minibatches,
        precision=precision,
        distributed_optimizer=distributed_optimizer,
    )
    return Trainer(model_dir, cfg)


def _seq_mean(values: torch.Tensor, batch: PackedBatch, i: int) -> float:
    lo, hi = int(batch.cu_seqlens[i]), int(batch.cu_seqlens[i + 1])
    return float(values[lo:hi][batch.action_mask[lo:hi]].mean())


def _hf_logits(model_dir: Path, batch: PackedBatch) -> Iterator[tuple[int, int, torch.Tensor]]:
    """Per packed sequence: its span in the batch and transformers' fp32 logits for its next tokens."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for i in range(batch.num_sequences):
        lo, hi = int(batch.cu_seqlens[i]), int(batch.cu_seqlens[i + 1])
        with torch.no_grad():
            yield lo, hi, hf(batch.tokens[lo:hi][None]).logits[0, :-1]


def test_logprobs_match_transformers(model_dir: Path) -> None:
    trainer = _trainer(model_dir, micro_batch_tokens=40)
    batch = _batch(trainer.config.vocab_size, [17, 9, 23], [1.0, 1.0, 1.0])
    ours = trainer.logprobs(batch)
    for lo, hi, logits in _hf_logits(model_dir, batch):
        ref = torch.log_softmax(logits, -1).gather(-1, batch.tokens[lo + 1 : hi, None])[:, 0]
        assert ours[lo] == 0.0
        assert float((ours[lo + 1 : hi] - ref).abs().max()) < HF_LOGPROB_ATOL


def test_rl_step_logs_the_action_token_entropy_of_transformers_logits(model_dir: Path) -> None:
    """metrics["entropy"]: the mean over the step's action tokens of the softmax entropy (padded vocabulary
    rows masked), whatever the micro-batch split."""
    trainer = _trainer(model_dir, micro_batch_tokens=30)
    batch = _batch(trainer.config.vocab_size, [17, 9, 23], [1.0, -1.0, 0.5])
    entropies = []
    for lo, hi, logits in _hf_logits(model_dir, batch):
        h = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
        entropies.append(h[batch.action_mask[lo + 1 : hi]])
    expected = float(torch.cat(entropies).mean())
    metrics = trainer.rl_step(
        _with_behaviour(batch, trainer.logprobs(batch)), batch.num_action_tokens, LossConfig()
    )
    assert metrics["entropy"] == pytest.approx(expected, rel=tol(1e-5), abs=HF_LOGPROB_ATOL / 10)


def test_kl_to_the_reference_is_zero_while_the_policy_equals_it(model_dir: Path) -> None:
    """A reference loaded from the policy's own weights: kl = 0 and the k3 term leaves the gradient as it
    is (its gradient vanishes at r = 1); after one update the policy moves away and kl > 0."""
    plain, with_kl = _trainer(model_dir, micro_batch_tokens=30), _trainer(model_dir, micro_batch_tokens=30)
    with_kl.load_reference(model_dir)
    batch = _batch(plain.config.vocab_size, [20, 26, 14], [1.0, -0.5, 0.3], seed=3)
    batch = _with_behaviour(batch, plain.logprobs(batch))
    m0 = plain.rl_step(batch, batch.num_action_tokens, LossConfig())
    m1 = with_kl.rl_step(batch, batch.num_action_tokens, LossConfig(kl_coef=0.1, kl_estimator="k3"))
    assert m1["kl"] == 0.0 and "kl" not in m0
    assert_close(with_kl.grad_buffer, plain.grad_buffer, rtol=1e-6, atol=1e-9)
    m2 = with_kl.rl_step(batch, batch.num_action_tokens, LossConfig(kl_coef=0.1, kl_estimator="k3"))
    assert m2["kl"] > 0.0


def test_sft_steps_reduce_the_loss(model_dir: Path) -> None:
    trainer = _trainer(model_dir)
    batch = _batch(trainer.config.vocab_size, [24, 16, 30], [0.0, 0.0, 0.0])
    losses = [trainer.sft_step(batch)["loss"] for _ in range(5)]
    assert losses[-1] < 0.8 * losses[0]
    assert all(b < a for a, b in zip(losses, losses[1:], strict=False))
    nll = -trainer.logprobs(batch)[batch.action_mask].mean()
    assert float(nll) < losses[-1]


def test_rl_step_raises_logprobs_of_positive_advantage_sequences(model_dir: Path) -> None:
    trainer = _trainer(model_dir, lr=1e-4)
    batch = _batch(trainer.config.vocab_size, [20, 26, 14], [1.0, 0.0, 0.0], seed=3)
    before = trainer.logprobs(batch)
    batch = _with_behaviour(batch, before)
    num_actions = batch.num_action_tokens
    metrics = trainer.rl_step(batch, num_actions, LossConfig())
    after = trainer.logprobs(batch)
    assert _seq_mean(after, batch, 0) > _seq_mean(before, batch, 0) + 1e-3
    # The loss is -sum(A * ratio) / global action tokens with ratio 1 and weight 1 at the step's start.
    seq0_actions = int(batch.action_mask[: int(batch.cu_seqlens[1])].sum())
    assert metrics["loss"] == pytest.approx(-seq0_actions / num_actions, rel=1e-6)
    assert metrics["is_weight"] == pytest.approx(1.0, rel=tol(1e-6)) and metrics["approx_kl"] == 0.0
    assert metrics["num_action_tokens"] == num_actions and metrics["grad_norm"] > 0
    with pytest.raises(ValueError, match="num_global_action_tokens"):
        trainer.rl_step(batch, num_actions - 1, LossConfig())
    empty = select(batch, [])
    empty_metrics = trainer.rl_step(empty, num_actions, LossConfig())
    assert set(empty_metrics) == set(metrics) and empty_metrics["loss"] == 0.0
    assert float(trainer.grad_buffer.abs().max()) == 0.0


def test_ppo_epochs_and_minibatches_update_against_the_proximal_policy(model_dir: Path) -> None:
    """Two epochs of two minibatches: four AdamW steps, each against the log-probs of the step's start,
    so the ratio leaves 1 and the clip acts; the first update is a one-update step on its minibatch."""
    ppo = _trainer(model_dir, lr=3e-2, ppo_epochs=2, num_minibatches=2)
    batch = _batch(ppo.config.vocab_size, [20, 26, 14, 18], [1.0, -1.0, 2.0, -2.0], seed=9)
    batch = _with_behaviour(batch, ppo.logprobs(batch))
    metrics = ppo.rl_step(batch, batch.num_action_tokens, LossConfig())
    assert metrics["num_updates"] == 4 and ppo.step == 4
    assert metrics["clip_fraction"] > 0 and metrics["approx_kl"] > 0
    assert (
        metrics["num_action_tokens"] == batch.num_action_tokens and metrics["num_tokens"] == batch.num_tokens
    )
    first_half = select(batch, [0, 1])
    one = _trainer(model_dir, lr=3e-2)
    m1 = one.rl_step(first_half, first_half.num_action_tokens, LossConfig())
    assert m1["num_updates"] == 1 and m1["clip_fraction"] == 0.0
    again = _trainer(model_dir, lr=3e-2, num_minibatches=2, ppo_epochs=1)
    again.optimizer.step = lambda: (True, 0.0, None)  # keep the start weights: grads only
    again._policy_update(first_half, first_half.num_action_tokens, LossConfig(), again.logprobs(first_half))
    # `one` clipped its gradient inside the optimizer step; `again` skipped the step: compare directions.
    unit = [g / torch.linalg.vector_norm(g) for g in (again.grad_buffer, one.grad_buffer)]
    assert_close(unit[0], unit[1], rtol=1e-5, atol=1e-7)


def test_more_minibatches_than_sequences_skip_the_empty_ones(model_dir: Path) -> None:
    trainer = _trainer(model_dir, lr=1e-3, num_minibatches=4)
    batch = _batch(trainer.config.vocab_size, [20, 26], [1.0, -1.0], seed=4)
    batch = _with_behaviour(batch, trainer.logprobs(batch))
    assert trainer.rl_step(batch, batch.num_action_tokens, LossConfig())["num_updates"] == 2


@pytest.mark.parametrize(
    "cfg",
    [
        LossConfig(),
        LossConfig(loss_agg="seq_mean_token_mean", ratio_level="sequence", clip_low=3e-4, clip_high=4e-4),
        LossConfig(loss_agg="seq_mean_token_sum_norm", loss_agg_tokens=32, is_level="sequence"),
    ],
    ids=["token_mean", "gspo", "dr_grpo"],
)
def test_gradients_do_not_depend_on_the_micro_batch_split(model_dir: Path, cfg: LossConfig) -> None:
    whole, split = _trainer(model_dir, micro_batch_tokens=4096), _trainer(model_dir, micro_batch_tokens=30)
    batch = _batch(whole.config.vocab_size, [20, 26, 14, 9, 11], [1.0, -0.5, 0.3, 2.0, -1.0], seed=5)
    batch = _with_behaviour(batch, whole.logprobs(batch) - 0.1)
    assert len(micro_batch_groups(batch, 30)) >= 3
    m1 = whole.rl_step(batch, batch.num_action_tokens, cfg)
    m2 = split.rl_step(batch, batch.num_action_tokens, cfg)
    assert float(whole.grad_buffer.abs().max()) > 0
    assert_close(split.grad_buffer, whole.grad_buffer, rtol=1e-5, atol=1e-7)
    assert m2["loss"] == pytest.approx(m1["loss"], rel=tol(1e-5))
    assert m2["grad_norm"] == pytest.approx(m1["grad_norm"], rel=tol(1e-5))


@pytest.mark.parametrize(
    "cfg",
    [
        LossConfig(clip_high=0.3, is_cap=1.5),
        LossConfig(loss_agg="seq_mean_token_mean", is_cap=None, is_reject_low=0.5, is_reject_high=1.5),
    ],
    ids=["token_mean", "seq_mean_reject"],
)
def test_rl_step_reports_the_algorithm_library_loss_and_diagnostics(model_dir: Path, cfg: LossConfig) -> None:
    """The trainer's micro-batched step reports what `algo.loss.packed_policy_loss` gives on the same
    log-probs (proximal = current), behaviour log-probs, per-trajectory advantages and denominator."""
    trainer = _trainer(model_dir, micro_batch_tokens=30)
    advantages = [1.0, -0.5, 0.3, 2.0, -1.0]
    batch = _batch(trainer.config.vocab_size, [20, 26, 14, 9, 11], advantages, seed=7)
    logprobs = trainer.logprobs(batch)
    shift = torch.linspace(-1.2, 0.4, batch.num_tokens)  # some behaviour weights above is_cap = 2
    batch = _with_behaviour(batch, logprobs + shift)
    assert len(micro_batch_groups(batch, 30)) >= 3
    num_global = batch.num_action_tokens + 3
    metrics = trainer.rl_step(batch, num_global, cfg)
    loss, ref = packed_policy_loss(
        logprobs,
        logprobs,
        batch.behaviour_logprobs,
        torch.tensor(advantages),
        batch.cu_seqlens,
        batch.action_mask,
        num_global,
        cfg,
        batch.num_sequences,
    )
    assert metrics["loss"] == pytest.approx(float(loss), rel=tol(1e-5))
    assert float(ref.is_capped_fraction + ref.is_rejected_fraction) > 0 and float(ref.is_weight) > 0
    for name, value in ref.summed().items():
        assert metrics[name] == pytest.approx(float(value), rel=tol(1e-5), abs=1e-7), name
    assert set(metrics) == {
        *ref.summed(),
        "loss",
        "grad_norm",
        "num_tokens",
        "num_action_tokens",
        "step",
        "num_updates",
        "max_abs_behaviour_log_ratio",
        "entropy",
    }
    gap = float(shift[batch.action_mask].abs().max())
    assert metrics["max_abs_behaviour_log_ratio"] == pytest.approx(gap, rel=tol(1e-5))


def _params(trainer: Trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.params]


def _train(trainer: Trainer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        batch = _batch(trainer.config.vocab_size, [18, 12, 25], [1.0, -1.0, 0.5], seed=step)
        if step % 2:
            losses.append(trainer.sft_step(batch)["loss"])
        else:
            batch = _with_behaviour(batch, trainer.logprobs(batch) + 0.05)
            losses.append(trainer.rl_step(batch, batch.num_action_tokens, LossConfig())["loss"])
    return losses


def test_checkpoint_resume_is_bit_exact(model_dir: Path, tmp_path: Path) -> None:
    from rollart_hpc.train import checkpoint

    first = _trainer(model_dir)
    _train(first, range(3))
    path = first.save_checkpoint(tmp_path / "ckpt")
    assert checkpoint.is_complete(path) and checkpoint.checkpoint_step(path) == 3
    assert not (tmp_path / ".ckpt.tmp").exists()
    with pytest.raises(FileExistsError):
        first.save_checkpoint(tmp_path / "ckpt")

    resumed = _trainer(model_dir)
    assert resumed.load_checkpoint(path) == 3
    resumed_losses = _train(resumed, range(3, 6))
    straight = _trainer(model_dir)
    straight_losses = _train(straight, range(6))
    assert resumed_losses == straight_losses[3:]
    assert resumed.step == straight.step == 6
    assert all(torch.equal(a, b) for a, b in zip(_params(resumed), _params(straight), strict=True))
    with pytest.raises(FileNotFoundError):
        resumed.load_checkpoint(tmp_path / "missing")


def test_hf_export_round_trips_through_transformers(model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from rollart_hpc.models.checkpoint import load_weights

    trainer = _trainer(model_dir)
    original = load_weights(model_dir)
    exported = trainer.hf_state_dict()  # on the trainer's device
    assert set(exported) == set(original)
    assert all(torch.equal(exported[k].cpu(), original[k]) for k in original)
    batch = _batch(trainer.config.vocab_size, [15, 21], [0.0, 0.0])
    trainer.sft_step(batch)
    out = trainer.save_hf(tmp_path / "hf")
    assert (out / "COMPLETE").is_file() and (out / "tokenizer.json").is_file()
    saved = load_weights(out)
    assert not torch.equal(saved["model.norm.weight"], original["model.norm.weight"])
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    ids = batch.tokens[:15]
    with torch.no_grad():
        ref = torch.log_softmax(hf(ids[None]).logits[0, :-1], -1).gather(-1, ids[1:, None])[:, 0]
    ours = trainer.logprobs(batch)[1:15]
    assert float((ours - ref).abs().max()) < HF_LOGPROB_ATOL


def test_save_hf_writes_bounded_shards_that_load_back(model_dir: Path, tmp_path: Path) -> None:
    """With files of at most 100 kB the export is several shards and an index; the writer never held
    more than one file's tensors, and the directory loads back to the trainer's weights."""
    import json

    from rollart_hpc.models.checkpoint import load_weights

    trainer = _trainer(model_dir)
    expected = trainer.hf_state_dict()
    out = trainer.save_hf(tmp_path / "hf", shard_bytes=100_000)
    files = sorted(out.glob("model-*-of-*.safetensors"))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(files) >= 3 and not (out / "model.safetensors").exists() and (out / "COMPLETE").is_file()
    assert sorted(set(index["weight_map"].values())) == [f.name for f in files]
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in expected.values())
    largest = max(t.numel() * t.element_size() for t in expected.values())
    for file in files:  # a file is at most 100 kB of tensors, or one tensor larger than that
        assert file.stat().st_size <= max(100_000, largest) + 4096
    saved = load_weights(out)
    assert set(saved) == set(expected) and all(torch.equal(saved[k], expected[k]) for k in expected)


def test_a_collective_that_times_out_names_the_peers(model_dir: Path) -> None:
    from rollart_hpc.contracts.errors import PeerTimeoutError
    from rollart_hpc.train import comm

    class SilentWork:
        def wait(self, timeout: object) -> bool:
            raise RuntimeError("Timed out waiting for peers")

    with pytest.raises(
        PeerTimeoutError, match=r"trainer rank 0: gradient all_reduce did not complete within 2s"
    ):
        comm._wait(SilentWork(), "gradient all_reduce", 2.0)  # type: ignore[arg-type]
    assert float(comm.all_reduce_sum(torch.ones(3, device=DEVICE), "sum", 5.0).sum()) == 3.0


def test_reset_optimizer_makes_the_next_step_a_fresh_adamw_step(model_dir: Path) -> None:
    def rl_update(trainer: Trainer) -> list[torch.Tensor]:
        before = _params(trainer)
        batch = _batch(trainer.config.vocab_size, [18, 12, 25], [1.0, -1.0, 0.5], seed=7)
        batch = _with_behaviour(batch, trainer.logprobs(batch))
        trainer.rl_step(batch, batch.num_action_tokens, LossConfig())
        return [p.detach() - b for p, b in zip(trainer.params, before, strict=True)]

    warmed, kept = _trainer(model_dir), _trainer(model_dir)
    for trainer in (warmed, kept):
        for step in range(3):
            trainer.sft_step(_batch(trainer.config.vocab_size, [24, 16, 30], [0.0] * 3, seed=step))
    fresh = _trainer(model_dir)
    with torch.no_grad():
        for p, w in zip(fresh.params, warmed.params, strict=True):
            p.copy_(w)
    warmed.reset_optimizer()
    assert not any(o.state for o in parallel.torch_optimizers(warmed.optimizer))
    expected = rl_update(fresh)
    assert all(torch.equal(a, b) for a, b in zip(rl_update(warmed), expected, strict=True))
    assert not all(torch.allclose(a, b) for a, b in zip(rl_update(kept), expected, strict=True))


@pytest.mark.parametrize(
    "cfg",
    [
        LossConfig(),
        LossConfig(
            entropy_coef=0.05, loss_agg="seq_mean_token_mean", ratio_level="sequence", is_level="sequence"
        ),
        LossConfig(kl_coef=0.1, kl_estimator="k1"),  # k1's gradient does not vanish at the reference
    ],
    ids=["default", "entropy_gspo", "kl_k1"],
)
def test_fused_loss_equals_eager_on_packed_batches_with_observation_tokens(
    model_dir: Path, cfg: LossConfig
) -> None:
    """loss_impl "fused" (log-probs from hidden states and the LM head, padding columns masked) gives the
    loss, diagnostics and unclipped gradients of "eager" (the model's full-logit cross-entropy)."""

    def trainer(impl: str) -> Trainer:
        optim = OptimConfig(lr=1e-3, grad_clip=0.0)
        out = Trainer(model_dir, TrainerConfig(optim=optim, micro_batch_tokens=40, loss_impl=impl))
        if cfg.kl_coef:
            out.load_reference(model_dir)
        return out

    fused, eager = trainer("fused"), trainer("eager")
    batch = _batch(fused.config.vocab_size, [20, 26, 14, 9, 11], [1.0, -0.5, 0.3, 2.0, -1.0], seed=5)
    mask = batch.action_mask.clone()
    mask[batch.cu_seqlens[1:] - 4] = False  # observation tokens inside the generated spans
    batch = PackedBatch(
        batch.tokens, batch.cu_seqlens, mask, batch.behaviour_logprobs, batch.advantages * mask
    )
    lp_fused, lp_eager = fused.logprobs(batch), eager.logprobs(batch)
    assert_close(lp_fused, lp_eager, rtol=1e-5, atol=1e-5)
    batch = _with_behaviour(batch, lp_eager - 0.2)
    assert len(micro_batch_groups(batch, 40)) >= 3
    m_fused = fused.rl_step(batch, batch.num_action_tokens, cfg)
    m_eager = eager.rl_step(batch, batch.num_action_tokens, cfg)
    for name in (
        "loss",
        "grad_norm",
        "is_weight",
        "is_capped_fraction",
        "entropy",
        *(("kl",) if cfg.kl_coef else ()),
    ):
        assert m_fused[name] == pytest.approx(m_eager[name], rel=tol(1e-5), abs=1e-8), name
    g_fused, g_eager = fused.grad_buffer, eager.grad_buffer
    assert float(g_eager.abs().max()) > 0
    assert float((g_fused - g_eager).norm() / g_eager.norm()) < tol(1e-5)
    assert_close(g_fused, g_eager, rtol=1e-5, atol=1e-7)


def _main_params(trainer: Trainer) -> list[torch.Tensor]:
    """The optimizer's main parameters (the copies Adam updates)."""
    return [
        p for o in parallel.torch_optimizers(trainer.optimizer) for g in o.param_groups for p in g["params"]
    ]


def test_bf16_trainer_matches_fp32_with_fp32_main_params_and_half_the_published_bytes(
    model_dir: Path,
) -> None:
    fp32, bf16 = _trainer(model_dir), _trainer(model_dir, precision="bf16")
    batch = _batch(fp32.config.vocab_size, [24, 16, 30], [0.0, 0.0, 0.0], seed=11)
    loss32, loss16 = fp32.sft_step(batch)["loss"], bf16.sft_step(batch)["loss"]
    assert loss16 == pytest.approx(loss32, rel=0.02) and loss16 != loss32  # same weights, bf16 compute
    assert all(p.dtype == torch.bfloat16 for p in bf16.params)
    assert all(p.main_grad.dtype == torch.float32 for p in bf16.params)  # type: ignore[attr-defined]
    mains = _main_params(bf16)
    assert sum(m.numel() for m in mains) == sum(p.numel() for p in bf16.params)
    assert all(m.dtype == torch.float32 for m in mains)
    assert any(not torch.equal(m, m.bfloat16().float()) for m in mains)  # below bf16 resolution
    states = [s for o in parallel.torch_optimizers(bf16.optimizer) for s in o.state.values()]
    assert states and all(s[k].dtype == torch.float32 for s in states for k in ("exp_avg", "exp_avg_sq"))
    published32, published16 = fp32.hf_state_dict(), bf16.hf_state_dict()
    assert set(published16) == set(published32)
    assert all(t.dtype == torch.bfloat16 for t in published16.values())
    nbytes = [sum(t.numel() * t.element_size() for t in w.values()) for w in (published32, published16)]
    assert nbytes[1] * 2 == nbytes[0]


@pytest.mark.parametrize("distributed_optimizer", [True, False], ids=["distributed", "local"])
def test_bf16_checkpoint_resume_restores_the_fp32_main_params(
    model_dir: Path, tmp_path: Path, distributed_optimizer: bool
) -> None:
    first = _trainer(model_dir, precision="bf16", distributed_optimizer=distributed_optimizer)
    _train(first, range(2))
    path = first.save_checkpoint(tmp_path / "ckpt")
    resumed = _trainer(model_dir, precision="bf16", distributed_optimizer=distributed_optimizer)
    assert resumed.load_checkpoint(path) == 2
    assert all(torch.equal(a, b) for a, b in zip(_params(resumed), _params(first), strict=True))
    assert all(torch.equal(a, b) for a, b in zip(_main_params(resumed), _main_params(first), strict=True))
    assert _train(resumed, range(2, 4)) == _train(first, range(2, 4))
    assert all(torch.equal(a, b) for a, b in zip(_params(resumed), _params(first), strict=True))


@pytest.mark.parametrize("impl", ["fused", "eager"])
def test_rl_logprobs_are_taken_at_the_sampling_temperature(model_dir: Path, impl: str) -> None:
    """temperature T: logprobs() and the RL step's (recomputed) proximal log-probs are log softmax(logits
    / T), so behaviour log-probs recorded at T give a zero gap; the warm start stays at T = 1."""

    def trainer(temperature: float, ppo_epochs: int = 1) -> Trainer:
        cfg = TrainerConfig(
            optim=OptimConfig(lr=1e-3), micro_batch_tokens=40, loss_impl=impl, ppo_epochs=ppo_epochs,
            temperature=temperature,
        )  # fmt: skip
        return Trainer(model_dir, cfg)

    hot = trainer(0.7)
    batch = _batch(hot.config.vocab_size, [17, 9, 23], [1.0, -1.0, 0.5])
    ours = hot.logprobs(batch)
    for lo, hi, logits in _hf_logits(model_dir, batch):
        ref = torch.log_softmax(logits / 0.7, -1).gather(-1, batch.tokens[lo + 1 : hi, None])[:, 0]
        assert float((ours[lo + 1 : hi] - ref).abs().max()) < HF_LOGPROB_ATOL
    assert float((ours - trainer(1.0).logprobs(batch)).abs().max()) > 1e-2
    sampled = _with_behaviour(batch, ours)
    gap = hot.rl_step(sampled, batch.num_action_tokens, LossConfig())["max_abs_behaviour_log_ratio"]
    assert gap < tol(1e-5)
    epochs = trainer(0.7, ppo_epochs=2).rl_step(sampled, batch.num_action_tokens, LossConfig())
    assert epochs["num_updates"] == 2 and epochs["max_abs_behaviour_log_ratio"] < tol(1e-5)
    off = trainer(1.0).rl_step(sampled, batch.num_action_tokens, LossConfig())
    assert off["max_abs_behaviour_log_ratio"] > 1e-2
    nll = -trainer(1.0).logprobs(batch)[batch.action_mask].mean()
    assert trainer(0.7).sft_step(batch)["loss"] == pytest.approx(float(nll), rel=tol(1e-5))


def test_attention_and_recompute_settings_give_the_same_rl_step(model_dir: Path) -> None:
    """The trainer's core attention ("sdpa" by default, Megatron's "unfused") and its activation
    recomputation change neither the loss nor the unclipped gradients of an RL step."""

    def trainer(attention: str, recompute: str) -> Trainer:
        optim = OptimConfig(lr=1e-3, grad_clip=0.0)
        cfg = TrainerConfig(optim=optim, micro_batch_tokens=60, attention=attention, recompute=recompute)
        return Trainer(model_dir, cfg)

    ref = trainer("unfused", "none")
    batch = _batch(ref.config.vocab_size, [20, 26, 14, 9, 11], [1.0, -0.5, 0.3, 2.0, -1.0], seed=6)
    batch = _with_behaviour(batch, ref.logprobs(batch) - 0.1)
    m_ref = ref.rl_step(batch, batch.num_action_tokens, LossConfig())
    assert float(ref.grad_buffer.abs().max()) > 0
    for attention, recompute in (("sdpa", "none"), ("sdpa", "selective"), ("sdpa", "full")):
        other = trainer(attention, recompute)
        metrics = other.rl_step(batch, batch.num_action_tokens, LossConfig())
        assert metrics["loss"] == pytest.approx(m_ref["loss"], rel=tol(1e-5)), (attention, recompute)
        assert_close(other.grad_buffer, ref.grad_buffer, rtol=1e-5, atol=1e-7)


class _PackingSender:
    """The sender surface `train.main.publish` uses: packs each unit as it comes (a copy per tensor, as
    into a send bucket) and records, per unit, the bytes of the copies the trainer converted (tensors
    that are not views of its parameters) still alive."""

    def __init__(self, live: set[int]) -> None:
        self.packed: dict[str, torch.Tensor] = {}
        self.alive_bytes: list[int] = []
        self.live = live

    def publish_stream(self, version: int, chunks: Iterator[dict[str, torch.Tensor]]) -> None:
        import weakref

        produced: list[weakref.ref[torch.Tensor]] = []
        for chunk in chunks:
            held = [t for ref in produced if (t := ref()) is not None]
            copies = [t for t in [*held, *chunk.values()] if t.untyped_storage().data_ptr() not in self.live]
            self.alive_bytes.append(sum(t.numel() * t.element_size() for t in copies))
            del copies
            del held
            produced += [weakref.ref(t) for t in chunk.values()]
            self.packed.update((n, t.detach().clone()) for n, t in chunk.items())
            del chunk


def test_tp1_publication_streams_unit_by_unit_with_no_whole_model_copy(model_dir: Path) -> None:
    """At one model-parallel rank the publication converts and hands over one unit at a time (the
    embedding, the final norm, each layer): never more than one unit of converted tensors alive, and
    what it publishes is bit-identical to the trainer's weights after the step."""
    from rollart_hpc.train.main import publish

    trainer = _trainer(model_dir)
    trainer.sft_step(_batch(trainer.config.vocab_size, [15, 21], [0.0, 0.0]))
    live = {p.untyped_storage().data_ptr() for p in trainer.gpt.parameters()}
    sender = _PackingSender(live)
    publish(trainer, sender, 1)  # type: ignore[arg-type]
    expected = trainer.hf_state_dict()
    model_bytes = sum(t.numel() * t.element_size() for t in expected.values())
    assert len(sender.alive_bytes) == trainer.config.num_layers + 2
    copied = [
        sum(t.numel() * t.element_size() for t in unit.values() if t.untyped_storage().data_ptr() not in live)
        for unit in trainer.hf_units()
    ]
    assert sender.alive_bytes == copied  # only the unit at hand is alive
    assert 0 < max(copied) < model_bytes / 2
    assert list(sender.packed) == list(expected)
    for name, tensor in expected.items():
        assert torch.equal(sender.packed[name].view(torch.uint8), tensor.view(torch.uint8)), name


def _optimizer_states(trainer: Trainer) -> list[torch.Tensor]:
    return [
        t for inner in parallel.torch_optimizers(trainer.optimizer) for state in inner.state.values()
        for t in state.values()
    ]  # fmt: skip


def test_background_checkpoint_equals_a_synchronous_one_and_does_not_block_the_step(
    model_dir: Path, tmp_path: Path
) -> None:
    from rollart_hpc.train import checkpoint

    trainer = _trainer(model_dir)
    _train(trainer, range(2))
    sync = trainer.save_checkpoint(tmp_path / "sync")
    gate = tmp_path / "release-writer"
    pending = trainer.start_checkpoint(tmp_path / "async", gate=gate)
    _train(trainer, range(2, 3))  # a step while the writer waits for the gate: it was not blocked
    assert not pending.written and not pending.finish(blocking=False)
    assert not checkpoint.is_complete(tmp_path / "async") and (tmp_path / ".async.tmp").is_dir()
    gate.touch()
    assert pending.finish(blocking=True) and checkpoint.checkpoint_step(tmp_path / "async") == 2
    assert pending.nbytes > 0 and not (tmp_path / ".async.tmp").exists()
    loaded = [_trainer(model_dir) for _ in range(2)]
    assert loaded[0].load_checkpoint(sync) == loaded[1].load_checkpoint(tmp_path / "async") == 2
    assert all(torch.equal(a, b) for a, b in zip(_params(loaded[0]), _params(loaded[1]), strict=True))
    states = [_optimizer_states(t) for t in loaded]
    assert len(states[0]) > 0
    assert all(torch.equal(a, b) for a, b in zip(*states, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(_params(trainer), _params(loaded[1]), strict=True))
