"""The CPU default keeps the GGUF file's block formats (model/quantized.py): the model's matrices are the file's
memory-mapped blocks, and its logits follow the dequantised fp32 model's up to the 8-bit activation rounding."""
from __future__ import annotations

import pytest
import torch

from fluxion_lite.engine.engine import Engine, resolve_dtype
from fluxion_lite.errors import RequestError
from fluxion_lite.model.attention import DenseAttention, SeqChunk
from fluxion_lite.model.quantized import PREFILL_ROWS, QuantLinear
from fluxion_lite.model.transformer import Transformer

MODEL = "smollm2-135m"  # Q4_1 matrices, a Q8_0 embedding (tied output)


@pytest.fixture(scope="module")
def engines() -> tuple[Engine, Engine]:
    return (Engine(MODEL, max_context=1024, prefix_cache_entries=0),
            Engine(MODEL, dtype="float32", max_context=1024, prefix_cache_entries=0))


def forward_logits(model: Transformer, tokens: list[int], one_by_one: bool) -> torch.Tensor:
    """Logits [T, V] of every position: as one prefill (T rows at once), or token by token (decode steps)."""
    cfg = model.cfg
    attn = DenseAttention(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, model.dtype, model.device)
    attn.allocate(0)
    if not one_by_one:
        return model.forward(torch.tensor(tokens), torch.arange(len(tokens)), [SeqChunk(0, 0, len(tokens))], attn,
                             logit_rows=torch.arange(len(tokens)))
    rows = [model.forward(torch.tensor([t]), torch.tensor([i]), [SeqChunk(0, i, 1)], attn) for i, t in enumerate(tokens)]
    return torch.cat(rows)


def test_auto_keeps_the_files_blocks_on_the_cpu(engines: tuple[Engine, Engine]) -> None:
    quantized, dense = engines
    assert resolve_dtype("auto", "cpu") == (torch.float32, True)
    assert resolve_dtype("auto", "cuda") == (torch.bfloat16, False)
    assert quantized.weights == "gguf" and dense.weights == "float32"
    lw = quantized.model.layers[0]
    assert isinstance(lw.wqkv, QuantLinear) and [p.name for p in lw.wqkv.parts] == ["Q4_1"] * 3
    assert isinstance(quantized.model.embed, QuantLinear) and quantized.model.embed.parts[0].name == "Q8_0"
    # the layers' matrices hold the file's bytes: 4-bit blocks are ~5x smaller than fp32
    dense_bytes = sum(w.numel() * 4 for w in (dense.model.layers[0].wqkv, dense.model.layers[0].w_gate_up))
    assert (lw.wqkv.nbytes + lw.w_gate_up.nbytes) * 5 < dense_bytes
    with pytest.raises(RequestError, match="dtype='int3'"):
        Engine(MODEL, dtype="int3")


def test_quantized_logits_follow_the_dequantised_model(engines: tuple[Engine, Engine]) -> None:
    quantized, dense = engines
    tok = quantized.tokenizer
    assert tok is not None
    ids = tok.encode("The quick brown fox jumps over the lazy dog. Once upon a time, in a land far away,",
                     add_special=False)[:24]
    q_steps = forward_logits(quantized.model, ids, one_by_one=True)  # the quantized kernels (one row per call)
    d_steps = forward_logits(dense.model, ids, one_by_one=True)
    # the same weights; only the activations' 8-bit blocks differ: the argmax agrees almost everywhere and the
    # logits stay close. For scale: llama.cpp's own logits on these tokens (the same file, 8-bit activations) are
    # 4.9% (mean) / 13.8% (max) from the dequantised fp32 model's, relative norm per position; ours 4.2-4.4% mean,
    # 8.6-13.7% max (the fp32 side's sums depend on torch's thread count)
    agree = (q_steps.argmax(-1) == d_steps.argmax(-1)).float().mean().item()
    assert agree >= 0.9
    rel = (q_steps - d_steps).norm(dim=-1) / d_steps.norm(dim=-1)
    assert rel.mean().item() < 0.06 and rel.max().item() < 0.2


