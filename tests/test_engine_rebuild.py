"""Engines replaced in place (`rollart_hpc.rollout.resilient`): a fake engine records the order of events."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_contract import drain

from rollart_hpc.config.loader import build
from rollart_hpc.config.schema import RolloutConfig
from rollart_hpc.contracts.errors import UsageError
from rollart_hpc.contracts.generation import RequestOutput, SamplingParams
from rollart_hpc.inference.engine import LLMEngine
from rollart_hpc.models.checkpoint import load_weights
from rollart_hpc.models.tiny import make_tiny_model
from rollart_hpc.rollout.resilient import EngineFailedError, FaultInjector, ResilientEngine

SAMPLING = SamplingParams(max_tokens=4)


class FakeEngine:
    """Finishes a request at its second step; `fail_on` names the calls that raise."""

    def __init__(self, index: int, events: list[tuple[Any, ...]], version: int, fail_on: set[str]) -> None:
        self.index, self.events, self._version, self.fail_on = index, events, version, fail_on
        self.requests: dict[str, tuple[list[int], int]] = {}
        self.staged: int | None = None
        events.append(("build", index, version))

    def _event(self, name: str, *args: Any) -> None:
        self.events.append((name, self.index, *args))
        if name in self.fail_on:
            raise RuntimeError(f"engine {self.index}: {name} broke")

    @property
    def version(self) -> int:
        return self._version

    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams) -> None:
        self._event("add", request_id)
        self.requests[request_id] = (prompt_token_ids, 0)

    def abort(self, request_id: str) -> bool:
        self._event("abort", request_id)
        return self.requests.pop(request_id, None) is not None

    def step(self) -> list[RequestOutput]:
        self._event("step")
        if self.staged is not None:
            self._version, self.staged = self.staged, None
        done = []
        for rid, (prompt, steps) in list(self.requests.items()):
            if steps >= 1:
                del self.requests[rid]
                done.append(RequestOutput(rid, prompt, [7], [-0.5], [self._version], "", True, "stop"))
            else:
                self.requests[rid] = (prompt, steps + 1)
        return done

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def has_staged_weights(self) -> bool:
        return self.staged is not None

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        named = list(named_tensors)
        self._event("update_weights", version, float(named[0][1].sum()))
        self.staged = version

    def begin_weights(self, version: int) -> _FakeLanding:
        self._event("begin_weights", version)
        return _FakeLanding(self, version)

    def close(self) -> None:
        self.events.append(("close", self.index))


class _FakeLanding:
    """Lands into one staged tensor `w` (a target); `land` fails when the engine's `fail_on` has "land"."""

    def __init__(self, engine: FakeEngine, version: int) -> None:
        self.engine, self.version = engine, version
        self.targets = {"w": torch.zeros(2)}

    def land(self, named: list[tuple[str, torch.Tensor]]) -> None:
        self.engine._event("land", self.version, float(sum(t.sum() for _, t in named)))

    def commit(self, direct: Iterable[str] = ()) -> None:
        self.engine._event("commit", self.version, sorted(direct), float(self.targets["w"].sum()))
        self.engine.staged = self.version

    def abort(self) -> None:
        self.engine._event("abort_landing", self.version)


def _resilient(
    events: list[tuple[Any, ...]], fails: list[set[str]], max_rebuilds: int = 3, **kw: Any
) -> ResilientEngine:
    built: list[FakeEngine] = []

    def build_fake() -> FakeEngine:
        index = len(built)
        if "build" in fails[index]:
            built.append(FakeEngine(index, events, 0, set()))
            raise RuntimeError(f"build {index} broke")
        built.append(FakeEngine(index, events, 0, fails[index]))
        return built[-1]

    return ResilientEngine(
        build_fake, max_rebuilds, lambda line: events.append(("log", line.split(" (")[0])), **kw
    )


def _weights(value: float) -> list[tuple[str, torch.Tensor]]:
    return [("w", torch.full((2,), value))]


