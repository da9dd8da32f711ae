"""The real smollm2-135m for the sparse-decode tests: the engine (one per test module), its essay prompt and the
logits of a prefill-then-decode through any attention backend."""
from __future__ import annotations

import pytest
import torch

from fluxion_lite.engine.engine import Engine
from fluxion_lite.model.attention import SeqChunk
from fluxion_lite.offline.eval_text import essay_text

MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def engine() -> Engine:
    # dequantised fp32 weights: these tests compare attention paths to 1e-3, and the quantized default's 8-bit
    # activation blocks turn the host store's bf16 rounding into rounding-step jumps downstream
    return Engine(MODEL, attention="full", max_context=2048, prefix_cache_entries=0, dtype="float32")


def decode_logits(engine: Engine, attn: object, tokens: list[int], n_decode: int) -> torch.Tensor:
    n_prefix = len(tokens) - n_decode
    attn.allocate(0)  # type: ignore[attr-defined]
    for s in range(0, n_prefix, 256):
        n = min(256, n_prefix - s)
        engine.model.forward(torch.tensor(tokens[s : s + n]), torch.arange(s, s + n), [SeqChunk(0, s, n)], attn)  # type: ignore[arg-type]
    rows = [engine.model.forward(torch.tensor([tokens[p]]), torch.tensor([p]), [SeqChunk(0, p, 1)], attn)[0]  # type: ignore[arg-type]
            for p in range(n_prefix, len(tokens))]
    attn.free(0)  # type: ignore[attr-defined]
    return torch.stack(rows)


@pytest.fixture(scope="module")
def essay_tokens(engine: Engine) -> list[int]:
    assert engine.tokenizer is not None
    return engine.tokenizer.encode(essay_text()[:8000])[:700]
