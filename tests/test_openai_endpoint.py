"""The OpenAI-compatible chat-completions endpoint of the env ranks: scoping, refusals, token fidelity with
tool calls through the real `openai` client, and the episodes of an OpenAI-client agent."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import openai
import pytest

from rollart_hpc.contracts.generation import RequestOutput, SamplingParams
from rollart_hpc.envs.openai_server import ChatServer, run_agent_episode
from rollart_hpc.tasks.agent_loop import AgentConfig, new_trajectory
from rollart_hpc.tasks.chat import ChatTokens
from rollart_hpc.tasks.chat_api import AgentOutcome
from rollart_hpc.tasks.types import Task

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
]
CALL = '<tool_call>\n{"name": "calc", "arguments": {"expression": "2+3"}}\n</tool_call>'


@pytest.fixture(scope="module")
def chat() -> ChatTokens:
    from rollart_hpc.models.tiny import make_tiny_tokenizer

    return ChatTokens(make_tiny_tokenizer())


class FakeEngine:
    """An LLMClient that answers scripted texts one character per token (a tokenization no re-encoding
    reproduces), with distinct log-probs and versions, and records every prompt it was sent."""

    def __init__(self, chat: ChatTokens, texts: dict[str, list[str]], block: bool = False) -> None:
        self.chat, self.texts, self.block = chat, texts, block
        self.prompts: dict[str, list[int]] = {}
        self.outputs: dict[str, RequestOutput] = {}
        self.sampling: dict[str, SamplingParams] = {}
        self.aborted: list[str] = []
        self.started = asyncio.Event()

    async def generate(self, request_id: str, prompt: list[int], sampling: SamplingParams) -> RequestOutput:
        self.prompts[request_id], self.sampling[request_id] = list(prompt), sampling
        self.started.set()
        if self.block:
            await asyncio.Event().wait()
        episode, _, turn = request_id.rpartition("/t")
        text = self.texts[episode][int(turn)]
        ids = [i for ch in text for i in self.chat.encode(ch)] + [self.chat.stop_token_ids[0]]
        ids = ids[: sampling.max_tokens]
        n = len(ids)
        logprobs = [-0.01 * (k + 1) - 0.5 * int(turn) for k in range(n)]
        out = RequestOutput(request_id, list(prompt), ids, logprobs, [7 + int(turn)] * n, "", True, "stop")
        self.outputs[request_id] = out
        return out

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def _task(tid: str = "calc_math/0001", max_turns: int = 4) -> Task:
    return Task(tid, "calc_math", ("calc_math",), max_turns, "Solve it.", "What is 2+3?")


CFG = AgentConfig(max_context_tokens=2048, max_new_tokens=200)


def _serve(chat: ChatTokens, body: Any) -> Any:
    async def main() -> Any:
        async with ChatServer(chat, CFG) as server:
            return await body(server)

    return asyncio.run(main())


async def _tool_agent(client: openai.AsyncOpenAI, task: Task) -> float:
    messages: list[Any] = [
        {"role": "system", "content": task.system},
        {"role": "user", "content": task.prompt},
    ]
    first = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert (call.function.name, json.loads(call.function.arguments)) == ("calc", {"expression": "2+3"})
    messages.append(choice.message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": "5"})
    second = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
    assert second.choices[0].finish_reason == "stop"
    assert second.choices[0].message.content == "The answer is 5."
    return 1.0


# A template that renders tools itself (the shape of Qwen2.5's): the endpoint passes them through.
NATIVE_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}"
    "\n\n{% endif %}# Native tools\n{% for t in tools %}{{ t['function']['name'] }}: "
    "{{ t['function']['description'] }}\n{% endfor %}<|im_end|>\n"
    "{%- elif messages[0]['role'] == 'system' %}<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n"
    "{%- endif %}"
    "{%- for m in messages %}{% if m['role'] == 'system' and loop.first %}"
    "{% elif m['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m['content'] }}\n</tool_response>"
    "<|im_end|>\n{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def native_chat() -> ChatTokens:
    from rollart_hpc.models.tiny import make_tiny_tokenizer

    tokenizer = make_tiny_tokenizer()
    tokenizer.chat_template = NATIVE_TEMPLATE
    return ChatTokens(tokenizer)


def test_a_template_that_renders_tools_gets_them_natively_with_the_same_fidelity(
    native_chat: ChatTokens,
) -> None:
    task = _task()
    engine = FakeEngine(native_chat, {"ep-0": [f"Let me compute.{CALL}", "The answer is 5."]})
    traj = new_trajectory(task, "ep-0")

    async def body(server: ChatServer) -> Any:
        return await run_agent_episode(_tool_agent, server, task, engine, CFG, traj)

    async def main() -> Any:
        async with ChatServer(native_chat, CFG) as server:
            return await body(server)

    asyncio.run(main())
    traj.validate()
    assert (traj.status, traj.env_return, traj.num_turns) == ("ok", 1.0, 2)
    p0, p1 = engine.prompts["ep-0/t0"], engine.prompts["ep-0/t1"]
    out0, out1 = engine.outputs["ep-0/t0"], engine.outputs["ep-0/t1"]
    assert (
        traj.token_ids == p1 + out1.token_ids and p1[: len(p0) + len(out0.token_ids)] == p0 + out0.token_ids
    )
    head = native_chat.decode(p0, skip_special=False)
    assert (
        head.startswith("<|im_start|>system\nSolve it.\n\n# Native tools\ncalc: Evaluate")
        and "<tools>" not in head
    )
    cont = native_chat.decode(p1[len(p0) + len(out0.token_ids) :], skip_special=False)
    assert (
        cont == "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def test_token_fidelity_of_a_tool_call_conversation_through_the_openai_client(chat: ChatTokens) -> None:
    task = _task()
    engine = FakeEngine(chat, {"ep-0": [f"Let me compute.{CALL}", "The answer is 5."]})
    traj = new_trajectory(task, "ep-0")

    async def body(server: ChatServer) -> Any:
        return await run_agent_episode(_tool_agent, server, task, engine, CFG, traj)

    _serve(chat, body)
    traj.validate()
    assert (traj.status, traj.finish_cause, traj.env_return, traj.env_won, traj.num_turns) == (
        "ok",
        "done",
        1.0,
        True,
        2,
    )
    outs = [engine.outputs["ep-0/t0"], engine.outputs["ep-0/t1"]]
    sampled = [i for o in outs for i in o.token_ids]
    assert [t for t, m in zip(traj.token_ids, traj.action_mask, strict=True) if m] == sampled
    assert [lp for lp, m in zip(traj.logprobs, traj.action_mask, strict=True) if m] == [
        lp for o in outs for lp in o.logprobs
    ]
    assert [v for v, m in zip(traj.versions, traj.action_mask, strict=True) if m] == [
        v for o in outs for v in o.versions
    ]
    # Turn 0's prompt is the whole mask-0 head; turn 1's prompt is everything recorded before its reply.
    p0, p1 = engine.prompts["ep-0/t0"], engine.prompts["ep-0/t1"]
    assert traj.token_ids[: len(p0)] == p0 and traj.action_mask[: len(p0)] == [0] * len(p0)
    assert traj.prompt_len == len(p0)
    assert p1 == traj.token_ids[: len(p1)]
    assert p1[: len(p0) + len(outs[0].token_ids)] == p0 + outs[0].token_ids  # nothing re-tokenised
    assert traj.token_ids == p1 + outs[1].token_ids
    assert traj.action_mask == [0] * len(p0) + [1] * len(outs[0].token_ids) + [0] * (
        len(p1) - len(p0) - len(outs[0].token_ids)
    ) + [1] * len(outs[1].token_ids)
    # The sampled tokenization is not the canonical one: re-encoding the reply would change the ids.
    assert chat.encode(chat.assistant_content(outs[0].token_ids)) != outs[0].token_ids[:-1]
    # The prompt renders the tools (Hermes convention) and the tool result in the tiny template.
    head = chat.decode(p0, skip_special=False)
    assert "<tools>" in head and '"name": "calc"' in head
    cont = chat.decode(p1[len(p0) + len(outs[0].token_ids) :], skip_special=False)
    assert (
        cont == "\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert traj.actions == [f"Let me compute.{CALL}", "The answer is 5."]


def test_two_concurrent_episodes_never_mix(chat: ChatTokens) -> None:
    engine = FakeEngine(chat, {"a": ["alpha"], "b": ["beta"]})
    trajs = {e: new_trajectory(_task(f"calc_math/000{i}"), e) for i, e in enumerate("ab")}

    async def agent(client: openai.AsyncOpenAI, task: Task) -> float:
        reply = await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": f"I am {task.id}"}]
        )
        return (
            1.0
            if reply.choices[0].message.content == {"calc_math/0000": "alpha"}.get(task.id, "beta")
            else 0.0
        )

    async def body(server: ChatServer) -> None:
        await asyncio.gather(
            *(run_agent_episode(agent, server, _task(t.task_id), engine, CFG, t) for t in trajs.values())
        )

    _serve(chat, body)
    for episode, traj in trajs.items():
        assert traj.env_return == 1.0, traj
        assert f"I am {traj.task_id}" in chat.decode(engine.prompts[f"{episode}/t0"])
        assert traj.token_ids == engine.prompts[f"{episode}/t0"] + engine.outputs[f"{episode}/t0"].token_ids


async def _post(url: str, body: Any, key: str | None = None, raw: bytes | None = None) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as session:
        data = raw if raw is not None else json.dumps(body).encode()
        async with session.post(url, data=data, headers=headers) as resp:
            return resp.status, await resp.json()


def test_refusals_unknown_scopes_and_edited_history(chat: ChatTokens) -> None:
    engine = FakeEngine(chat, {"ep": ["one", "two"]})
    traj = new_trajectory(_task(), "ep")
    msgs = [{"role": "user", "content": "hi"}]

    async def body(server: ChatServer) -> dict[str, tuple[int, Any]]:
        scope = server.open(_task(), traj, engine, CFG)
        url = scope.base_url + "/chat/completions"
        got = {
            "stream": await _post(url, {"messages": msgs, "stream": True}),
            "n": await _post(url, {"messages": msgs, "n": 2}),
            "malformed": await _post(url, None, raw=b"{not json"),
            "no_messages": await _post(url, {"messages": []}),
            "bad_role": await _post(url, {"messages": [{"role": "robot", "content": "x"}]}),
            "temperature": await _post(url, {"messages": msgs, "temperature": 0.3}),
            "key": await _post(url, {"messages": msgs}, key="other"),
            "first": await _post(url, {"messages": msgs, "temperature": 1.0}, key=scope.key),
        }
        reply = got["first"][1]["choices"][0]["message"]
        edited = [{"role": "user", "content": "hello"}, reply, {"role": "user", "content": "more"}]
        got["edited"] = await _post(url, {"messages": edited})
        got["tools_changed"] = await _post(url, {"messages": [*msgs, reply, msgs[0]], "tools": TOOLS})
        got["nothing_new"] = await _post(url, {"messages": [*msgs, reply]})
        got["second"] = await _post(url, {"messages": [*msgs, reply, {"role": "user", "content": "again"}]})
        got["unknown"] = await _post(f"http://127.0.0.1:{server.port}/episodes/nope/v1/chat/completions", {})
        await server.close(scope)
        async with aiohttp.ClientSession() as session, session.get(scope.base_url + "/models") as resp:
            got["closed"] = resp.status, await resp.json()
        return got

    got = _serve(chat, body)
    for name in (
        "stream",
        "n",
        "malformed",
        "no_messages",
        "bad_role",
        "temperature",
        "edited",
        "tools_changed",
    ):
        status, answer = got[name]
        assert status == 400 and answer["error"]["message"], (name, got[name])
    assert "edited history" in got["edited"][1]["error"]["message"]
    assert got["nothing_new"][0] == 400
    assert got["key"][0] == 401
    assert got["first"][0] == 200 and got["second"][0] == 200
    assert got["unknown"][0] == 404 and got["closed"][0] == 404
    assert got["closed"][1]["error"]["code"] == "episode_not_found"
    assert traj.num_turns == 2 == len(traj.actions) == len(traj.llm_s)


def test_malformed_tool_call_is_plain_content_and_counted(chat: ChatTokens) -> None:
    bad = '<tool_call>{"name": "calc", "arguments": [1}</tool_call>'
    engine = FakeEngine(chat, {"ep": [bad]})
    traj = new_trajectory(_task(), "ep")

    async def agent(client: openai.AsyncOpenAI, task: Task) -> AgentOutcome:
        reply = await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "x"}], tools=TOOLS
        )
        message = reply.choices[0].message
        assert message.content == bad and not message.tool_calls
        return AgentOutcome(0.5, success=False)

    async def body(server: ChatServer) -> Counter_:
        await run_agent_episode(agent, server, _task(), engine, CFG, traj)
        return server.stats

    stats = _serve(chat, body)
    assert stats["malformed_tool_calls"] == 1
    assert (traj.status, traj.env_return, traj.env_won) == ("ok", 0.5, False)


Counter_ = Any


def test_agent_failures_end_the_episode_not_the_server(chat: ChatTokens) -> None:
    async def raises(client: openai.AsyncOpenAI, task: Task) -> float:
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}])
        raise RuntimeError("my agent broke\nsecond line")

    async def returns_text(client: openai.AsyncOpenAI, task: Task) -> Any:
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}])
        return "great"

    async def silent(client: openai.AsyncOpenAI, task: Task) -> float:
        return 1.0

    async def loops(client: openai.AsyncOpenAI, task: Task) -> float:
        messages: list[Any] = [{"role": "user", "content": "x"}]
        while True:  # until the turn limit refuses
            reply = await client.chat.completions.create(model="policy", messages=messages)
            messages += [
                reply.choices[0].message.model_dump(exclude_none=True),
                {"role": "user", "content": "y"},
            ]

    engine = FakeEngine(chat, {f"e{i}": ["ok", "ok", "ok"] for i in range(4)})
    agents = [raises, returns_text, silent, loops]
    trajs = [new_trajectory(_task(max_turns=2), f"e{i}") for i in range(4)]

    async def body(server: ChatServer) -> None:
        for agent, traj in zip(agents, trajs, strict=True):
            await run_agent_episode(agent, server, _task(max_turns=2), engine, CFG, traj)

    _serve(chat, body)
    for traj in trajs:
        traj.validate()
    assert [(t.status, t.finish_cause) for t in trajs] == [
        ("failed", "agent_error"),
        ("failed", "agent_error"),
        ("failed", "agent_error"),
        ("ok", "max_turns"),
    ]
    assert trajs[0].error == "RuntimeError: my agent broke"
    assert "str" in trajs[1].error and "no chat completion request" in trajs[2].error
    assert trajs[3].num_turns == 2


def test_cancelling_an_episode_aborts_its_in_flight_request(chat: ChatTokens) -> None:
    engine = FakeEngine(chat, {"ep": ["never"]}, block=True)
    traj = new_trajectory(_task(), "ep")

    async def agent(client: openai.AsyncOpenAI, task: Task) -> float:
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}])
        return 1.0

    async def body(server: ChatServer) -> None:
        episode = asyncio.create_task(run_agent_episode(agent, server, _task(), engine, CFG, traj))
        await engine.started.wait()
        episode.cancel()
        with pytest.raises(asyncio.CancelledError):
            await episode
        assert not server.scopes

    _serve(chat, body)
    assert engine.aborted == ["ep/t0"]


def test_max_tokens_is_capped_by_the_run_and_the_context(chat: ChatTokens) -> None:
    engine = FakeEngine(chat, {"ep": ["abc"]})
    traj = new_trajectory(_task(), "ep")
    cfg = AgentConfig(max_context_tokens=2048, max_new_tokens=5)

    async def agent(client: openai.AsyncOpenAI, task: Task) -> float:
        await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "x"}], max_completion_tokens=100
        )
        return 0.0

    async def body(server: ChatServer) -> None:
        await run_agent_episode(agent, server, _task(), engine, cfg, traj)

    _serve(chat, body)
    assert engine.sampling["ep/t0"].max_tokens == 5
    assert engine.sampling["ep/t0"].temperature == cfg.temperature
    assert (traj.status, traj.env_won) == ("ok", False)


def test_env_worker_plays_concurrent_agent_episodes_through_one_endpoint(chat: ChatTokens) -> None:
    from rollart_hpc.envs.worker import EnvWorker, EnvWorkerConfig

    ids = [f"w{i}" for i in range(6)]
    engine = FakeEngine(chat, {e: [f"Let me compute.{CALL}", "The answer is 5."] for e in ids})

    async def main() -> tuple[list[Any], int]:
        async with EnvWorker(
            EnvWorkerConfig(num_slots=3), CFG, chat.tokenizer, openai_agent=_tool_agent
        ) as worker:
            trajs = await worker.run_many([_task(f"calc_math/000{i}") for i in range(6)], engine, ids)
            assert worker.server is not None
            return trajs, worker.server.stats["requests"]

    trajs, requests = asyncio.run(main())
    assert requests == 12  # every episode's two turns went through the one server
    for episode, traj in zip(ids, trajs, strict=True):
        traj.validate()
        assert (traj.status, traj.finish_cause, traj.env_return, traj.episode_id) == (
            "ok",
            "done",
            1.0,
            episode,
        )
        assert traj.token_ids == engine.prompts[f"{episode}/t1"] + engine.outputs[f"{episode}/t1"].token_ids


def test_env_worker_time_limit_fails_the_episode_and_aborts_its_request(chat: ChatTokens) -> None:
    from rollart_hpc.envs.worker import EnvWorker, EnvWorkerConfig

    engine = FakeEngine(chat, {"slow": ["never"]}, block=True)

    async def main() -> Any:
        cfg = EnvWorkerConfig(num_slots=1, episode_timeout_s=1.0)
        async with EnvWorker(cfg, CFG, chat.tokenizer, openai_agent=_tool_agent) as worker:
            traj = await worker.run_episode(_task(), engine, episode_id="slow")
            assert worker.server is not None and not worker.server.scopes
            return traj

    traj = asyncio.run(main())
    assert (traj.status, traj.finish_cause) == ("failed", "timeout")
    # The request is aborted if it reached the engine before the limit (it does on any usual machine).
    assert engine.aborted == (["slow/t0"] if engine.started.is_set() else [])


def test_tool_choice_none_returns_the_reply_as_plain_content(chat: ChatTokens) -> None:
    engine = FakeEngine(chat, {"ep": [CALL]})
    traj = new_trajectory(_task(), "ep")

    async def agent(client: openai.AsyncOpenAI, task: Task) -> float:
        reply = await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "x"}], tools=TOOLS, tool_choice="none"
        )
        choice = reply.choices[0]
        assert (choice.finish_reason, choice.message.content, choice.message.tool_calls) == (
            "stop",
            CALL,
            None,
        )
        return 1.0

    async def body(server: ChatServer) -> None:
        await run_agent_episode(agent, server, _task(), engine, CFG, traj)

    _serve(chat, body)
    assert (traj.status, traj.env_return) == ("ok", 1.0)
