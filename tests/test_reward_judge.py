"""Model-based reward: the judge's answer grammar, the counted rule-based fallback, a reward service whose
judge engine batches the requests of two clients (a scripted engine and a tiny random model), greedy
determinism, idempotent judge requests, and the config checks."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from reward_running import running_service

from rollart_hpc.config import load_config
from rollart_hpc.config.schema import RewardConfig
from rollart_hpc.contracts.errors import UsageError
from rollart_hpc.contracts.generation import RequestOutput, SamplingParams
from rollart_hpc.reward import service as service_mod
from rollart_hpc.reward.client import ServiceClient
from rollart_hpc.reward.functions import RewardInput
from rollart_hpc.reward.judge import Judge, judge_prompt, parse_score
from rollart_hpc.reward.wire import input_to_dict
from rollart_hpc.tasks.families.calc_math import generate_problem

REPO = Path(__file__).resolve().parent.parent


def _inp(index: int, right: bool = True) -> RewardInput:
    gold = generate_problem(index).answer
    return RewardInput(
        f"calc_math/{index:04d}", "calc_math", (f"<answer>{gold + (not right)}</answer>",), 1.0, right
    )


@pytest.mark.parametrize(
    ("answer", "score"),
    [
        ("SCORE: 0.8", 0.8),
        ("The agent is right.\nSCORE: 10", 1.0),
        ("  SCORE:0  \n\n", 0.0),
        ("SCORE: 1", 0.1),
        ("SCORE: 07", 0.7),
        ("SCORE: .5", 0.5),
        ("SCORE: 7/10", 0.7),
        ("SCORE: 10 / 10", 1.0),
        ("SCORE: 1.0", 1.0),
    ],
)
def test_parse_score_accepts_the_grammar(answer: str, score: float) -> None:
    assert parse_score(answer) == pytest.approx(score)


@pytest.mark.parametrize(
    "answer",
    [
        "",
        "eeee",
        "SCORE: 1.5",
        "SCORE: 11/10",
        "SCORE: 11",
        "SCORE: 100",
        "SCORE: 1.",
        "SCORE: -0.2",
        "score: 0.5",
        "SCORE: 0.5\nthanks",
        "SCORE: 0.5 0.6",
        "8",
    ],
)
def test_parse_score_refuses_everything_else(answer: str) -> None:
    assert parse_score(answer) is None


def test_prompt_holds_task_actions_and_outcome() -> None:
    prompt = judge_prompt(_inp(3, right=False))
    assert generate_problem(3).text in prompt
    assert f"<answer>{generate_problem(3).answer + 1}</answer>" in prompt
    assert "no win" in prompt and "SCORE:" in prompt
    long = RewardInput("household/1", "household", ("x" * 5000,), 0.0, False)
    assert len(judge_prompt(long)) < 2500  # actions cut to their tail


def test_judge_config_checks(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="judge_families: needs reward.judge_model"):
        RewardConfig(judge_families=["calc_math"]).validate("reward")
    with pytest.raises(UsageError, match="not a model dir"):
        RewardConfig(judge_model=str(tmp_path / "nope"), judge_families=["calc_math"]).validate("reward")
    with pytest.raises(UsageError, match="set reward.judge_families"):
        RewardConfig(judge_model=str(tmp_path)).validate("reward")
    (tmp_path / "config.json").write_text("{}")
    cfg = RewardConfig(judge_model=str(tmp_path), judge_families=["calc_math"])
    cfg.validate("reward")
    with pytest.raises(UsageError, match=r"judge rewards need reward.service / reward.service_dir"):
        cfg.check_num_ranks(1)
    replace(cfg, service_dir=str(tmp_path)).check_num_ranks(1)  # with a service: the service's judge
    judge = [f"reward.judge_model={str(tmp_path)!r}", "reward.judge_families=['calc_math']"]
    with pytest.raises(UsageError, match=r"judge rewards need reward.service"):  # a run's config
        load_config(REPO / "configs" / "tiny.toml", judge)


# --- a scripted engine: answers chosen by the test, batching observed -------------------------------


class ScriptedEngine:
    """An `Engine` that finishes each request after `steps` steps with the answer `reply(prompt)`."""

    def __init__(self, reply: Any, steps: int = 3) -> None:
        self.reply, self.steps = reply, steps
        self.running: dict[str, tuple[list[int], int]] = {}
        self.version = 0

    def add_request(self, rid: str, prompt: list[int], sampling: SamplingParams) -> None:
        self.running[rid] = (prompt, 0)

    def abort(self, rid: str) -> bool:
        return False

    def step(self) -> list[RequestOutput]:
        outs = []
        for rid, (prompt, n) in list(self.running.items()):
            if n + 1 < self.steps:
                self.running[rid] = (prompt, n + 1)
                continue
            del self.running[rid]
            text = self.reply("".join(chr(t) for t in prompt))
            outs.append(RequestOutput(rid, prompt, [1], text=text, finished=True, finish_reason="stop"))
        return outs

    def has_unfinished(self) -> bool:
        return bool(self.running)

    def has_staged_weights(self) -> bool:
        return False

    def close(self) -> None:
        pass


class CharTokenizer:
    def apply_chat_template(self, messages: list[dict[str, str]], **kw: Any) -> str:
        return messages[-1]["content"]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]


def _scripted_judge(reply: Any) -> Judge:
    return Judge(ScriptedEngine(reply), CharTokenizer(), ["calc_math"], 16, 0.0, 8)


def test_judge_parses_or_falls_back_to_the_rule_reward_and_counts_it() -> None:
    # the scripted judge answers in the grammar when the env reports a win, else off the grammar
    judge = _scripted_judge(lambda p: " 9/10" if "reports a win" in p else " I think so")

    async def go() -> list[Any]:
        try:
            return list(await asyncio.gather(*(judge.score(_inp(i, right=i % 2 == 0)) for i in range(6))))
        finally:
            judge.close()

    results = asyncio.run(go())
    assert [r.fallback for r in results] == [False, True] * 3
    assert [r.output.reward for r in results] == [0.9, 0.0] * 3  # odd: calc_math's rule reward (wrong)
    assert [r.output.success for r in results] == [True, False] * 3
    assert results[1].answer == "SCORE: I think so"  # the prefill and the reply
    assert judge.fallbacks == 3 and judge.judged == 6
    assert judge.stats()["peak_batch"] == 6  # all six decoded together


def _cfg(tmp_path: Path, **kw: object) -> RewardConfig:
    base = RewardConfig(
        executor="thread",
        max_workers=1,
        idle_shutdown_s=0.2,
        service_timeout_s=30.0,
        service_deadline_s=60.0,
        service_dir=str(tmp_path / "svc"),
    )
    return replace(base, **kw)  # type: ignore[arg-type]


def test_service_judges_two_clients_in_one_batch_and_scores_rule_families_in_its_pool(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(service_mod, "make_judge", lambda cfg: _scripted_judge(lambda p: " 0.8"))
    cfg = _cfg(tmp_path)

    async def go() -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
        async with running_service(tmp_path, cfg) as service:
            a, b = ServiceClient(cfg, "run-a"), ServiceClient(cfg, "run-b")
            rule = input_to_dict(RewardInput("frozenlake/1", "frozenlake", ("left",), 1.0, True))
            replies = await asyncio.gather(
                *(a.request(f"a{i}", input_to_dict(_inp(i))) for i in range(4)),
                *(b.request(f"b{i}", input_to_dict(_inp(i, right=False))) for i in range(4)),
                b.request("rule", rule),
            )
            again = await a.request("a0", input_to_dict(_inp(0)))  # a retried id: from the cache
            a.close(), b.close()
            return list(replies), again, service.stats()

    replies, again, stats = asyncio.run(go())
    assert [r["reward"] for r in replies[:8]] == [0.8] * 8
    assert not any(r["judge_fallback"] for r in replies[:8])
    assert replies[8]["reward"] == 1.0 and "judge_fallback" not in replies[8]  # the pool's env_won
    assert again["cached"] and again["reward"] == 0.8
    assert stats["judge"]["judged"] == 8 and stats["judge"]["peak_batch"] > 1
    assert stats["pool"]["scored"] == 1


# --- a tiny random model as the judge -------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_judge_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rollart_hpc.models.tiny import make_tiny_model

    out = tmp_path_factory.mktemp("judge") / "tiny"
    return make_tiny_model(out, hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=1)


def test_tiny_model_judge_batches_two_clients_falls_back_and_is_deterministic(
    tmp_path: Path, tiny_judge_dir: Path
) -> None:
    cfg = _cfg(
        tmp_path, judge_model=str(tiny_judge_dir), judge_families=["calc_math"], judge_max_new_tokens=12
    )

    async def go() -> tuple[list[dict[str, Any]], dict[str, Any], list[str]]:
        async with running_service(tmp_path, cfg) as service:
            a, b = ServiceClient(cfg, "run-a"), ServiceClient(cfg, "run-b")
            replies = await asyncio.gather(
                *(a.request(f"a{i}", input_to_dict(_inp(i))) for i in range(3)),
                *(b.request(f"b{i}", input_to_dict(_inp(i, right=False))) for i in range(3)),
            )
            again = await b.request("b0", input_to_dict(_inp(0, right=False)))  # retried: not judged again
            a.close(), b.close()
            assert again["cached"] and again["reward"] == replies[3]["reward"]
            judge = service.judge
            assert judge is not None
            answers = [(await judge.score(_inp(5))).answer for _ in range(2)]  # same request, greedy
            return list(replies), service.stats(), answers

    replies, stats, answers = asyncio.run(go())
    # a random model's answers do not parse: the rule-based reward stands in, counted
    assert all(r["status"] == "ok" and r["judge_fallback"] for r in replies)
    assert [r["reward"] for r in replies] == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    assert stats["judge"]["judged"] == 8 and stats["judge"]["fallbacks"] == 8
    assert stats["judge"]["peak_batch"] > 1, stats["judge"]
    assert answers[0] == answers[1]


@pytest.mark.slow
def test_smollm2_judge_answers_in_the_grammar(tmp_path: Path) -> None:
    """SmolLM2-135M-Instruct as the judge: its answers to an obviously right and an obviously wrong calc
    answer parse (measured: 'SCORE: 10' for both, so it does not discriminate; not asserted)."""
    from rollart_hpc.models import smollm2

    try:
        smollm2.smollm2_gguf_dir()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    model_dir = smollm2.import_smollm2(tmp_path / "smollm2")
    judge = Judge.load(model_dir, ["calc_math"], 8, 0.0, 4)

    async def go() -> list[Any]:
        try:
            return list(await asyncio.gather(judge.score(_inp(3)), judge.score(_inp(3, right=False))))
        finally:
            judge.close()

    right, wrong = asyncio.run(go())
    print(
        f"judge answers: right {right.answer!r} -> {right.output}; wrong {wrong.answer!r} -> {wrong.output}"
    )
    assert not right.fallback and not wrong.fallback, (right.answer, wrong.answer)
    assert 0.0 <= wrong.output.reward <= 1.0 and 0.0 <= right.output.reward <= 1.0
    assert judge.stats()["peak_batch"] == 2
