"""GPU check of the vLLM rollout engine, run by scripts/gpu_vllm_check.sh under `mpiexec -n 2`.

Rank 0 is a trainer: it holds the model's weights on its GPU and publishes version 1 (the weights
perturbed) through the real path, `WeightPublisher` over a standalone NCCL group (gloo when the machine
has one GPU: NCCL cannot put two ranks on one device). Rank 1 is a rollout rank: it serves a
`VLLMEngine` (TP=1), receives the version with `WeightReceiver` while long requests are running, and
lands it bucket by bucket with `engine.begin_weights` (pause -> load each bucket -> version -> resume).

Measured and written to OUT/gpu_vllm_check.json (by rank 1, with the trainer's numbers merged in):
engine start, greedy generation throughput, the receive and load times of the update against a raw
broadcast of the same number of bytes on the same group, the per-token version switch of requests in
flight, and parity of the engine after the update with a fresh engine started on the new checkpoint.

MPI is imported inside main() only: vLLM starts its engine core with `spawn`, which re-imports this
module, and an MPI initialisation there would hang.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

TAG = 9301
QWEN2_05B_SHAPE = {
    "vocab_size": 151936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "eos_token_id": 151645,
    "bos_token_id": None,
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", type=Path, default=None, help="HF dir of a 0.5-1.5B Qwen2/Llama model")
    p.add_argument("--gpus", type=int, required=True, help="GPUs on this machine (nvidia-smi -L)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--eager", action="store_true", help="no CUDA graphs (faster start)")
    p.add_argument("--timeout-s", type=float, default=300.0)
    return p.parse_args()


def bind_gpu(rank: int, gpus: int) -> str:
    """Trainer on GPU 0, rollout on GPU 1 (NCCL); with one GPU both share it and the group uses gloo."""
    if gpus >= 2:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(rank)
        return "nccl"
    os.environ["CUDA_VISIBLE_DEVICES"] = "0"
    return "gloo"


def make_random_qwen2(out: Path) -> Path:
    """A random-initialised Qwen2-0.5B-shaped bf16 checkpoint (no tokenizer: the engine skips it)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen2Config

    config = Qwen2Config(**QWEN2_05B_SHAPE)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.generation_config = GenerationConfig(eos_token_id=QWEN2_05B_SHAPE["eos_token_id"])
    model.save_pretrained(out, safe_serialization=True)
    return out


def perturbed(named: dict[str, Any], seed: int) -> dict[str, Any]:
    """Version 1: every tensor plus 5 % of its own scale in Gaussian noise (same names, shapes, dtypes)."""
    import torch

    gen = torch.Generator(device="cuda").manual_seed(seed)
    out = {}
    for name, t in named.items():
        noise = torch.randn(t.shape, generator=gen, device=t.device, dtype=torch.float32)
        out[name] = (t.float() + 0.05 * t.float().std() * noise).to(t.dtype)
    return out


def save_checkpoint(named: dict[str, Any], like: Path, out: Path) -> Path:
    """`named` as model.safetensors beside a copy of `like`'s config files."""
    import shutil

    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        if (like / name).is_file():
            shutil.copy(like / name, out / name)
    save_file({n: t.detach().cpu().contiguous() for n, t in named.items()}, str(out / "model.safetensors"))
    return out


def prompts(num: int, vocab: int) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(1)
    return [
        torch.randint(100, min(vocab, 30000), (int(n),), generator=gen).tolist() for n in range(32, 32 + num)
    ]


def generate(engine: Any, batch: list[list[int]], sampling: Any, tag: str) -> tuple[dict[str, Any], float]:
    start = time.perf_counter()
    for i, p in enumerate(batch):
        engine.add_request(f"{tag}-{i}", p, sampling)
    done: dict[str, Any] = {}
    while engine.has_unfinished():
        for out in engine.step():
            done[out.request_id] = out
    return done, time.perf_counter() - start


def timed_raw_broadcast(group: Any, nbytes: int, device: str, repeats: int = 3) -> list[float]:
    """The same number of bytes as one version, as one flat tensor, broadcast `repeats` times."""
    import torch

    flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        group.broadcast(flat, 0, "raw broadcast")
        if device != "cpu":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def trainer(world: Any, args: argparse.Namespace, backend: str, model_dir: Path) -> dict[str, Any]:
    import torch

    from rollart_hpc.models.checkpoint import load_weights
    from rollart_hpc.weights.buckets import layout_for
    from rollart_hpc.weights.group import make_standalone_group
    from rollart_hpc.weights.publisher import WeightPublisher

    named = {n: t.cuda() for n, t in load_weights(model_dir).items()}
    new = perturbed(named, seed=1)
    v1_dir = save_checkpoint(new, model_dir, args.out / "model-v1")
    world.send(str(v1_dir), 1, TAG)
    group = make_standalone_group(world, [0, 1], backend, args.timeout_s)  # type: ignore[arg-type]
    pub = WeightPublisher(group, layout_for(new.items(), 256 << 20))
    world.recv(1, TAG, timeout_s=args.timeout_s)  # the rollout rank has requests in flight
    start = time.perf_counter()
    pub.publish(1, new)
    publish_s = time.perf_counter() - start
    pub.wait()
    delivered_s = time.perf_counter() - start
    raw = timed_raw_broadcast(group, pub.layout.total_nbytes, "cuda" if backend == "nccl" else "cpu")
    world.recv(1, TAG, timeout_s=3 * args.timeout_s)
    group.close()
    return {
        "publish_return_s": publish_s,
        "publish_delivered_s": delivered_s,
        "num_buckets": pub.layout.num_buckets,
        "raw_broadcast_s_sender": raw,
        "num_tensors": len(new),
        "gpu": torch.cuda.get_device_name(),
    }


