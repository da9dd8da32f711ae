"""The lean forward (fused q/k/v and gate/up matmuls, table RoPE applied in place, addmm_ residuals, SDPA decode, logit
rows) against a plain unfused float64 forward (support/tiny_model.py), on random weights; plus the pieces on their
own."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fluxion_lite.model.attention import DenseAttention, SeqChunk, causal_attention, decode_attention
from fluxion_lite.model.gguf_loader import GGUFModel
from fluxion_lite.model.kv_cache import INITIAL_CAPACITY, DenseKVCache
from fluxion_lite.model.transformer import MIN_ROPE_POSITIONS, RotaryEmbedding, Transformer, prepack_supported
from tiny_model import F64, make_cfg, random_weights, rope_formula, unfused_logits


CASES = {"llama": ("llama", None), "qwen2-bias": ("qwen2", None), "llama-partial-rope": ("llama", 8),
         "qwen2-partial-rope": ("qwen2", 8)}


@pytest.mark.parametrize("name", list(CASES))
def test_lean_forward_equals_unfused_reference(name: str) -> None:
    """Prefill, a 3-sequence decode batch, a mixed batch, and batch-1 decode all equal the unfused float64 forward."""
    arch, rope_dim = CASES[name]
    cfg = make_cfg(arch, rope_dim)
    w = random_weights(cfg, seed=len(name))
    model = Transformer(GGUFModel(Path(name), cfg, {}, w), "cpu", F64)
    g = torch.Generator().manual_seed(7)
    seqs = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in (30, 22, 26)]
    refs = [unfused_logits(cfg, w, s) for s in seqs]
    attn = DenseAttention(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, F64, torch.device("cpu"))
    for i in range(3):
        attn.allocate(i)

    def run(pieces: list[tuple[int, int, int]], logit_rows: torch.Tensor | None = None) -> torch.Tensor:
        chunks = [SeqChunk(i, s, n) for i, s, n in pieces]
        toks = torch.cat([seqs[i][s : s + n] for i, s, n in pieces])
        pos = torch.cat([torch.arange(s, s + n) for _, s, n in pieces])
        return model.forward(toks, pos, chunks, attn, logit_rows=logit_rows)

    def check(got: torch.Tensor, want: torch.Tensor) -> None:
        assert got.shape == want.shape
        # the model computes in float64 here but returns fp32 logits: the only error left is that final rounding
        assert (got.double() - want).abs().max() < 1e-6 * want.abs().max()

    # prefill: all rows (identity rows), then the default (last row of each chunk)
    out = run([(0, 0, 20), (1, 0, 12)], logit_rows=torch.arange(32))
    check(out[:20], refs[0][:20])
    check(out[20:], refs[1][:12])
    check(run([(2, 0, 15)]), refs[2][14:15])
    # decode batch of three sequences at different lengths, default rows (every row)
    for step in range(4):
        out = run([(0, 20 + step, 1), (1, 12 + step, 1), (2, 15 + step, 1)])
        for b, p in enumerate((20 + step, 12 + step, 15 + step)):
            check(out[b : b + 1], refs[b][p : p + 1])
    # mixed: sequence 0 decodes while 1 prefills 5 tokens; only some rows asked for, out of order
    out = run([(0, 24, 1), (1, 16, 5)], logit_rows=torch.tensor([5, 0, 2]))
    check(out, torch.stack([refs[1][20], refs[0][24], refs[1][17]]))
    # batch-1 decode to the end of sequence 2
    for p in range(19, 26):
        check(run([(2, p, 1)]), refs[2][p : p + 1])


def test_rope_table_equals_formula_and_grows() -> None:
    for arch, rd in (("llama", None), ("qwen2", None), ("llama", 8)):
        cfg = make_cfg(arch, rd)
        rope = RotaryEmbedding(cfg, torch.device("cpu"), F64)
        pos = torch.tensor([0, 1, 17, MIN_ROPE_POSITIONS - 1, MIN_ROPE_POSITIONS + 5, 3 * MIN_ROPE_POSITIONS])
        x = torch.randn(len(pos), 3, cfg.head_dim, dtype=F64)
        got = rope(x, pos)
        assert rope.table.shape[0] >= 3 * MIN_ROPE_POSITIONS + 1
        assert (got - rope_formula(x, pos, cfg)).abs().max() < 1e-12


def test_decode_attention_equals_tiled_path() -> None:
    g = torch.Generator().manual_seed(3)
    for hq, hkv, total in ((8, 2, 300), (7, 1, 5), (4, 4, 1)):
        q = torch.randn(1, hq, 32, generator=g, dtype=F64)
        big_k = torch.randn(hkv, total + 40, 32, generator=g, dtype=F64)  # a cache buffer with spare capacity
        big_v = torch.randn(hkv, total + 40, 32, generator=g, dtype=F64)
        k, v = big_k[:, :total], big_v[:, :total]
        fused = decode_attention(q, k, v, 32**-0.5)
        s = torch.einsum("hd,hkd->hk", q[0], k.repeat_interleave(hq // hkv, 0)) * 32**-0.5
        ref = torch.einsum("hk,hkd->hd", s.softmax(-1), v.repeat_interleave(hq // hkv, 0))[None]
        assert (fused - ref).abs().max() < 1e-12
        assert (causal_attention(q, k, v, total - 1, 32**-0.5) - ref).abs().max() < 1e-12


def test_kv_cache_growth_keeps_layer_views() -> None:
    cache = DenseKVCache(3, 2, 4, F64, torch.device("cpu"))
    cache.allocate(0)
    n = INITIAL_CAPACITY * 2 + 3  # two doublings
    k = torch.randn(n, 2, 4, dtype=F64)
    v = torch.randn(n, 2, 4, dtype=F64)
    for p in range(0, n, 97):
        e = min(n, p + 97)
        for layer in range(3):
            kk, vv = cache.append(layer, 0, p, k[p:e] + layer, v[p:e] - layer)
            assert kk.shape == (2, e, 4)
    for layer in range(3):
        kk, vv = cache.view(layer, 0)
        assert torch.equal(kk, (k + layer).transpose(0, 1)) and torch.equal(vv, (v - layer).transpose(0, 1))
    cache.free(0)
    cache.allocate(0)  # a freed id can be reused
    assert cache.seq_len(0) == 0


@pytest.mark.skipif(not prepack_supported(torch.device("cpu"), torch.bfloat16), reason="no oneDNN bf16 prepacking here")
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_prepacked_bf16_equals_plain_bf16(arch: str) -> None:
    """The oneDNN-packed CPU bf16 path (packed q/k/v, gate/up, down, wo twin, untied and tied vocab matmul) gives the
    plain bf16 path's logits up to bf16 rounding, through prefill and decode."""
    cfg = make_cfg(arch)
    w = random_weights(cfg, seed=3)
    models = [Transformer(GGUFModel(Path(arch), cfg, {}, w), "cpu", torch.bfloat16, prepack=p) for p in (False, True)]
    assert not models[0].prepacked and models[1].prepacked and models[1].layers[0].wqkv.is_mkldnn
    assert not models[1].layers[0].wo.is_mkldnn  # other modules read wo as a plain tensor
    toks = torch.randint(0, cfg.vocab_size, (20,), generator=torch.Generator().manual_seed(1))
    outs = []
    for m in models:
        attn = DenseAttention(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, torch.bfloat16, torch.device("cpu"))
        attn.allocate(0)
        rows = [m.forward(toks[:12], torch.arange(12), [SeqChunk(0, 0, 12)], attn, logit_rows=torch.arange(12))]
        rows += [m.forward(toks[p : p + 1], torch.tensor([p]), [SeqChunk(0, p, 1)], attn) for p in range(12, 20)]
        outs.append(torch.cat(rows))
    ref = unfused_logits(cfg, w, toks)
    scale = ref.abs().max()
    plain_err = (outs[0].double() - ref).abs().max() / scale
    packed_err = (outs[1].double() - ref).abs().max() / scale
    # both are bf16 forwards of the same float64 model (bf16 alone costs a few % of the logit range here); the
    # packed one must be no worse, and close to the plain one
    assert plain_err < 0.1 and packed_err < max(0.1, 1.2 * plain_err)
    assert (outs[1] - outs[0]).abs().max() / scale < 0.02


