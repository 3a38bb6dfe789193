"""The engine contract (`rollart_hpc.inference.api.Engine`) as plain check functions, run against every engine.

tests/test_engine_contract.py runs them for the built-in engine, tests/test_vllm_engine_contract.py for
vLLM. Each check takes the engine under test (built by the caller, so one slow-starting engine can
serve several checks) and, where it needs the expected tokens, a `reference` factory: an engine known to
be right for a model directory (the built-in engine; `logprob_tol` absorbs the numerics of another
engine). Checks leave the engine idle; `check_weight_update_between_steps` leaves it at the new model.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from rollart_hpc.contracts.generation import RequestOutput, SamplingParams
from rollart_hpc.inference.api import Engine
from rollart_hpc.models.checkpoint import load_weights

# (model_dir, version) -> an engine holding that model at that version
EngineFactory = Callable[[Path, int], Engine]


def drain(engine: Engine, timeout_s: float = 120.0) -> dict[str, RequestOutput]:
    """Step until nothing is unfinished; every request id must come out exactly once."""
    done: dict[str, RequestOutput] = {}
    deadline = time.monotonic() + timeout_s
    while engine.has_unfinished():
        assert time.monotonic() < deadline, f"engine did not finish within {timeout_s} s"
        for out in engine.step():
            assert out.request_id not in done, f"{out.request_id} returned twice"
            done[out.request_id] = out
    return done


def run(
    engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]], in_flight: tuple[str, ...] = ()
) -> dict[str, RequestOutput]:
    """Adds `requests` and drains the engine: out come exactly they and the ids already `in_flight`."""
    for rid, (prompt, sampling) in requests.items():
        engine.add_request(rid, prompt, sampling)
    outs = drain(engine)
    assert set(outs) == set(requests) | set(in_flight)
    return outs


def prompts(lengths: tuple[int, ...], seed: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def assert_well_formed(out: RequestOutput) -> None:
    """A finished output: one finite log-prob <= 0 and one version per token."""
    assert out.finished and out.finish_reason in ("stop", "length", "abort", "error")
    assert len(out.logprobs) == len(out.versions) == len(out.token_ids)
    for lp in out.logprobs:
        assert math.isfinite(lp) and lp <= 1e-6, f"{out.request_id}: log-prob {lp}"


def check_greedy(
    engine: Engine, model_dir: Path, reference: EngineFactory, vocab: int, tag: str, logprob_tol: float = 0.0
) -> None:
    """Greedy requests (the same prompt twice in one batch, others beside) give the same tokens as each
    other and as the reference; each token carries the engine's version."""
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    ps = prompts((5, 17, 9), seed=1, vocab=vocab)
    requests = {f"{tag}-twin-a": (ps[0], greedy), f"{tag}-twin-b": (ps[0], greedy)}
    requests |= {f"{tag}-{i}": (p, greedy) for i, p in enumerate(ps[1:])}
    got = run(engine, requests)
    ref = run(reference(model_dir, engine.version), requests)
    for rid, out in got.items():
        assert_well_formed(out)
        assert out.finish_reason == "length" and out.versions == [engine.version] * greedy.max_tokens
        assert out.token_ids == ref[rid].token_ids, rid
        assert out.logprobs == pytest.approx(ref[rid].logprobs, abs=max(logprob_tol, 1e-6))
    a, b = got[f"{tag}-twin-a"], got[f"{tag}-twin-b"]
    assert a.token_ids == b.token_ids and a.logprobs == pytest.approx(b.logprobs, abs=1e-6)
    assert not engine.has_unfinished()