def test_prefill_rows_and_decode_rows_agree(engines: tuple[Engine, Engine]) -> None:
    """A prefill of more than PREFILL_ROWS rows runs fp32 GEMMs over the dequantised weights; decode rows run the
    native layer (quantized kernels, fused norms and RoPE): both compute the same model, up to the activation
    rounding."""
    quantized, _ = engines
    tok = quantized.tokenizer
    assert tok is not None
    # text, not arbitrary ids: on a run of unrelated tokens the logits are flat and near-ties flip either way
    ids = tok.encode("Once upon a time there was a small village by the sea. Every morning the fishermen went out "
                     "in their boats, and every evening they came back with the day's catch, which the whole village "
                     "shared at a long table under the old oak tree.", add_special=False)[: PREFILL_ROWS + 8]
    assert len(ids) == PREFILL_ROWS + 8
    prefill = forward_logits(quantized.model, ids, one_by_one=False)
    steps = forward_logits(quantized.model, ids, one_by_one=True)
    assert (prefill.argmax(-1) == steps.argmax(-1)).float().mean().item() >= 0.9
    rel = (prefill - steps).norm(dim=-1) / prefill.norm(dim=-1)
    assert rel.mean().item() < 0.06 and rel.max().item() < 0.2


def test_quant_linear_dense_and_rows_match_the_products() -> None:
    from fluxion_lite.model.gguf_loader import load_gguf
    from fluxion_lite.hub.catalog import get_model, local_path
    from fluxion_lite.model.quantized import DequantScratch

    loaded = load_gguf(local_path(get_model(MODEL)), quantized=True)
    scratch = DequantScratch(bf16=False)
    qkv = QuantLinear([loaded.tensors[f"blk.3.attn_{x}.weight"] for x in "qkv"], scratch)
    dense = qkv.dense()  # [n_out, k] fp32
    x = torch.randn(3, qkv.k)
    for rows in (1, 3):  # one row: the parts write into one buffer; several: concatenated
        want = x[:rows] @ dense.T
        # x rounded to 8 bits per 32-block: ~0.5% of the product's norm
        assert ((qkv(x[:rows]) - want).norm() / want.norm()).item() < 0.02
    big = torch.randn(PREFILL_ROWS + 1, qkv.k)  # the prefill path: exact fp32 GEMM over the dequantised weight
    torch.testing.assert_close(qkv(big), big @ dense.T, rtol=1e-4, atol=1e-4)
    # bf16 prefill GEMMs (where the CPU has native bf16): weights and activations rounded to 8-bit mantissas
    qkv16 = QuantLinear(qkv.parts, DequantScratch(bf16=True))
    want = big @ dense.T
    assert ((qkv16(big) - want).norm() / want.norm()).item() < 1e-2
    embed = QuantLinear([loaded.tensors["token_embd.weight"]], scratch)
    ids = torch.tensor([0, 5, 49151, 5])
    torch.testing.assert_close(embed.rows(ids), embed.dense()[ids])


def test_native_layer_and_the_torch_layer_agree(engines: tuple[Engine, Engine]) -> None:
    """Decode rows run each layer as two native calls (model/quantized.py: native_layer); the same layer through the
    torch operations and QuantLinear products gives the same q/k/v and residual stream to fp32 rounding (both
    quantize the same activations)."""
    model = engines[0].model
    cfg = model.cfg
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, cfg.d_model, generator=g)
    o = torch.randn(3, cfg.n_heads, cfg.head_dim, generator=g)
    positions = torch.tensor([5, 17, 300])
    cs = model.rope.ensure(400)[positions][:, :, None, :]  # [T, 2, 1, R]: embed_tokens' layout
    lw = model.layers[2]
    assert lw.native is not None
    fused_qkv = model.pre_attention(lw, x, cs[:, 0], cs[:, 1])
    fused_x = model.post_attention(lw, x.clone(), o)
    native, lw.native = lw.native, None
    try:
        plain_qkv = model.pre_attention(lw, x, cs[:, 0], cs[:, 1])
        plain_x = model.post_attention(lw, x.clone(), o)
    finally:
        lw.native = native
    for a, b in zip(fused_qkv, plain_qkv):
        assert ((a - b).norm() / b.norm()).item() < 1e-5
    assert ((fused_x - plain_x).norm() / (plain_x - x).norm()).item() < 1e-5


