"""A small version of bench/parity.py: our forward vs llama.cpp on the same GGUF (smollm2-135m), with dequantised fp32
weights and, teacher-forced, with the file's blocks as the CPU default keeps them."""
from __future__ import annotations

import numpy as np
import pytest

from fluxion_lite.engine.engine import Engine
from fluxion_lite.offline.eval_text import essay_text
from fluxion_lite.offline.llamacpp_peer import greedy_continuation, load_peer, teacher_forced_logits as peer_logits
from fluxion_lite.engine.sampling import SamplingParams
from fluxion_lite.offline.teacher_forcing import teacher_forced_logits

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pair() -> tuple[Engine, object]:
    engine = Engine("smollm2-135m", prefix_cache_entries=0, dtype="float32")
    return engine, load_peer(engine.model_path, n_ctx=640)


@pytest.mark.parametrize("dtype", ["float32", "auto"])
def test_teacher_forced_top1_matches_llamacpp_where_it_is_confident(pair: tuple[Engine, object], dtype: str) -> None:
    engine, peer = pair
    if dtype != "float32":  # the CPU default: the file's 4-bit blocks, 8-bit activations (model/quantized.py)
        engine = Engine("smollm2-135m", prefix_cache_entries=0, dtype=dtype)
    assert engine.tokenizer is not None
    tokens = engine.tokenizer.encode(essay_text()[:6000])[:512]
    ref = peer_logits(peer, tokens)
    ours = teacher_forced_logits(engine.model, engine.attn, tokens).numpy()
    top2 = np.partition(ref, -2, axis=1)[:, -2:]
    confident = np.abs(top2[:, 1] - top2[:, 0]) >= 0.5
    agree = ours.argmax(1) == ref.argmax(1)
    assert confident.sum() > 200
    assert agree[confident].all()
    assert agree.mean() >= 0.93


def test_greedy_chat_diverges_only_at_near_ties(pair: tuple[Engine, object]) -> None:
    engine, peer = pair
    tok = engine.tokenizer
    assert tok is not None
    identical = 0
    for prompt in ("What is the capital of France?", "List three primary colours.", "What is 12 plus 30?"):
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": prompt}]))
        ref, gaps = greedy_continuation(peer, ids, 16, tok.eog_ids)
        rid = engine.add_request(ids, SamplingParams(temperature=0.0, max_tokens=16))
        ours: list[int] = []
        while engine.has_unfinished():
            ours += [t for o in engine.step() if o.request_id == rid for t in o.new_token_ids]
        diff = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
        if diff is None:
            identical += 1
        else:
            # a near tie, by the same 0.5 as above: llama.cpp rounds every matmul input to 8 bits (Q8 blocks), which
            # moves its logits against our exact fp32 forward by a std of 0.12-0.16 on these prompts; on an AVX2-only
            # VM (AMD EPYC) it chose 'L' over 'The' for the first prompt by 0.35, and our forward with its activation
            # rounding emulated (research/parity_activation_quant.py's q8_round) chooses 'L' too
            assert gaps[diff] < 0.5, f"{prompt!r}: diverged at token {diff} where llama.cpp's top-2 gap is {gaps[diff]}"
    assert identical >= 1


def test_the_peer_loads_without_repacking_buffers() -> None:
    """Llama.__init__ takes its model params from the bindings module: inside load_peer's patch they come without
    the extra (repacking) buffer types, whose AMX path segfaults in llama_decode; outside it, unchanged."""
    import llama_cpp.llama_cpp as bindings

    from fluxion_lite.offline.llamacpp_peer import _no_extra_buffer_types

    default = bool(bindings.llama_model_default_params().use_extra_bufts)
    with _no_extra_buffer_types():
        assert bindings.llama_model_default_params().use_extra_bufts is False
    assert bool(bindings.llama_model_default_params().use_extra_bufts) == default
