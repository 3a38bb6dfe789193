"""The memory plan: its terms against the published Megatron formulas, per-rank plans of the shipped GPU
configs, and `launch.py plan --memory` / `submit` refusing what cannot fit (in process, no torch)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from rollart_hpc.config import load_config
from rollart_hpc.contracts.errors import UsageError
from rollart_hpc.entry import cli
from rollart_hpc.models.config import config_from_dict
from rollart_hpc.plan.memory import (
    Activations,
    LayerShape,
    StageLayout,
    kv_bytes_per_token,
    layer_activation_bytes,
    model_params,
    stage_params,
    state_terms,
)
from rollart_hpc.plan.ranks import memory_plan

REPO = Path(__file__).resolve().parent.parent
QWEN7B_TOML = REPO / "configs" / "gpu_2x8_qwen7b.toml"
QWEN7B = json.loads((REPO / "configs" / "models" / "qwen2.5-7b" / "config.json").read_text())
# Qwen2.5-1.5B-Instruct's published config.json (configs/gpu_node8.toml's model), shapes only.
QWEN1_5B = {
    "model_type": "qwen2", "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
    "num_attention_heads": 12, "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True,
    "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
}  # fmt: skip
REFUSAL = re.compile(
    r"^error: memory plan: (\w+) rank (\d+) \(\w+ #\d+\) needs ([\d.]+) GB of ([\d.]+) GB GPU memory; "
    r"biggest term (\w+) ([\d.]+) GB"
)

# --- the published formulas ---------------------------------------------------------------------------

# Korthikanti et al.'s layer of a 7B GPT: h 4096, 32 heads, MLP 4h with GeLU, dropout, 2-byte activations.
GPT_7B = LayerShape(4096, 32, 32, 128, 16384, gated=False, dropout=True, rope=False)


@pytest.mark.parametrize("tp", [1, 2])
def test_activations_per_layer_are_korthikanti_table_2(tp: int) -> None:
    s, b, h, a = 2048, 2, 4096, 32

    def act(recompute: str, sp: bool) -> int:
        shape = Activations(s * b, s, 2, sequence_parallel=sp, recompute=recompute, attention="unfused")
        return layer_activation_bytes(GPT_7B, shape, tp)

    sbh = s * b * h
    assert act("none", tp > 1) * tp == sbh * 34 + 5 * a * s * s * b  # (sbh / t)(34 + 5as/h)
    assert act("selective", tp > 1) * tp == 34 * sbh  # 34 sbh / t
    assert act("full", tp > 1) * tp == 2 * sbh  # 2 sbh (the layer input), / t with SP
    # TP without sequence parallelism: sbh (10 + 24/t + 5as/(ht)), and sbh (10 + 24/t) with selective.
    assert act("none", False) * tp == sbh * (10 * tp + 24) + 5 * a * s * s * b
    assert act("selective", False) * tp == sbh * (10 * tp + 24)
    assert act("full", False) == 2 * sbh


def test_sdpa_keeps_no_scores_and_unfused_repeats_grouped_keys() -> None:
    shape = LayerShape.of(config_from_dict(QWEN7B))
    sdpa = layer_activation_bytes(shape, Activations(8192, 8192, 2, attention="sdpa"), 1)
    selective = layer_activation_bytes(shape, Activations(8192, 8192, 2, recompute="selective"), 1)
    assert sdpa - selective == 4 * 28 * 8192  # only the fp32 log-sum-exp per head and token
    unfused = layer_activation_bytes(shape, Activations(8192, 8192, 2, attention="unfused"), 1)
    scores = 6 * 28 * 8192 * 8192  # the fp32 softmax output and its bf16 cast
    # k (rotated) and v repeated from 4 to all 28 heads take the place of the rotated k, bf16
    repeated = 2 * 8192 * (2 * 28 - 4) * 128
    assert unfused - selective == scores + repeated


def _qwen7b_layer_params(tp: int) -> int:
    h, a, k, d, f = 3584, 28, 4, 128, 18944
    qkv = (a + 2 * k) * d
    return (h * qkv + qkv + a * d * h + 3 * h * f) // tp + 2 * h  # q/k/v bias split, two norms not


def test_parameters_per_rank_of_a_7b_model_at_tp2_pp2() -> None:
    cfg = config_from_dict(QWEN7B)
    vocab_h = 152064 * 3584 // 2  # vocabulary split over TP 2 (152064 is a multiple of 128)
    first = stage_params(cfg, StageLayout(tp=2, pp=2, dp=2, stage=0))
    last = stage_params(cfg, StageLayout(tp=2, pp=2, dp=2, stage=1))
    assert first == 14 * _qwen7b_layer_params(2) + vocab_h  # embedding on the first stage
    assert last == 14 * _qwen7b_layer_params(2) + 3584 + vocab_h  # final norm and LM head on the last
    assert model_params(cfg) == 7_615_616_512  # Qwen2.5-7B's parameter count
    tied = config_from_dict(QWEN1_5B)
    two = [stage_params(tied, StageLayout(1, 2, 1, i)) for i in (0, 1)]
    assert sum(two) - stage_params(tied, StageLayout(1, 1, 1, 0)) == 151936 * 1536  # tied: on both stages


@pytest.mark.parametrize("dp", [1, 2, 8])
def test_state_bytes_per_parameter_are_megatrons(dp: int) -> None:
    n = 1_000_000
    # Megatron's distributed optimizer: bf16 params + fp32 grads 6 + 12/d, fp32 8 + 8/d; without: 18, 16.
    assert sum(state_terms(n, "bf16", dp, True).values()) == n * 6 + n * 12 // dp
    assert sum(state_terms(n, "fp32", dp, True).values()) == n * 8 + n * 8 // dp
    assert sum(state_terms(n, "bf16", dp, False).values()) == 18 * n
    assert sum(state_terms(n, "fp32", dp, False).values()) == 16 * n


# --- per-rank plans of configs --------------------------------------------------------------------------


def test_first_pipeline_stage_holds_pp_micro_batches() -> None:
    plan = memory_plan(load_config(QWEN7B_TOML, ["trainer.tensor_parallel=2", "trainer.pipeline_parallel=2"]))
    trainers = [r for r in plan.ranks if r.role == "trainer"]
    first, last = trainers[0], trainers[-1]
    assert first.terms["activations"] == 2 * last.terms["activations"]
    assert "logits" in last.terms and "logits" not in first.terms
    # The first trainer's two send buckets (32 MiB), never the model; the gathered unit is `weight_gather`.
    assert first.terms["publication"] == 2 * 32 * 2**20 < 7_615_616_512 * 2 // 100


def test_publication_buffers_are_buckets_and_one_unit_not_the_model() -> None:
    plan = memory_plan(load_config(QWEN7B_TOML, ["trainer.tensor_parallel=1"]))
    first = next(r for r in plan.ranks if r.role == "trainer")
    rollout = next(r for r in plan.ranks if r.role == "rollout")
    embedding = 152064 * 3584 * 2  # the largest unit and the largest tensor, in bf16
    # TP = PP = 1: two send buckets and the converted unit at hand (the embedding) on the publisher.
    assert "weight_gather" not in first.terms
    assert first.terms["publication"] == 2 * 32 * 2**20 + embedding + 3584 * 2
    assert rollout.terms["receive_buffers"] == 2 * embedding  # a ring of two, each as large as a tensor


def test_qwen7b_rollout_ranks_report_vllm_share_and_kv_room() -> None:
    plan = memory_plan(load_config(QWEN7B_TOML))
    rollout = [r for r in plan.ranks if r.role == "rollout"]
    assert len(rollout) == 8 and all(r.limit == 80 * 10**9 and r.fits for r in rollout)
    assert rollout[0].terms["vllm"] == int(0.55 * 80e9)
    assert "KV-cache room 28.77 GB" in rollout[0].notes[0]
    assert kv_bytes_per_token(config_from_dict(QWEN7B), 2) == 28 * 2 * 4 * 128 * 2
    starved = memory_plan(load_config(QWEN7B_TOML, ["rollout.vllm.gpu_memory_utilization=0.15"]))
    line = starved.refusal()
    assert line is not None and line.startswith("memory plan: rollout rank 1 (rollout #0)")
    assert "less than one sequence's KV cache" in line


def test_builtin_engine_holds_weights_staged_copy_and_kv_rows() -> None:
    config = load_config(
        REPO / "configs" / "tiny.toml", ["rollout.num_slots=8", "rollout.prefix_cache_slots=4"]
    )
    plan = memory_plan(config)
    m, r = plan.model, config.rollout
    (rank,) = [x for x in plan.ranks if x.role == "rollout"]
    assert rank.terms["kv_cache"] == 12 * r.max_model_len * m.num_layers * 2 * m.num_kv_heads * m.head_dim * 4
    assert rank.terms["weights"] == rank.terms["staged_weights"] == model_params(m) * 4
    assert all(x.limit is None and x.fits for x in plan.ranks)  # no GPU: reported, never refused


def _write_model(tmp_path: Path, raw: dict[str, object]) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(raw))
    return folder


def test_gpu_node8_fits_and_a_larger_plan_does_not(tmp_path: Path) -> None:
    model = f"model.path={_write_model(tmp_path, QWEN1_5B)}"
    node8 = REPO / "configs" / "gpu_node8.toml"
    assert memory_plan(load_config(node8, [model])).fits
    fp32 = memory_plan(load_config(node8, [model, "trainer.precision=fp32"])).refusal()
    assert fp32 is not None and fp32.startswith("memory plan: trainer rank 8 (trainer #0)")
    old_micro = memory_plan(load_config(node8, [model, "trainer.micro_batch_tokens=32768"])).refusal()
    assert old_micro is not None and old_micro.startswith("memory plan: trainer rank 8 (trainer #0)")
    big_share = memory_plan(load_config(node8, [model, "rollout.vllm.gpu_memory_utilization=0.98"])).refusal()
    assert big_share is not None and big_share.startswith("memory plan: rollout rank 1 (rollout #0)")


def test_gpu_memory_comes_from_the_role_or_a_known_gpu_type_else_nothing_is_refused() -> None:
    huge = ["trainer.micro_batch_tokens=1000000"]
    assert memory_plan(load_config(QWEN7B_TOML, huge)).refusal() is not None  # h100: 80 GB
    unknown = ["roles.trainer.gpu_type=x100", "roles.rollout.gpu_type=x100", *huge]
    plan = memory_plan(load_config(QWEN7B_TOML, unknown))
    assert plan.fits and all(r.limit is None for r in plan.ranks)
    sized = memory_plan(load_config(QWEN7B_TOML, ["roles.trainer.gpu_memory_gb=141"]))
    assert {r.limit for r in sized.ranks if r.role == "trainer"} == {141 * 10**9}
    with pytest.raises(UsageError, match=r"^roles\.env\.gpu_memory_gb: must be >= 0, and 0 when"):
        load_config(QWEN7B_TOML, ["roles.env.gpu_memory_gb=80"])


# --- the command line -----------------------------------------------------------------------------------


def test_plan_memory_of_the_qwen7b_config_fits(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    assert cli.main(["plan", str(QWEN7B_TOML), "--memory", "--json", str(out)]) == 0
    stdout = capsys.readouterr().out
    assert "memory plan (GB = 1e9 bytes, per GPU): qwen2, 7,615.6M parameters" in stdout
    plan = json.loads(out.read_text())
    assert plan["fits"] and plan["refusal"] is None and len(plan["ranks"]) == 20
    gpu = [r for r in plan["ranks"] if r["role"] in ("trainer", "rollout")]
    assert len(gpu) == 16 and all(r["limit_bytes"] == 80 * 10**9 >= r["total_bytes"] for r in gpu)
    assert all(r["limit_bytes"] is None for r in plan["ranks"] if r["role"] not in ("trainer", "rollout"))


def test_plan_memory_refuses_tp1_pp1_without_recompute_in_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    overrides = ["trainer.tensor_parallel=1", "trainer.pipeline_parallel=1", "trainer.recompute=none"]
    assert cli.main(["plan", str(QWEN7B_TOML), "--memory", *overrides]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    match = REFUSAL.match(err[0])
    assert match is not None, err[0]
    role, rank, total, limit, term, size = match.groups()
    assert (role, rank, limit, term) == ("trainer", "12", "80.00", "activations")
    assert float(total) > 80 and float(size) > 40


def test_submit_refuses_before_anything_is_submitted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    argv = ["submit", str(QWEN7B_TOML), "trainer.tensor_parallel=1", "--run-dir", str(run_dir)]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and REFUSAL.match(err[0]), err
    assert not run_dir.exists()
    assert cli.main([*argv, "--dry-run"]) == 2  # the job and its plan are shown, then refused
    shown = capsys.readouterr()
    assert "#SBATCH hetjob" in shown.out and "#     12  trainer rank 12 (trainer #0)" in shown.out
    assert REFUSAL.match(shown.err.strip())


def test_submit_dry_run_prints_the_memory_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["submit", str(QWEN7B_TOML), "--dry-run", "--run-dir", str(tmp_path / "r")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("#!/bin/bash") and "# memory plan (GB = 1e9 bytes, per GPU)" in out
    assert "# memory plan not computed" not in out


def test_plan_memory_without_model_shapes_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["plan", str(QWEN7B_TOML), "--memory", "model.path=/nonexistent/model"]) == 2
    assert "model.path: no model shapes for the memory plan" in capsys.readouterr().err


def test_each_rollout_pool_is_planned_with_its_own_gpu_and_slots() -> None:
    config = load_config(REPO / "configs" / "gpu_2pools.toml", ["model.source=tiny", 'model.path=""'])
    rollout = [r for r in memory_plan(config).ranks if r.role == "rollout"]
    assert [r.limit for r in rollout] == [80 * 10**9] * 8 + [96 * 10**9] * 8  # h800, then h20
    assert "(num_slots 64;" in rollout[0].notes[0] and "(num_slots 192;" in rollout[-1].notes[0]
