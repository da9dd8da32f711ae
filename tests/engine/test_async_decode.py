"""Async decode (async_decode.py) on the real smollm2-135m model: the engine queues a greedy decode step before it
reads the previous step's tokens. On the CPU nothing overlaps, but the bookkeeping is the same as on CUDA: every
request must get exactly the tokens, text and finish reason of the synchronous engine, aborts and arrivals in the
middle of a chain included, and a length limit must not cost a step past it."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from fluxion_lite.engine.async_decode import chainable
from fluxion_lite.engine.engine import Engine
from fluxion_lite.engine.sampling import SamplingParams

MODEL = "smollm2-135m"


@pytest.fixture(scope="module", params=["full", "fluxion"])
def engine(request: pytest.FixtureRequest) -> Engine:
    # fp32 weights: the requests below were chosen so that the fp32 model's greedy answers end both ways
    return Engine(MODEL, max_context=1024, prefill_chunk=32, attention=request.param, dtype="float32")


def chat(engine: Engine, text: str) -> list[int]:
    assert engine.tokenizer is not None
    return engine.tokenizer.encode(engine.tokenizer.apply_chat_template([{"role": "user", "content": text}]))


class Counted:
    """Counts the model's forward calls, and those that left the step to finish later (defer_sync)."""

    def __init__(self, engine: Engine):
        self.calls = self.deferred = 0
        self.engine, self.orig = engine, engine.model.forward

    def __enter__(self) -> Counted:
        def forward(*args: Any, **kwargs: Any) -> torch.Tensor:
            self.calls += 1
            self.deferred += bool(kwargs.get("defer_sync", False))
            return self.orig(*args, **kwargs)

        self.engine.model.forward = forward  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        self.engine.model.forward = self.orig  # type: ignore[method-assign]


def run(engine: Engine, requests: list[tuple[list[int], SamplingParams]], on: bool,
        between: Any = None) -> tuple[list[tuple[list[int], str, str | None]], Counted]:
    """Every request to the end -> (token ids, text, finish reason) in request order, and the forward counts.
    between(step_index, engine, request ids) runs after each step (aborts, arrivals)."""
    engine.async_decode = on
    for slot in list(engine._prefix_cache):  # every run from the same start (no prompt KV from the last one)
        engine.attn.free(slot)
    engine._prefix_cache.clear()
    ids = [engine.add_request(list(p), params) for p, params in requests]
    got: dict[str, tuple[list[int], list[str], list[str | None]]] = {}
    with Counted(engine) as counted:
        step = 0
        while engine.has_unfinished():
            for out in engine.step():
                toks, text, reason = got.setdefault(out.request_id, ([], [], [None]))
                toks.extend(out.new_token_ids)
                text.append(out.new_text)
                reason[0] = out.finish_reason
            if between is not None:
                between(step, engine, ids)
            step += 1
    engine.async_decode = False
    assert engine._inflight is None and not engine.running
    return [(got[i][0], "".join(got[i][1]), got[i][2][0]) for i in ids], counted


def greedy(n: int, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, **kw)


def test_greedy_batch_matches_the_synchronous_engine(engine: Engine) -> None:
    requests = [(chat(engine, "Name three colours."), greedy(24)),
                (chat(engine, "Tell me about cats."), greedy(40, ignore_eos=True)),
                (chat(engine, "Count from one to twenty."), greedy(31, stop=[" 7"])),
                (chat(engine, "Write a haiku about rain."), greedy(9))]
    sync, n_sync = run(engine, requests, on=False)
    chained, n_async = run(engine, requests, on=True)
    assert chained == sync
    assert n_sync.deferred == 0 and n_async.deferred > 20  # the chain ran
    assert {r for _, _, r in sync} == {"stop", "length"}  # both kinds of end are covered
    # a length limit is known ahead: at most one step past the end of each request that stopped otherwise
    stopped = sum(r == "stop" for _, _, r in sync)
    assert n_sync.calls <= n_async.calls <= n_sync.calls + stopped


