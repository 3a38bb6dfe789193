"""The agent loop: token layout, action mask, versions, end causes, and oracle demonstrations."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from rollart_hpc.contracts.generation import RequestOutput, SamplingParams
from rollart_hpc.contracts.records import Trajectory
from rollart_hpc.tasks.agent_loop import AgentConfig, new_trajectory, run_episode
from rollart_hpc.tasks.chat import ChatTokens
from rollart_hpc.tasks.demos import LocalAsyncEnv, ScriptedClient, demonstration_trajectory
from rollart_hpc.tasks.families import calc_math
from rollart_hpc.tasks.registry import make_family


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from rollart_hpc.models.tiny import make_tiny_tokenizer

    return make_tiny_tokenizer()


def _run(tokenizer: Any, family: str, tid: str, client: Any, cfg: AgentConfig | None = None) -> Trajectory:
    fam = make_family(family)
    task = fam.task(tid)
    traj = new_trajectory(task, f"{tid}#0", {"dispatch_version": 3})
    coro = run_episode(
        task, LocalAsyncEnv(fam.make_env()), client, ChatTokens(tokenizer), cfg or AgentConfig(), traj
    )
    return asyncio.run(coro)


def _segments(traj: Trajectory, value: int) -> list[list[int]]:
    runs: list[list[int]] = []
    prev = None
    for tok, m in zip(traj.token_ids, traj.action_mask, strict=True):
        if m == value:
            if prev != value:
                runs.append([])
            runs[-1].append(tok)
        prev = m
    return runs


def test_mask_marks_exactly_the_generated_text(tokenizer: Any) -> None:
    texts = ["hmm <calc>2+2</calc>", "<calc>(4)*3</calc>", "<answer>12</answer>"]
    chat = ChatTokens(tokenizer)
    moves = make_family("frozenlake").oracle("frozenlake/4x4")
    traj = _run(tokenizer, "frozenlake", "frozenlake/4x4", ScriptedClient(chat, moves, 5))
    traj.validate()
    assert (traj.status, traj.finish_cause, traj.num_turns, traj.env_won) == ("ok", "done", len(moves), True)
    generated = _segments(traj, 1)
    assert [tokenizer.decode(seg, skip_special_tokens=True) for seg in generated] == moves
    traj2 = _run(tokenizer, "calc_math", "calc_math/0000", ScriptedClient(chat, texts, 5))
    traj2.validate()
    gen2 = _segments(traj2, 1)
    assert [tokenizer.decode(s, skip_special_tokens=True) for s in gen2] == texts
    assert traj2.actions == texts and traj2.finish_cause == "done" and traj2.num_turns == 3
    observations = "".join(tokenizer.decode(s, skip_special_tokens=False) for s in _segments(traj2, 0))
    assert "= 4" in observations and "= 12" in observations
    assert "= 4" not in tokenizer.decode(sum(gen2, []), skip_special_tokens=False)
    assert all(v == 5 for v, m in zip(traj2.versions, traj2.action_mask, strict=True) if m)
    assert traj2.dispatch == {"dispatch_version": 3}


def test_tokens_equal_the_rendered_conversation(tokenizer: Any) -> None:
    chat = ChatTokens(tokenizer)
    fam = make_family("calc_math")
    texts = ["<calc>1+1</calc>", "<answer>2</answer>"]
    traj = _run(tokenizer, "calc_math", "calc_math/0001", ScriptedClient(chat, texts))
    task = fam.task("calc_math/0001")
    messages = [
        {"role": "system", "content": task.system},
        {"role": "user", "content": task.prompt},
        {"role": "assistant", "content": texts[0]},
        {"role": "user", "content": "= 2"},
    ]
    rendered = chat.render(messages, generation_prompt=True) + texts[1] + "<|im_end|>"
    assert tokenizer.decode(traj.token_ids, skip_special_tokens=False) == rendered
    assert traj.prompt_len == len(chat.prompt_ids(messages[:2]))


class _NoStopClient:
    """Never emits a stop token (finish reason "length")."""

    def __init__(self, chat: ChatTokens, text: str) -> None:
        self.chat, self.text = chat, text

    async def generate(self, request_id: str, prompt: list[int], sampling: SamplingParams) -> RequestOutput:
        ids = self.chat.encode(self.text)[: sampling.max_tokens]
        n = len(ids)
        return RequestOutput(request_id, prompt, ids, [-0.5] * n, [1] * n, self.text, True, "length")

    async def abort(self, request_id: str) -> None:
        return None


def test_turn_without_stop_token_is_closed_by_template(tokenizer: Any) -> None:
    chat = ChatTokens(tokenizer)
    traj = _run(tokenizer, "frozenlake", "frozenlake/4x4", _NoStopClient(chat, "up"))
    traj.validate()
    assert (
        traj.finish_cause == "max_turns"
        and traj.num_turns == make_family("frozenlake").task("frozenlake/4x4").max_turns
    )
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert all(m == 0 for t, m in zip(traj.token_ids, traj.action_mask, strict=True) if t == eos)
    assert all(lp == -0.5 for lp, m in zip(traj.logprobs, traj.action_mask, strict=True) if m)


def test_context_limit_stops_before_overflow(tokenizer: Any) -> None:
    chat = ChatTokens(tokenizer)
    cfg = AgentConfig(max_context_tokens=150, max_new_tokens=16)
    traj = _run(tokenizer, "frozenlake", "frozenlake/8x8", ScriptedClient(chat, ["left"] * 30), cfg)
    traj.validate()
    assert traj.status == "ok" and traj.finish_cause == "context_limit"
    assert len(traj.token_ids) <= 150 and traj.num_turns >= 1


class _ErrorClient:
    async def generate(self, request_id: str, prompt: list[int], sampling: SamplingParams) -> RequestOutput:
        return RequestOutput(request_id, prompt, finished=True, finish_reason="error", error="engine died")

    async def abort(self, request_id: str) -> None:
        return None


def test_llm_error_fails_the_trajectory(tokenizer: Any) -> None:
    traj = _run(tokenizer, "calc_math", "calc_math/0003", _ErrorClient())
    traj.validate()
    assert (traj.status, traj.failure_cause, traj.error) == ("failed", "llm_error", "engine died")
    assert traj.num_action_tokens == 0 and traj.oldest_version() == -1


def test_demonstration_trajectory_wins(tokenizer: Any) -> None:
    fam = make_family("calc_math")
    task = fam.task("calc_math/0011")
    traj = demonstration_trajectory(fam, task, tokenizer, AgentConfig())
    traj.validate()
    assert traj.env_won and traj.finish_cause == "done"
    assert traj.actions == fam.oracle(task.id)
    problem = calc_math.generate_problem(11)
    assert traj.actions[-1] == f"<answer>{problem.answer}</answer>"


class _StopStringClient:
    """Generates `texts` in turn, cut after the first of `sampling.stop` (kept), as the engines do."""

    def __init__(self, chat: ChatTokens, texts: list[str]) -> None:
        self.chat, self.texts, self.stops_seen = chat, list(texts), []

    async def generate(self, request_id: str, prompt: list[int], sampling: SamplingParams) -> RequestOutput:
        self.stops_seen.append(sampling.stop)
        text = self.texts.pop(0)
        hits = [text.find(s) + len(s) for s in sampling.stop if s in text]
        text = text[: min(hits)] if hits else text
        ids = self.chat.encode(text)
        n = len(ids)
        return RequestOutput(request_id, prompt, ids, [-0.1] * n, [0] * n, text, True, "stop")

    async def abort(self, request_id: str) -> None:
        return None


def test_calc_turns_end_at_the_tool_call(tokenizer: Any) -> None:
    chat = ChatTokens(tokenizer)
    client = _StopStringClient(chat, ["<calc>1+1</calc>7/9</answer>", "<answer>2</answer>23</calc>"])
    traj = _run(tokenizer, "calc_math", "calc_math/0001", client)
    traj.validate()
    assert client.stops_seen == [calc_math.STOP, calc_math.STOP]
    assert traj.actions == ["<calc>1+1</calc>", "<answer>2</answer>"] and traj.finish_cause == "done"
    text = tokenizer.decode(traj.token_ids, skip_special_tokens=False)
    assert "<calc>1+1</calc><|im_end|>" in text and "7/9" not in text  # closed by the template
    client2 = _StopStringClient(chat, ["up"] * 100)
    _run(tokenizer, "frozenlake", "frozenlake/4x4", client2)
    assert set(client2.stops_seen) == {()}