def start_engine(model_dir: Path, args: argparse.Namespace, has_tokenizer: bool, share: float) -> Any:
    from rollart_hpc.inference.vllm_engine import VLLMEngine, VLLMSettings

    extra = {"gpu_memory_utilization": share, "skip_tokenizer_init": not has_tokenizer}
    settings = VLLMSettings(
        num_slots=args.num_prompts,
        max_model_len=2048,
        dtype="bfloat16",
        enforce_eager=args.eager,
        ignore_eos=True,
        engine_kwargs=extra,
    )
    return VLLMEngine(model_dir, settings)


def rollout(world: Any, args: argparse.Namespace, backend: str, model_dir: Path) -> dict[str, Any]:
    from rollart_hpc.contracts.generation import SamplingParams
    from rollart_hpc.weights.group import make_standalone_group
    from rollart_hpc.weights.publisher import WeightReceiver

    v1_dir = Path(world.recv(0, TAG, timeout_s=args.timeout_s))
    group = make_standalone_group(world, [0, 1], backend, args.timeout_s)  # type: ignore[arg-type]
    receiver = WeightReceiver(group, 0)
    has_tok = (model_dir / "tokenizer.json").is_file()
    share = 0.6 if backend == "nccl" else 0.45
    res: dict[str, Any] = {"backend": backend, "model": str(model_dir), "bytes": receiver.layout.total_nbytes}
    start = time.perf_counter()
    engine = start_engine(model_dir, args, has_tok, share)
    res["engine_start_s"] = time.perf_counter() - start
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    batch = prompts(args.num_prompts, 151936)
    generate(engine, batch[:4], greedy, "warmup")
    v0, gen_s = generate(engine, batch, greedy, "v0")
    res["generate_v0"] = {"s": gen_s, "tok_per_s": len(batch) * args.max_tokens / gen_s}
    res["update"] = update_in_flight(world, engine, receiver, batch, greedy.max_tokens * 4)
    res["raw_broadcast_s"] = timed_raw_broadcast(group, receiver.layout.total_nbytes, receiver.device.type)
    after, _ = generate(engine, batch, greedy, "v1")
    engine.close()
    fresh = start_engine(v1_dir, args, has_tok, share)
    ref, _ = generate(fresh, batch, greedy, "v1")
    fresh.close()
    res["parity"] = parity(after, ref)
    res["changed_by_update"] = sum(
        v0[f"v0-{i}"].token_ids != after[f"v1-{i}"].token_ids for i in range(len(batch))
    )
    world.send("done", 0, TAG)
    group.close()
    return res


def update_in_flight(
    world: Any, engine: Any, receiver: Any, batch: list[list[int]], max_tokens: int
) -> dict[str, Any]:
    """Receive and load version 1 while long requests run; report timings and their version spans."""
    from rollart_hpc.contracts.generation import SamplingParams

    long = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    for i, p in enumerate(batch[:16]):
        engine.add_request(f"long-{i}", p, long)
    time.sleep(0.5)
    world.send("go", 0, TAG)
    start = time.perf_counter()
    landing = engine.begin_weights(1)
    version = receiver.receive(landing.land)
    received = time.perf_counter()
    landing.commit()
    loaded = time.perf_counter()
    outs: dict[str, Any] = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id] = out
    switched = [o for o in outs.values() if len(set(o.versions)) == 2]
    return {
        "version": version,
        "receive_s": received - start,
        "update_weights_s": loaded - received,
        "total_s": loaded - start,
        "requests_in_flight": len(outs),
        "requests_switched": len(switched),
        "versions_monotonic": all(o.versions == sorted(o.versions) for o in outs.values()),
    }


def parity(after: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    """Greedy outputs of the updated engine against a fresh engine on the new checkpoint."""
    equal = sum(after[rid].token_ids == ref[rid].token_ids for rid in ref)
    first_lp = [abs(after[rid].logprobs[0] - ref[rid].logprobs[0]) for rid in ref]
    versions_ok = all(set(after[rid].versions) == {1} for rid in ref)
    return {
        "requests": len(ref),
        "identical_outputs": equal,
        "max_abs_first_logprob_diff": max(first_lp),
        "versions_all_1": versions_ok,
    }


def main() -> None:
    args = parse_args()
    from rollart_hpc.cluster.env import read_process_env

    env = read_process_env()
    rank = env.launcher_rank or 0
    backend = bind_gpu(rank, args.gpus)
    from rollart_hpc.cluster.plan import RoleRange, RunPlan
    from rollart_hpc.cluster.world import make_world

    world = make_world(RunPlan((RoleRange("trainer", 0, 1, ""), RoleRange("rollout", 1, 1, ""))), env, 600.0)
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = args.model if args.model is not None and args.model.is_dir() else None
    if rank == 0:
        if model_dir is None:
            model_dir = make_random_qwen2(args.out / "model-v0")
        world.send(str(model_dir), 1, TAG)
        result = trainer(world, args, backend, model_dir)
        world.send(result, 1, TAG)
        return
    model_dir = Path(world.recv(0, TAG, timeout_s=args.timeout_s))
    result = rollout(world, args, backend, model_dir)
    result["trainer"] = world.recv(0, TAG, timeout_s=args.timeout_s)
    result["random_weights"] = args.model is None or not args.model.is_dir()
    raw = statistics.median(result["raw_broadcast_s"])
    result["update_vs_raw"] = {
        "raw_median_s": raw,
        "raw_GBps": result["bytes"] / raw / 1e9,
        "receive_over_raw": result["update"]["receive_s"] / raw,
        "total_over_raw": result["update"]["total_s"] / raw,
    }
    (args.out / "gpu_vllm_check.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