def test_abort_and_arrival_in_the_middle_of_a_chain(engine: Engine) -> None:
    a, b, c = chat(engine, "Tell me about dogs."), chat(engine, "List some fruits."), chat(engine, "Say hello.")
    late = greedy(12, ignore_eos=True)

    freed: list[int] = []

    def events(step: int, eng: Engine, ids: list[str]) -> None:
        if step == 9:
            before = sum(eng.attn.bytes_used())
            eng.abort(ids[1])  # its row is in the queued step
            freed.append(before - sum(eng.attn.bytes_used()))
        if step == 13:
            eng.add_request(list(c), late, request_id="late")

    requests = [(a, greedy(30, ignore_eos=True)), (b, greedy(30, ignore_eos=True))]
    outs = {}
    for on in (False, True):
        got, counted = run(engine, requests, on=on, between=events)
        outs[on] = got
        if on:
            assert counted.deferred > 10
    assert outs[True][0] == outs[False][0] and outs[True][0][2] == "length"
    assert outs[True][1][2] == outs[False][1][2] == "abort"
    assert outs[True][1][0] == outs[False][1][0][: len(outs[True][1][0])]  # a prefix: the abort may land earlier
    assert len(freed) == 2 and min(freed) > 0  # the aborted request's KV went at once, chained or not
    solo, _ = run(engine, [(c, late)], on=False)
    assert engine.step() == [] and not engine.has_unfinished()
    assert solo[0][2] == "length"


def test_sampled_rows_chain_and_draw_what_the_synchronous_engine_draws(engine: Engine) -> None:
    """Sampling runs on the model's device with each request's seeded generator, chained or not: the same draws."""
    requests = [(chat(engine, "Name a fruit."), greedy(14, ignore_eos=True)),
                (chat(engine, "Name a city."), SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=14,
                                                               ignore_eos=True)),
                (chat(engine, "Name a river."), SamplingParams(temperature=1.3, top_k=40, min_p=0.02, seed=9,
                                                               max_tokens=14, ignore_eos=True))]
    sync, _ = run(engine, requests, on=False)
    chained, counted = run(engine, requests, on=True)
    assert chained == sync and counted.deferred > 8


def test_penalised_rows_chain_with_their_history_on_the_device(engine: Engine) -> None:
    """Penalties read the ids so far from sampling.Penalties on the model's device, so penalised rows chain too
    and draw what the synchronous engine draws."""
    requests = [(chat(engine, "Name a fruit."), greedy(16, ignore_eos=True, repetition_penalty=1.3)),
                (chat(engine, "Name a city."), SamplingParams(temperature=0.9, seed=5, max_tokens=16, ignore_eos=True,
                                                               presence_penalty=0.6, frequency_penalty=0.4))]
    sync, _ = run(engine, requests, on=False)
    chained, counted = run(engine, requests, on=True)
    assert chained == sync and counted.deferred > 10
    plain, _ = run(engine, [(requests[0][0], greedy(16, ignore_eos=True))], on=False)
    assert plain[0][0] != sync[0][0]  # the penalty changed what greedy decoding picks (it is applied at all)


def test_no_chain_past_a_length_limit() -> None:
    class Seq:
        def __init__(self, out: int, total: int, limit: int):
            self.output_ids, self.all_ids = [0] * out, [0] * total
            self.params, self.finish_reason = greedy(limit), None

    inflight = type("I", (), {"seqs": []})()
    near = Seq(out=8, total=20, limit=10)  # the in-flight token makes 9: one more step is still wanted
    inflight.seqs = [near]
    assert chainable(inflight, [near], [], 4, 1024)  # type: ignore[arg-type]
    last = Seq(out=9, total=21, limit=10)  # the in-flight token is its last
    inflight.seqs = [last]
    assert not chainable(inflight, [last], [], 4, 1024)  # type: ignore[arg-type]
    assert not chainable(inflight, [last], [], 4, 22)  # type: ignore[arg-type]  (the context is full too)
    inflight.seqs = [near]
    assert not chainable(inflight, [near], [object()], 4, 1024)  # type: ignore[arg-type]  (one waits to start)
    assert chainable(inflight, [near], [object()], 1, 1024)  # type: ignore[arg-type]  (no room for it anyway)


def test_chained_steps_are_counted_as_decode_steps(engine: Engine) -> None:
    """Every queued step is one decode step in the engine's counters (the /metrics step split), chained or not."""
    counts = []
    prompt = chat(engine, "Say something.")
    for on in (False, True):
        engine.step_counters.reset()
        got, counted = run(engine, [(prompt, greedy(12, ignore_eos=True))], on=on)
        steps = engine.stats().steps
        counts.append((steps["mixed_steps"], steps["decode_steps"]))
        assert steps["mixed_steps"] + steps["decode_steps"] == counted.calls and got[0][2] == "length"
    # 12 tokens: the first from the prompt's last chunk, then 11 decode steps
    assert counts[0] == counts[1] and sum(counts[0]) == -(-len(prompt) // engine.prefill_chunk) + 11
