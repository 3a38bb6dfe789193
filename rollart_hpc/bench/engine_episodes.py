"""`bench engine --episodes N`: multi-turn household episodes through the built-in engine, with and
without its prefix cache, side by side.

Each repetition plays the same `N` household games (TextWorld, numbered actions) at once through the
real agent loop (`run_episode`: every turn re-sends the episode so far) against one engine with
`prefix_cache_slots = N` and one with none, alternating which goes first. Replies are greedy, so both
engines see the same episodes (up to near-ties: a reused prefix was computed by decode steps, which
round differently from one prefill; the JSON reports how many turns agree). Reported per engine:
prefill tokens computed, prompt tokens reused from the cache, generated tokens, wall time and
generated tokens/s; and their ratios.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path
from typing import Any


def _play(engine: Any, tasks: list[Any], family: Any, chat: Any, max_len: int, tag: str) -> dict[str, Any]:
    from rollart_hpc.inference.async_engine import AsyncEngine
    from rollart_hpc.tasks.agent_loop import AgentConfig, new_trajectory, run_episode
    from rollart_hpc.tasks.demos import LocalAsyncEnv

    cfg = AgentConfig(max_context_tokens=max_len, max_new_tokens=24, temperature=0.0)

    async def play_all() -> list[Any]:
        client = AsyncEngine(engine)
        envs = [LocalAsyncEnv(family.make_env()) for _ in tasks]
        try:
            return await asyncio.gather(
                *(
                    run_episode(task, env, client, chat, cfg, new_trajectory(task, f"{tag}-{i}"))
                    for i, (task, env) in enumerate(zip(tasks, envs, strict=True))
                )
            )
        finally:
            client.close()
            for env in envs:
                env.env.close()

    before = dict(engine.prefix_stats())
    start = time.perf_counter()
    trajectories = asyncio.run(play_all())
    wall = time.perf_counter() - start
    after = engine.prefix_stats()
    delta = {k: after[k] - before[k] for k in ("prefill_tokens", "decode_tokens", "tokens_reused", "hits")}
    generated = sum(sum(t.action_mask) for t in trajectories)
    return {
        "wall_s": wall,
        "generated_tokens": generated,
        "generated_tok_s": generated / wall,
        "turns": sum(t.num_turns for t in trajectories),
        "failed": sum(t.status != "ok" for t in trajectories),
        "actions": [t.actions for t in trajectories],
        **delta,
    }


def bench_episodes(model_dir: Path, num: int, repeats: int, dtype: str, max_len: int) -> dict[str, Any]:
    """Play `num` household games `repeats` times with and without the prefix cache."""
    import torch
    from transformers import AutoTokenizer

    from rollart_hpc.inference.engine import LLMEngine
    from rollart_hpc.tasks.chat import ChatTokens
    from rollart_hpc.tasks.registry import make_family

    family = make_family("household", numbered=True)
    tasks = family.tasks()[:num]
    if len(tasks) < num:
        raise RuntimeError(f"only {len(tasks)} household games are prepared; run `launch.py envs prepare`")
    chat = ChatTokens(AutoTokenizer.from_pretrained(model_dir))

    def engine(prefix_slots: int) -> Any:
        return LLMEngine.from_pretrained(
            model_dir, num_slots=num, max_model_len=max_len, dtype=getattr(torch, dtype),
            prefix_cache_slots=prefix_slots,
        )  # fmt: skip

    engines = {"cached": engine(num), "plain": engine(0)}
    runs: dict[str, list[dict[str, Any]]] = {"cached": [], "plain": []}
    for r in range(repeats):
        order = ("cached", "plain") if r % 2 == 0 else ("plain", "cached")
        for name in order:
            runs[name].append(_play(engines[name], tasks, family, chat, max_len, f"{name}{r}"))
    agree = [
        sum(
            a == b
            for x, y in zip(c["actions"], p["actions"], strict=True)
            for a, b in zip(x, y, strict=False)
        )
        for c, p in zip(runs["cached"], runs["plain"], strict=True)
    ]
    summary = {
        name: {
            k: statistics.median(run[k] for run in rs)
            for k in (
                "wall_s",
                "generated_tokens",
                "generated_tok_s",
                "prefill_tokens",
                "tokens_reused",
                "turns",
            )
        }
        for name, rs in runs.items()
    }
    for rs in runs.values():
        for run in rs:
            del run["actions"]
    cached, plain = summary["cached"], summary["plain"]
    return {
        "episodes": num,
        "repeats": repeats,
        "cached": cached,
        "plain": plain,
        "prefill_tokens_saved_fraction": 1 - cached["prefill_tokens"] / plain["prefill_tokens"],
        "tok_s_ratio_cached_vs_plain": cached["generated_tok_s"] / plain["generated_tok_s"],
        "turns_with_same_action": agree,
        "runs": runs,
    }
