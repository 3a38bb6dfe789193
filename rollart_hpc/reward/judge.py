"""Model-based reward: an LLM judge that scores a trajectory with a rubric prompt, served by the built-in
continuous-batching engine inside the reward service.

Dataflow: the service routes a request of a judge family (`reward.judge_families`) to `Judge.score`,
which renders the rubric (`judge_prompt`: the task text, the agent's actions, the env's outcome) with
the judge tokenizer's chat template, starts the judge's reply with "SCORE:" (a prefill, so that small
models answer in the grammar) and awaits one line (stop at a newline) on the shared `AsyncEngine`. Every
client's judge requests go into that one engine, whose thread admits them into free slots and decodes
them together (continuous batching), so requests from several runs share each forward pass.
The answer is parsed by `parse_score` (grammar below). When it cannot be parsed (or the engine ended
the request with an error, e.g. a prompt over the context limit), the reward is the family's
rule-based reward (`functions.REWARD_FNS`; 0.0 for a family without one): deterministic, counted in
`fallbacks`, and marked `fallback` in the reply. An engine that crashed raises: the service retries the
call and then fails the request (reward_error), never guesses.
A judged trajectory's success is score >= SUCCESS_THRESHOLD (0.5).
Determinism: `judge_temperature = 0` is greedy; above 0 each request samples with a seed derived from
its input, so the same request gets the same answer in the same batch shape.
Who waits on whom: callers await futures; the engine thread steps while any request is in the engine.
Invariant: each call of `score` ends with exactly one `JudgeResult` (judged or fallback) or raises.

Answer grammar (the last non-empty line of the answer, surrounding spaces ignored, case-sensitive):
    SCORE: <n>        with <n> an integer 0..10, read as n/10 (what the rubric asks for)
    SCORE: <n>/10     the same
    SCORE: <d>        with <d> a decimal with a point in [0, 1]: 0.8, .5, 1.0
Anything else (no such line, a value out of bounds, two numbers) is unparsable.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollart_hpc.reward.functions import REWARD_FNS, RewardInput, RewardOutput

_SCORE_LINE = re.compile(r"SCORE:\s*(?:(?P<dec>\d*\.\d+)|(?P<num>\d{1,2})(?:\s*/\s*10)?)")
MAX_ACTION_CHARS = 1500
SUCCESS_THRESHOLD = 0.5

RUBRIC = (
    "You are a strict grader. Judge whether the agent solved the task.\n"
    "Task: {task}\n"
    "Agent's actions (oldest first):\n{actions}\n"
    "Environment outcome: return {env_return:g}, {won}.\n"
    "Grade from 0 (wrong) to 10 (correct and complete), in between for partial credit. "
    "Reply with one line of the form 'SCORE: <integer from 0 to 10>'."
)
PREFILL = "SCORE:"


def parse_score(answer: str) -> float | None:
    """The score in [0, 1] of a judge's answer, or None when it does not follow the grammar."""
    lines = [line.strip() for line in answer.strip().splitlines() if line.strip()]
    if not lines:
        return None
    match = _SCORE_LINE.fullmatch(lines[-1])
    if match is None:
        return None
    if match["num"] is not None:
        num = int(match["num"])
        return num / 10 if num <= 10 else None
    value = float(match["dec"])
    return value if 0.0 <= value <= 1.0 else None


def task_text(inp: RewardInput) -> str:
    """The task statement the agent saw when the family can rebuild it from the task id, else the id."""
    if inp.family == "calc_math":
        from rollart_hpc.tasks.families.calc_math import generate_problem, parse_task_id

        try:
            return generate_problem(parse_task_id(inp.task_id)).text
        except KeyError:
            pass
    return f"{inp.family} task {inp.task_id}"


def judge_prompt(inp: RewardInput) -> str:
    """The rubric prompt over one trajectory (actions cut to their last MAX_ACTION_CHARS characters)."""
    actions = "\n".join(f"- {a}" for a in inp.actions) or "(none)"
    if len(actions) > MAX_ACTION_CHARS:
        actions = "..." + actions[-MAX_ACTION_CHARS:]
    won = "the env reports a win" if inp.env_won else "the env reports no win"
    return RUBRIC.format(task=task_text(inp), actions=actions, env_return=inp.env_return, won=won)