def test_batched_decode_across_cache_growth() -> None:
    """A decode batch of two sequences of different lengths, stepping past the cache's first capacity (256): the cache
    holds what was written and the outputs equal the tiled path's over the same keys."""
    hq, hkv, d = 6, 2, 8
    attn = DenseAttention(1, hkv, d, F64, torch.device("cpu"))
    g = torch.Generator().manual_seed(5)
    lens = {0: INITIAL_CAPACITY - 3, 1: 40}
    keys = {s: torch.randn(n + 8, hkv, d, generator=g, dtype=F64) for s, n in lens.items()}
    vals = {s: torch.randn(n + 8, hkv, d, generator=g, dtype=F64) for s, n in lens.items()}
    for s, n in lens.items():
        attn.allocate(s)
        attn.attend(0, torch.zeros(n, hq, d, dtype=F64), keys[s][:n], vals[s][:n], [SeqChunk(s, 0, n)])
    for step in range(8):
        chunks = [SeqChunk(s, n + step, 1) for s, n in lens.items()]
        q = torch.randn(2, hq, d, generator=g, dtype=F64)
        k = torch.stack([keys[c.seq_id][c.start] for c in chunks])
        v = torch.stack([vals[c.seq_id][c.start] for c in chunks])
        out = attn.attend(0, q, k, v, chunks)
        for i, c in enumerate(chunks):
            n = c.start + 1
            want = causal_attention(q[i : i + 1], keys[c.seq_id][:n].transpose(0, 1), vals[c.seq_id][:n].transpose(0, 1),
                                    c.start, d**-0.5)
            assert (out[i : i + 1] - want).abs().max() < 1e-12
            assert attn.seq_len(c.seq_id) == n
    kk, vv = attn.cache.view(0, 0)
    assert torch.equal(kk, keys[0].transpose(0, 1)) and torch.equal(vv, vals[0].transpose(0, 1))