def test_a_one_sequence_decode_step_is_one_native_call_with_the_same_logits(
        engines: tuple[Engine, Engine], monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode step of one sequence in the dense cache runs every layer in one native call (NativeDecoder);
    its logits and cache are the per-layer path's, bit for bit, and a batch of two takes the per-layer path."""
    model = engines[0].model
    assert model.native_decoder is not None
    calls: list[int] = []
    step = type(model.native_decoder).step
    monkeypatch.setattr(type(model.native_decoder), "step", lambda self, *a: (calls.append(a[4]), step(self, *a)))
    tokens = [1, 504, 3120, 28, 260, 4376, 30, 4399, 314, 253, 1435, 288, 4120, 30]
    fused = forward_logits(model, tokens, one_by_one=True)
    assert calls == list(range(len(tokens)))  # every step, at its position
    decoder, model.native_decoder = model.native_decoder, None
    try:
        per_layer = forward_logits(model, tokens, one_by_one=True)
    finally:
        model.native_decoder = decoder
    assert torch.equal(fused, per_layer)
    cfg = model.cfg
    attn = DenseAttention(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, model.dtype, model.device)
    for seq in (0, 1):
        attn.allocate(seq)
    calls.clear()
    model.forward(torch.tensor([5, 6]), torch.tensor([0, 0]), [SeqChunk(0, 0, 1), SeqChunk(1, 0, 1)], attn)
    assert calls == [] and attn.seq_len(0) == attn.seq_len(1) == 1


@pytest.mark.parametrize("background", ["off", "retrieval"])
def test_a_fluxion_decode_step_is_one_native_call_with_the_same_logits(
        engines: tuple[Engine, Engine], monkeypatch: pytest.MonkeyPatch, background: str) -> None:
    """On the CPU a static-plan fluxion step (two sequences, pinned blocks) runs every layer in one native call
    (SparseDecodeStep); its logits are the per-layer path's, bit for bit. With the unread-background term a step
    keeps the per-layer path."""
    from fluxion_lite.engine.engine import make_attention
    from fluxion_lite.hostkv.layer import SparseDecodeStep
    from fluxion_lite.plan.sparse_plan import SparsePlan

    model = engines[0].model
    cfg = model.cfg
    calls: list[int] = []
    run = SparseDecodeStep.run
    monkeypatch.setattr(SparseDecodeStep, "run", lambda self, *a: (calls.append(self.m), run(self, *a))[1])
    prompts = [engines[0].tokenizer.encode("The quick brown fox " * 60)[:230],  # type: ignore[union-attr]
               engines[0].tokenizer.encode("A long letter about the sea and ships. " * 40)[:190]]  # type: ignore[union-attr]

    def decode(native: bool) -> torch.Tensor:
        plan = SparsePlan.uniform(cfg.n_layers, cfg.n_kv_heads, g=16, budget=0.3, sink=16, window=48)
        plan.pin_fraction, plan.background = 0.5, background
        attn = make_attention("fluxion", cfg, torch.float32, torch.device("cpu"), 2, MODEL, plan=plan)
        decoder = model.native_decoder
        model.native_decoder = decoder if native else None
        try:
            for seq, p in enumerate(prompts):
                attn.allocate(seq, len(p))
                model.forward(torch.tensor(p), torch.arange(len(p)), [SeqChunk(seq, 0, len(p))], attn)
            rows, nxt = [], [p[-1] for p in prompts]
            for i in range(4):
                chunks = [SeqChunk(seq, len(p) + i, 1) for seq, p in enumerate(prompts)]
                logits = model.forward(torch.tensor(nxt), torch.tensor([c.start for c in chunks]), chunks, attn)
                rows.append(logits)
                nxt = logits.argmax(-1).tolist()
            return torch.stack(rows)
        finally:
            model.native_decoder = decoder

    fused = decode(native=True)
    # the first decode step still ends the prefill (it drops the dense scratch): per layer; then one call each
    assert calls == ([2] * 3 if background == "off" else [])
    assert torch.equal(fused, decode(native=False))