def test_a_failed_step_fails_held_requests_and_rebuilds_at_the_newest_version() -> None:
    events: list[tuple[Any, ...]] = []
    engine = _resilient(events, [{"step"}, set()])
    tensor = _weights(1.5)
    engine.update_weights(tensor, 3)
    tensor[0][1].fill_(9.0)  # the receiver may reuse its buffers: the engine kept a copy
    engine.add_request("a", [1, 2], SAMPLING)
    engine.add_request("b", [3], SAMPLING)
    out = engine.step()
    assert [(o.request_id, o.prompt_token_ids, o.finished, o.finish_reason) for o in out] == [
        ("a", [1, 2], True, "error"),
        ("b", [3], True, "error"),
    ]
    assert "replaced" in (out[0].error or "")
    assert events == [
        ("build", 0, 0),
        ("update_weights", 0, 3, 3.0),
        ("add", 0, "a"),
        ("add", 0, "b"),
        ("step", 0),
        ("log", "rollout engine failed"),
        ("close", 0),
        ("build", 1, 0),
        ("update_weights", 1, 3, 3.0),
        ("step", 1),
        ("log", "rollout engine rebuilt"),
    ]
    assert (engine.version, engine.failures, engine.rebuilds, engine.has_unfinished()) == (3, 1, 1, False)
    engine.add_request("c", [4], SAMPLING)  # the new engine serves
    assert engine.step() == [] and [o.request_id for o in engine.step()] == ["c"]


def test_a_failed_weight_load_marks_the_engine_broken_and_the_loop_rebuilds_it() -> None:
    events: list[tuple[Any, ...]] = []
    engine = _resilient(events, [{"update_weights"}, set()])
    engine.add_request("a", [1], SAMPLING)
    engine.update_weights(_weights(1.0), 5)  # the weights thread: no raise, no rebuild there
    assert events[-1] == ("update_weights", 0, 5, 2.0) and engine.has_unfinished()
    assert not engine.has_staged_weights()
    out = engine.step()
    assert [(o.request_id, o.finish_reason) for o in out] == [("a", "error")]
    assert ("update_weights", 1, 5, 2.0) in events and engine.version == 5
    assert engine.abort("a") is False  # already answered


def test_weights_received_while_broken_go_into_the_rebuilt_engine() -> None:
    events: list[tuple[Any, ...]] = []
    engine = _resilient(events, [{"update_weights"}, set()])
    engine.update_weights(_weights(1.0), 1)
    engine.update_weights(_weights(2.0), 2)  # broken: only kept
    assert [e for e in events if e[0] == "update_weights"] == [("update_weights", 0, 1, 2.0)]
    engine.step()  # rebuilds (stepping the idle new engine once to swap the weights in), then steps it
    assert events[-3:] == [("step", 1), ("log", "rollout engine rebuilt"), ("step", 1)]
    assert ("update_weights", 1, 2, 4.0) in events and engine.version == 2


def test_a_landing_goes_through_and_a_failed_one_is_kept_for_the_rebuild() -> None:
    """A landing reaches the inner engine (bucket copies and tensors written straight in its targets);
    when the inner landing fails the engine is broken, the landing keeps every tensor, and the rebuilt
    engine gets the whole version (in-place ones included)."""
    events: list[tuple[Any, ...]] = []
    engine = _resilient(events, [{"land"}, set()])
    landing = engine.begin_weights(3)
    landing.targets["w"].fill_(1.5)  # landed in place by the receiver
    landing.land([("b", torch.full((2,), 2.0))])  # a bucket: the inner landing breaks
    landing.commit(["w"])
    assert ("land", 0, 3, 4.0) in events and not any(e[0] == "commit" for e in events)
    engine.step()  # rebuilds with the kept version
    assert ("update_weights", 1, 3, 4.0) in events and engine.version == 3  # b (4.0) first, then w
    landing = engine.begin_weights(4)
    landing.targets["w"].fill_(0.5)
    landing.commit(["w"])
    engine.step()
    assert events[-2][:4] == ("commit", 1, 4, ["w"]) and engine.version == 4