def fallback_reward(inp: RewardInput) -> RewardOutput:
    """The deterministic reward of an unparsable answer: the family's rule-based reward, else 0."""
    fn = REWARD_FNS.get(inp.family)
    if fn is None:
        return RewardOutput(0.0, False)
    out = fn(inp)
    assert isinstance(out, RewardOutput), "rule-based reward functions are synchronous"
    return out


@dataclass(frozen=True)
class JudgeResult:
    output: RewardOutput
    answer: str
    fallback: bool


class _CountingEngine:
    """Wraps an `Engine`; records how many requests were in it at each step (the batch it could form)."""

    def __init__(self, engine: Any, num_slots: int) -> None:
        self.engine, self.num_slots = engine, num_slots
        self.in_engine, self.steps, self.peak_batch, self.batched_requests = 0, 0, 0, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def add_request(self, request_id: str, prompt: list[int], sampling: Any) -> None:
        self.engine.add_request(request_id, prompt, sampling)
        self.in_engine += 1

    def step(self) -> list[Any]:
        batch = min(self.in_engine, self.num_slots)
        outs: list[Any] = self.engine.step()
        self.steps += 1
        self.batched_requests += batch
        self.peak_batch = max(self.peak_batch, batch)
        self.in_engine -= sum(1 for o in outs if o.finished)
        return outs


class Judge:
    """One judge engine (built-in, greedy or seeded sampling) shared by every request of the service."""

    def __init__(
        self,
        engine: Any,
        tokenizer: Any,
        families: Iterable[str],
        max_new_tokens: int,
        temperature: float,
        num_slots: int,
    ) -> None:
        """`engine` satisfies `rollart_hpc.inference.api.Engine`; `tokenizer` has a chat template."""
        from rollart_hpc.inference.async_engine import AsyncEngine

        self.tokenizer = tokenizer
        self.families = frozenset(families)
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        self.counted = _CountingEngine(engine, num_slots)
        self.engine = AsyncEngine(self.counted)  # type: ignore[arg-type]
        self._ids = 0
        self.judged = self.fallbacks = 0

    @classmethod
    def load(
        cls,
        model_dir: Path,
        families: Iterable[str],
        max_new_tokens: int,
        temperature: float,
        num_slots: int,
        seed: int = 0,
    ) -> Judge:
        """A judge on the built-in engine over an HF model dir (context: the model's, at most 2048)."""
        from rollart_hpc.inference.engine import LLMEngine
        from rollart_hpc.models.config import load_config

        max_len = min(2048, load_config(model_dir).max_position_embeddings)
        engine = LLMEngine.from_pretrained(model_dir, num_slots=num_slots, max_model_len=max_len, seed=seed)
        if engine.tokenizer is None:
            raise ValueError(f"judge model {model_dir} has no tokenizer")
        return cls(engine, engine.tokenizer, families, max_new_tokens, temperature, num_slots)

    def prompt_ids(self, inp: RewardInput) -> list[int]:
        messages = [{"role": "user", "content": judge_prompt(inp)}]
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return [int(i) for i in self.tokenizer.encode(text + PREFILL, add_special_tokens=False)]

    async def score(self, inp: RewardInput) -> JudgeResult:
        from rollart_hpc.contracts.generation import SamplingParams

        seed = None
        if self.temperature > 0:
            seed = int(hashlib.sha256(repr(inp).encode()).hexdigest()[:8], 16)
        sampling = SamplingParams(
            temperature=self.temperature, max_tokens=self.max_new_tokens, seed=seed, stop=("\n",)
        )
        self._ids += 1
        out = await self.engine.generate(f"judge-{self._ids}", self.prompt_ids(inp), sampling)
        if out.finish_reason == "abort":
            raise RuntimeError("judge request aborted")
        answer = PREFILL + out.text if out.finish_reason != "error" else f"engine error: {out.error}"
        score = parse_score(answer)
        self.judged += 1
        if score is None:
            self.fallbacks += 1
            return JudgeResult(fallback_reward(inp), answer, True)
        return JudgeResult(RewardOutput(score, score >= SUCCESS_THRESHOLD), answer, False)

    def stats(self) -> dict[str, Any]:
        c = self.counted
        return {
            "judged": self.judged,
            "fallbacks": self.fallbacks,
            "steps": c.steps,
            "peak_batch": c.peak_batch,
            "mean_batch": c.batched_requests / c.steps if c.steps else 0.0,
        }

    def close(self) -> None:
        self.engine.close()