def check_abort(engine: Engine, vocab: int, tag: str, settle_s: float = 0.0) -> None:
    """Aborted requests (waiting or running) come out once, finished with reason "abort" and the tokens
    so far; an unknown request id is not aborted."""
    # long enough that an engine generating on its own (vLLM) is still mid-request after `settle_s`
    long = SamplingParams(temperature=0.0, max_tokens=240)
    prompt = prompts((10,), seed=4, vocab=vocab)[0]
    engine.add_request(f"{tag}-late", prompt, long)
    engine.add_request(f"{tag}-early", prompt, long)
    assert engine.abort(f"{tag}-early")
    early = engine.step()
    time.sleep(settle_s)
    early += engine.step()  # the early abort may come out of either step
    assert engine.abort(f"{tag}-late")
    assert not engine.abort(f"{tag}-no-such-request")
    outs = {o.request_id: o for o in early} | drain(engine)
    for rid in (f"{tag}-late", f"{tag}-early"):
        assert_well_formed(outs[rid])
        assert outs[rid].finish_reason == "abort" and len(outs[rid].token_ids) < long.max_tokens
    assert not engine.abort(f"{tag}-late")  # already finished
    assert not engine.has_unfinished()


def check_weight_update_between_steps(
    engine: Engine,
    new_dir: Path,
    reference: EngineFactory,
    vocab: int,
    tag: str,
    settle_s: float = 0.0,
    tail: int = 24,
    logprob_tol: float = 0.0,
) -> None:
    """`update_weights` from another thread while the caller steps (as the rollout rank loop does): the
    version switches between two steps, each output's versions go old... then new..., the tokens after
    the switch are the new model's, and requests added afterwards are all new version."""
    old = engine.version
    new = old + 1
    # Long requests (an engine that generates on its own, as vLLM does, must still be mid-request when
    # the update lands: 100 tokens of the test model could finish within the settle time on a fast box),
    # and the new weights read before the requests start, so nothing but `settle_s` lies between them.
    long = SamplingParams(temperature=0.0, max_tokens=220)
    ps = prompts((8, 30, 15), seed=3, vocab=vocab)
    named = list(load_weights(new_dir).items())
    for i, p in enumerate(ps):
        engine.add_request(f"{tag}-long-{i}", p, long)
    running: dict[str, RequestOutput] = {}
    for _ in range(4):
        running |= {o.request_id: o for o in engine.step()}
    time.sleep(settle_s)
    errors: list[BaseException] = []

    def update() -> None:
        try:
            engine.update_weights(named, new)
        except BaseException as exc:  # re-raised below, in the test's thread
            errors.append(exc)

    updater = threading.Thread(target=update, name="contract-weights")
    updater.start()
    running |= drain(engine, timeout_s=300)
    updater.join()
    if errors:
        raise errors[0]
    if engine.has_staged_weights():
        engine.step()  # an idle engine swaps staged weights at its next step (the rank loop does this)
    assert engine.version == new and not engine.has_staged_weights()
    tails: dict[str, tuple[list[int], SamplingParams]] = {}
    for i in range(len(ps)):
        out = running[f"{tag}-long-{i}"]
        assert_well_formed(out)
        assert out.versions == sorted(out.versions) and set(out.versions) <= {old, new}
        k = out.versions.count(old)
        if 0 < k < len(out.versions):
            n = min(tail, len(out.token_ids) - k)
            tails[out.request_id] = (ps[i] + out.token_ids[:k], SamplingParams(temperature=0.0, max_tokens=n))
    assert tails, "no request ran across the weight update"
    fresh = reference(new_dir, new)
    for rid, after in run(fresh, tails).items():
        k = running[rid].versions.count(old)
        assert running[rid].token_ids[k : k + tail] == after.token_ids, f"{rid}: not the new model's tokens"
        assert running[rid].logprobs[k : k + tail] == pytest.approx(
            after.logprobs, abs=max(logprob_tol, 1e-5)
        )
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    later = run(engine, {f"{tag}-after-{i}": (p, greedy) for i, p in enumerate(ps)})
    assert all(out.versions == [new] * greedy.max_tokens for out in later.values())
    assert not engine.has_unfinished()


def check_close(factory: EngineFactory, model_dir: Path, vocab: int) -> None:
    """An engine that served a request closes; closing again does nothing."""
    engine = factory(model_dir, 3)
    try:
        out = run(engine, {"c": (prompts((6,), seed=5, vocab=vocab)[0], SamplingParams(max_tokens=4))})["c"]
        assert_well_formed(out)
        assert out.versions == [3] * len(out.token_ids) and not engine.has_unfinished()
    finally:
        engine.close()
    engine.close()
