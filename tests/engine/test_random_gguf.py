"""bench/random_gguf.py: random-weight GGUF files of the benchmark shapes in llama.cpp's formats. The tiny shape's
files load in our engine and in llama.cpp (llama-cpp-python), and the two agree on them; the Q4_K_M recipe puts
Q6_K where llama.cpp's llama-quant.cpp does; every block's fp16 scales are finite."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from fluxion_lite.engine.engine import Engine
from fluxion_lite.model.gguf_loader import read_metadata
from fluxion_lite.offline.teacher_forcing import teacher_forced_logits

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import random_gguf  # noqa: E402


def test_q4_k_m_puts_q6_k_where_llama_cpp_does() -> None:
    n = 32  # Llama-3.1-8B: 32 layers
    more = [i for i in range(n) if random_gguf.use_more_bits(i, n)]
    assert more == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    assert random_gguf.tensor_type("output.weight", n, "q4_k_m") == "Q6_K"
    assert random_gguf.tensor_type("token_embd.weight", n, "q4_k_m") == "Q4_K"
    assert random_gguf.tensor_type("blk.6.ffn_down.weight", n, "q4_k_m") == "Q6_K"
    assert random_gguf.tensor_type("blk.7.attn_v.weight", n, "q4_k_m") == "Q4_K"
    assert random_gguf.tensor_type("blk.7.attn_q.weight", n, "q4_k_m") == "Q4_K"
    assert random_gguf.tensor_type("blk.7.attn_q.weight", n, "q8_0") == "Q8_0"


@pytest.mark.parametrize("kind", sorted(random_gguf.BLOCK_BYTES))
def test_random_blocks_decode_to_small_zero_mean_values(kind: str) -> None:
    """Every type's random blocks, dequantised by our native kernels: finite, near zero mean, spread ~0.02 (trained
    weights' order), so a twin's activations stay finite through its layers."""
    from fluxion_lite.hostkv.quant import QuantWeight

    blocks = random_gguf.random_blocks(kind, 4096, np.random.default_rng(0))
    assert blocks.shape == (4096, random_gguf.BLOCK_BYTES[kind])
    k = random_gguf.BLOCK_ELEMS[kind] * 16
    weight = QuantWeight(kind, blocks.reshape(-1), blocks.size // (16 * random_gguf.BLOCK_BYTES[kind]), k)
    values = np.asarray(weight.dequantize(), dtype=np.float64)
    assert np.isfinite(values).all()
    assert abs(values.mean()) < 0.15 * values.std() and 0.005 < values.std() < 0.05  # Q4_0, Q5_0: mean -d / 2


def test_a_twin_has_its_models_header_tensors_and_size(tmp_path: Path) -> None:
    """--header-of then --like: the twin of smollm2-135m (Q4_1 / Q8_0 / F32) has the real file's metadata,
    tensor names, types and shapes and size, and decodes in our engine (its tokenizer is the real one)."""
    import gguf

    from fluxion_lite.hub.resolve import resolve_model
    from fluxion_lite.engine.sampling import SamplingParams

    real = resolve_model("smollm2-135m", pull_missing=False)
    header = tmp_path / "smollm2.header"
    random_gguf.write_header_of(real, header)
    assert header.stat().st_size < real.stat().st_size // 20
    twin = tmp_path / "twin.gguf"
    random_gguf.write_like(header, twin)
    a, b = gguf.GGUFReader(str(real)), gguf.GGUFReader(str(twin))
    assert twin.stat().st_size == real.stat().st_size
    assert [(t.name, t.tensor_type, tuple(t.shape)) for t in a.tensors] == \
        [(t.name, t.tensor_type, tuple(t.shape)) for t in b.tensors]
    assert not np.array_equal(np.asarray(a.tensors[5].data), np.asarray(b.tensors[5].data))
    engine = Engine(str(twin), attention="full", max_context=256)
    engine.add_request("Hello", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    tokens = []
    while engine.has_unfinished():
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    assert len(tokens) == 4


@pytest.mark.parametrize("ftype", random_gguf.TYPES)
def test_the_files_load_here_and_in_llama_cpp_alike(tmp_path: Path, ftype: str) -> None:
    from fluxion_lite.offline.llamacpp_peer import load_peer, teacher_forced_logits as peer_logits

    path = tmp_path / f"tiny-{ftype}.gguf"
    random_gguf.write("tiny", path, ftype)
    metadata, _ = read_metadata(path)
    assert metadata["llama.block_count"] == 4
    tokens = list(range(100, 164))
    ref = np.asarray(peer_logits(load_peer(path, n_ctx=128), tokens))  # [T, V]
    engine = Engine(str(path), load_tokenizer=False, attention="full", max_context=256)
    assert engine.weights == "gguf"  # the blocks as written, not a dequantised copy
    ours = teacher_forced_logits(engine.model, engine.attn, tokens).numpy()
    assert np.isfinite(ours).all() and ref.std() > 0.1  # not a degenerate model
    assert np.abs(ours - ref).max() < 0.03 * np.abs(ref).max()
    assert (ours.argmax(1) == ref.argmax(1)).mean() >= 0.95
