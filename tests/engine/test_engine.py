"""Engine behaviour on the real smollm2-135m model: batching, chunked prefill, prefix reuse, abort, stops, seeds, limits."""
from __future__ import annotations

import pytest
import torch

from fluxion_lite.model.attention import SeqChunk
from fluxion_lite.engine.engine import Engine
from fluxion_lite.errors import RequestError
from fluxion_lite.engine.sampling import SamplingParams

MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def engine() -> Engine:
    # dequantised fp32 weights: the answers these tests read ("Paris") are the fp32 model's; with the file's 4-bit
    # blocks smollm2-135m answers as llama.cpp does on the same file (tests/engine/test_quantized_model.py)
    return Engine(MODEL, max_context=1024, prefill_chunk=32, dtype="float32")


def run_all(engine: Engine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


def chat_ids(engine: Engine, text: str) -> list[int]:
    assert engine.tokenizer is not None
    return engine.tokenizer.encode(engine.tokenizer.apply_chat_template([{"role": "user", "content": text}]))


def test_packed_ragged_batch_matches_single_sequences(engine: Engine) -> None:
    a = chat_ids(engine, "Name a colour.")
    b = chat_ids(engine, "Write one sentence about the history of Rome and its emperors.")
    attn, model = engine.attn, engine.model
    singles = []
    for i, ids in enumerate((a, b)):
        attn.allocate(1000 + i)
        singles.append(model.forward(torch.tensor(ids), torch.arange(len(ids)), [SeqChunk(1000 + i, 0, len(ids))], attn))
        attn.free(1000 + i)
    attn.allocate(2000)
    attn.allocate(2001)
    packed = model.forward(
        torch.tensor(a + b),
        torch.cat([torch.arange(len(a)), torch.arange(len(b))]),
        [SeqChunk(2000, 0, len(a)), SeqChunk(2001, 0, len(b))],
        attn,
    )
    attn.free(2000)
    attn.free(2001)
    assert torch.allclose(packed[0], singles[0][0], atol=1e-3)
    assert torch.allclose(packed[1], singles[1][0], atol=1e-3)


def test_concurrent_greedy_requests_equal_solo_runs(engine: Engine) -> None:
    prompts = ["What is 2+2?", "Tell me about cats.", "Give me a short list of fruits please."]
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    solo = {}
    for p in prompts:
        rid = engine.add_request(chat_ids(engine, p), greedy)
        solo[p] = run_all(engine)[rid]
    rids = {engine.add_request(chat_ids(engine, p), greedy): p for p in prompts}
    together = run_all(engine)
    for rid, p in rids.items():
        assert together[rid] == solo[p]


def test_short_request_decodes_while_long_prompt_prefills(engine: Engine) -> None:
    long_ids = chat_ids(engine, "Summarise this: " + "the quick brown fox jumps over the lazy dog " * 30)
    assert len(long_ids) > 8 * engine.prefill_chunk
    short = engine.add_request(chat_ids(engine, "Hi"), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    engine.step()  # admit + prefill the short prompt
    long = engine.add_request(long_ids, SamplingParams(temperature=0.0, max_tokens=1))
    first_long_token_step = None
    short_done_step = None
    step = 0
    while engine.has_unfinished():
        step += 1
        for out in engine.step():
            if out.request_id == short and out.finished:
                short_done_step = step
            if out.request_id == long and out.new_token_ids and first_long_token_step is None:
                first_long_token_step = step
    assert short_done_step is not None and first_long_token_step is not None
    assert short_done_step < first_long_token_step  # the long prefill was chunked, not run in one blocking step


def test_step_counters_tell_prefill_chunks_from_decode_steps(engine: Engine) -> None:
    ids = chat_ids(engine, "Summarise this: " + "a stitch in time saves nine " * 12)
    engine.step_counters.reset(engine.model.graphs)
    engine.add_request(ids, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    cached = None
    while engine.has_unfinished():
        for out in engine.step():
            cached = out.cached_tokens  # the chat template's prefix may come from the prefix cache
    assert cached is not None
    chunks = -(-(len(ids) - cached) // engine.prefill_chunk)
    assert chunks >= 3
    steps = engine.stats().steps
    # every chunk of the prompt is a mixed step (the last one samples the first token); then one step per token
    assert (steps["mixed_steps"], steps["decode_steps"]) == (chunks, 4)
    assert steps["mixed_s"] > 0 and steps["decode_s"] > 0
    assert ("graph_captures" in steps) == (engine.model.graphs is not None)


def test_prefix_reuse_skips_shared_prefix_and_matches_fresh_run(engine: Engine) -> None:
    assert engine.tokenizer is not None
    tok = engine.tokenizer
    turn1 = [{"role": "user", "content": "What is the capital of Italy?"}]
    rid = engine.add_request(tok.encode(tok.apply_chat_template(turn1)), SamplingParams(temperature=0.0, max_tokens=10))
    reply = tok.decode(run_all(engine)[rid])
    turn2 = turn1 + [{"role": "assistant", "content": reply}, {"role": "user", "content": "And of Spain?"}]
    ids2 = tok.encode(tok.apply_chat_template(turn2))
    rid2 = engine.add_request(ids2, SamplingParams(temperature=0.0, max_tokens=10))
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == rid2]
    assert outs[-1].cached_tokens > 20  # the system prompt and first turn were not recomputed
    fresh = Engine(MODEL, max_context=1024, prefix_cache_entries=0)
    rid3 = fresh.add_request(ids2, SamplingParams(temperature=0.0, max_tokens=10))
    assert run_all(fresh)[rid3] == [t for o in outs for t in o.new_token_ids]


def test_abort_frees_kv_immediately() -> None:
    eng = Engine(MODEL, max_context=512, prefix_cache_entries=0)
    base = eng.stats()
    rid = eng.add_request(chat_ids(eng, "Count to one hundred."), SamplingParams(temperature=0.0, max_tokens=200))
    for _ in range(3):
        eng.step()
    assert eng.stats().kv_bytes_host > base.kv_bytes_host
    eng.abort(rid)
    assert eng.stats().kv_bytes_host == base.kv_bytes_host
    outs = eng.step()
    assert [o.finish_reason for o in outs] == ["abort"]
    assert not eng.has_unfinished()


def test_stop_string_truncates_and_finishes(engine: Engine) -> None:
    ids = chat_ids(engine, "What is the capital of France?")
    rid = engine.add_request(ids, SamplingParams(temperature=0.0, max_tokens=30))
    full = ""
    while engine.has_unfinished():
        full += "".join(o.new_text for o in engine.step() if o.request_id == rid)
    assert "Paris" in full
    rid = engine.add_request(ids, SamplingParams(temperature=0.0, max_tokens=30, stop=["Paris"]))
    text, reasons = "", []
    while engine.has_unfinished():
        for o in engine.step():
            text += o.new_text
            reasons.append(o.finish_reason)
    assert text == full[: full.index("Paris")]
    assert reasons[-1] == "stop"


def test_seed_makes_sampling_reproducible(engine: Engine) -> None:
    ids = chat_ids(engine, "Invent a name for a dragon.")
    params = dict(temperature=1.0, top_p=0.95, max_tokens=12, ignore_eos=True)
    runs = []
    for seed in (7, 7, 8):
        rid = engine.add_request(ids, SamplingParams(seed=seed, **params))
        runs.append(run_all(engine)[rid])
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ("", SamplingParams(), "prompt is empty"),
        ([], SamplingParams(), "prompt is empty"),
        ("hello", SamplingParams(max_tokens=0), "max_tokens"),
        ("hello", SamplingParams(max_tokens=10**9), "exceeds the context length"),
        ("word " * 2000, SamplingParams(max_tokens=1), "context length is 1024"),
        ([10**7], SamplingParams(), "outside the vocabulary"),
        ("hello", SamplingParams(top_p=0.0), "top_p"),
        ("hello", SamplingParams(temperature=-1.0), "temperature"),
        ("hello", SamplingParams(stop=[""]), "stop"),
    ],
)
def test_bad_requests_are_rejected_with_a_reason(engine: Engine, prompt: object, params: SamplingParams, message: str) -> None:
    with pytest.raises(RequestError, match=message):
        engine.add_request(prompt, params)  # type: ignore[arg-type]
    assert not engine.has_unfinished()