def test_the_rank_fails_once_its_rebuilds_are_spent_and_failed_builds_count() -> None:
    events: list[tuple[Any, ...]] = []
    engine = _resilient(events, [{"step"}, {"build"}, {"step"}], max_rebuilds=2)
    engine.add_request("a", [1], SAMPLING)
    assert [o.finish_reason for o in engine.step()] == ["error"]  # build 1 failed, build 2 served
    assert (engine.failures, engine.rebuilds) == (2, 1)
    engine.add_request("b", [1], SAMPLING)
    with pytest.raises(EngineFailedError, match="max_engine_rebuilds = 2 spent"):
        engine.step()
    assert events[-1] == ("close", 2) and engine.failures == 3


def test_no_rebuilds_means_the_first_failure_ends_the_rank() -> None:
    engine = _resilient([], [{"add"}], max_rebuilds=0)
    with pytest.raises(EngineFailedError):
        engine.add_request("a", [1], SAMPLING)


def test_injected_faults_are_seeded_capped_and_only_hit_steps_with_requests() -> None:
    def pattern(seed: int) -> list[bool]:
        injector, hits = FaultInjector(0.3, 2, seed), []
        for _ in range(40):
            try:
                injector.check()
                hits.append(False)
            except RuntimeError:
                hits.append(True)
        return hits

    assert pattern(4) == pattern(4) and sum(pattern(4)) == 2 and pattern(4) != pattern(5)
    events: list[tuple[Any, ...]] = []
    engine = _resilient(events, [set()] * 4, faults=FaultInjector(0.99, 1, 0))
    engine.step()  # idle: no draw
    engine.add_request("a", [1], SAMPLING)
    assert [o.finish_reason for o in engine.step()] == ["error"] and engine.rebuilds == 1


def test_rollout_fault_and_rebuild_fields_are_validated() -> None:
    assert build(RolloutConfig, {}).max_engine_rebuilds == 3
    build(RolloutConfig, {"fault_step_prob": 0.1, "num_faults": 2})
    for bad in ({"max_engine_rebuilds": -1}, {"num_faults": 2}, {"fault_step_prob": 0.1}):
        with pytest.raises(UsageError):
            build(RolloutConfig, bad)


def test_a_rebuilt_builtin_engine_samples_from_the_newest_weights_at_their_version(tmp_path: Path) -> None:
    small = {"hidden_size": 64, "num_layers": 1, "num_heads": 1, "num_kv_heads": 1, "intermediate_size": 128}
    dirs = [
        make_tiny_model(tmp_path / str(s), family="llama", seed=s, init_std=0.08, **small) for s in (1, 2)
    ]

    def builtin(model_dir: Path, version: int) -> LLMEngine:
        return LLMEngine.from_pretrained(
            model_dir, num_slots=2, max_model_len=64, version=version, eos_token_ids=()
        )

    log: list[str] = []
    engine = ResilientEngine(lambda: builtin(dirs[0], 0), 1, log.append, FaultInjector(0.99, 1, 0))
    engine.update_weights(load_weights(dirs[1]).items(), 7)
    engine.step()  # idle: swaps, no fault drawn
    assert engine.version == 7
    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    engine.add_request("lost", [5, 6, 7], greedy)
    assert [(o.request_id, o.finish_reason) for o in drain(engine).values()] == [("lost", "error")]
    assert (engine.version, engine.failures, engine.rebuilds) == (7, 1, 1)
    engine.add_request("after", [5, 6, 7], greedy)
    out = drain(engine)["after"]
    reference = builtin(dirs[1], 7)
    reference.add_request("ref", [5, 6, 7], greedy)
    ref = drain(reference)["ref"]
    assert (out.finish_reason, out.token_ids, out.versions) == ("length", ref.token_ids, [7] * 6)
    engine.close()
    reference.close()
