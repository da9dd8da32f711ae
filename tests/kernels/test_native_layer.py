"""The decoder layer's native calls and the dense decode attention (native/fluxion.h, "DECODER LAYER" and "DENSE
DECODE ATTENTION") against float64 references written from the header's formulas; every SIMD path this CPU
supports, 1 and N threads, odd shapes; then the errors.

Tolerances, and why:
  * decode attention: fp32 dot products, softmax and weighted sums over at most a few thousand keys, against float64:
    |out - ref| <= 2e-5 max|V| (the errors seen are ~1e-7 to 5e-7).
  * the layer with F32 weights (no activation quantization): fp32 products of a few thousand terms against float64,
    relative to the size of what is computed: <= 1e-5.
  * the layer with quantized weights: against the float64 layer over the same dequantized weights and the
    unquantized activations, the 8-bit activation step dominates (~0.5% per product, QUANTIZED WEIGHTS): relative
    error <= 3e-2; and against the same computation made of fx_qmatmul calls (QuantGroup, tested on its own) with
    numpy norms: <= 1e-4 (both quantize the same activations; an element whose fp32 norm rounds differently can
    move one 8-bit step).
"""
from __future__ import annotations


import numpy as np
import pytest
import torch

import native_quant_reference as ref
from native_layers import QUANT_MIXES, layer_ref, make_layer, rms, rope_ref, rope_rows
from fluxion_lite.hostkv import native, quant
from fluxion_lite.hostkv.layer import MAX_ROWS, LayerSpec, NativeDecoder, NativeLayer, decode_attention
from fluxion_lite.hostkv.native import ffi, lib


# ------------------------------------------------------------------------------------------ decode attention --

def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n: int, scale: float) -> torch.Tensor:
    hq, hkv = q.shape[0], k.shape[0]
    r = hq // hkv
    out = torch.empty(q.shape, dtype=torch.float64)
    for j in range(hq):
        kh, vh = k[j // r, :n].double(), v[j // r, :n].double()
        p = torch.softmax(kh @ q[j].double() * scale, 0)
        out[j] = p @ vh
    return out


ATTN_SHAPES = [  # (Hq, Hkv, D, n tokens, capacity)
    (14, 2, 64, 512, 600), (9, 3, 64, 1, 8), (8, 8, 128, 1000, 1000), (16, 1, 64, 300, 301), (6, 2, 72, 17, 40),
    (4, 4, 36, 257, 300), (12, 2, 128, 2049, 2100), (2, 1, 8, 9, 9), (3, 3, 20, 5, 5),
]


@pytest.mark.parametrize("shape", ATTN_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_decode_attention_matches_float64(path: str, shape: tuple[int, ...]) -> None:
    hq, hkv, d, n, cap = shape
    g = torch.Generator().manual_seed(hash(shape) % 2**31)
    q = torch.randn(hq, d, generator=g) * 0.5
    k = torch.randn(hkv, cap, d, generator=g)
    v = torch.randn(hkv, cap, d, generator=g)
    scale = d ** -0.5
    got = decode_attention(q, k, v, n, scale)
    want = attention_ref(q, k, v, n, scale)
    assert (got.double() - want).abs().max().item() <= 2e-5 * v[:, :n].abs().max().item()


@pytest.mark.parametrize("threads", [3, 16])
def test_decode_attention_chunks_for_a_larger_pool_match_float64(threads: int) -> None:
    """A pool of more threads splits short contexts into shorter chunks (down to FX_DECODE_MIN_CHUNK): the same
    answer for every shape, and the workspace follows the pool's size."""
    native.set_threads(threads)
    try:
        for shape in ATTN_SHAPES:
            hq, hkv, d, n, cap = shape
            g = torch.Generator().manual_seed(n * 31 + d)
            q, k, v = torch.randn(hq, d, generator=g), torch.randn(hkv, cap, d, generator=g), torch.randn(hkv, cap, d,
                                                                                                          generator=g)
            got = decode_attention(q, k, v, n, d ** -0.5)
            want = attention_ref(q, k, v, n, d ** -0.5)
            assert (got.double() - want).abs().max().item() <= 2e-5 * v[:, :n].abs().max().item(), shape
        # 300 keys, one KV head: 2 * threads items wanted -> chunks of 64 keys (3 threads: 5 items) or of the
        # minimum, 32 (16 threads: 10 items), each item an output of 16 heads x 64 plus 16 log-sum-exps
        items = {3: 5, 16: 10}[threads]
        assert lib.fx_decode_attention_workspace(16, 1, 64, 300) == items * (16 * 64 + 16)
    finally:
        native.set_threads(native.physical_cores())


@pytest.mark.parametrize("shape", ATTN_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_decode_attention_appends_the_new_token_first(path: str, shape: tuple[int, ...]) -> None:
    """k_new / v_new land at token n - 1 of every head (and nowhere else) before the attention reads them."""
    hq, hkv, d, n, cap = shape
    g = torch.Generator().manual_seed(n * 7 + hq)
    q = torch.randn(hq, d, generator=g)
    k, v = torch.randn(hkv, cap, d, generator=g), torch.randn(hkv, cap, d, generator=g)
    k_new, v_new = torch.randn(hkv, d, generator=g), torch.randn(hkv, d, generator=g)
    k_before, v_before = k.clone(), v.clone()
    got = decode_attention(q, k, v, n, d ** -0.5, k_new=k_new, v_new=v_new)
    k_before[:, n - 1], v_before[:, n - 1] = k_new, v_new
    assert torch.equal(k, k_before) and torch.equal(v, v_before)
    want = attention_ref(q, k_before, v_before, n, d ** -0.5)
    assert (got.double() - want).abs().max().item() <= 2e-5 * v[:, :n].abs().max().item()


def test_decode_attention_reads_only_the_first_n_tokens() -> None:
    q, k, v = torch.randn(4, 64), torch.randn(2, 100, 64), torch.randn(2, 100, 64)
    k[:, 50:], v[:, 50:] = float("nan"), float("nan")  # past n: never read
    got = decode_attention(q, k, v, 50, 0.125)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), attention_ref(q, k, v, 50, 0.125), rtol=1e-5, atol=1e-5)


def test_decode_attention_errors() -> None:
    q, k, v = torch.randn(6, 64), torch.randn(4, 10, 64), torch.randn(4, 10, 64)
    with pytest.raises(ValueError, match="not a multiple of KV heads"):
        decode_attention(q, k, v, 10, 0.1)  # 6 query heads over 4 KV heads
    with pytest.raises(ValueError, match="cap >= 11"):
        decode_attention(torch.randn(4, 64), k, v, 11, 0.1)
    with pytest.raises(ValueError, match="float32"):
        decode_attention(torch.randn(4, 64).double(), k, v, 5, 0.1)
    with pytest.raises(ValueError, match="one layout"):
        decode_attention(torch.randn(4, 64), k, torch.randn(4, 12, 64), 5, 0.1)
    # the C checks on their own: a short workspace, a head stride below len * D, no tokens
    fp = lambda t: ffi.cast("float *", t.data_ptr())  # noqa: E731
    out = torch.empty(4, 64)
    need = lib.fx_decode_attention_workspace(4, 4, 64, 10)
    work = torch.empty(need)
    args = (fp(q[:4].contiguous()), 4, 4, 64, fp(k), fp(v))
    none = ffi.NULL
    assert lib.fx_decode_attention(*args, 640, 10, none, none, 0.1, fp(out), fp(work), need - 1) == lib.FX_E_OUTPUT
    assert lib.fx_decode_attention(*args, 639, 10, none, none, 0.1, fp(out), fp(work), need) == lib.FX_E_QSHAPE
    row = torch.randn(4, 64)
    assert lib.fx_decode_attention(*args, 640, 10, fp(row), none, 0.1, fp(out), fp(work), need) == lib.FX_E_QSHAPE
    with pytest.raises(ValueError, match="both k_new and v_new"):
        decode_attention(torch.randn(4, 64), k, v, 5, 0.1, k_new=row)
    with pytest.raises(ValueError, match=r"k_new must be CPU float32 \[4, 64\]"):
        decode_attention(torch.randn(4, 64), k, v, 5, 0.1, k_new=torch.randn(4, 32), v_new=torch.randn(4, 32))
    assert lib.fx_decode_attention_workspace(4, 4, 64, 0) == -lib.FX_E_QSHAPE
    assert lib.fx_decode_attention_workspace(64, 2, 64, 5) == -lib.FX_E_GROUP  # a group of 32 > FX_MAX_GROUP


# ----------------------------------------------------------------------------------------------- the layer --

SPECS = [  # d, Hq, Hkv, D, rope_dim, neox, F
    LayerSpec(96, 6, 2, 16, 16, True, 160, 1e-6),
    LayerSpec(64, 4, 4, 16, 8, False, 96, 1e-5),   # rope over part of each head; interleaved pairs
    LayerSpec(128, 2, 1, 64, 64, False, 32, 1e-6),
]


@pytest.mark.parametrize("m", [1, 3, MAX_ROWS])
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"d{s.d}-h{s.n_heads}x{s.n_kv_heads}-r{s.rope_dim}")
def test_layer_with_f32_weights_matches_float64(path: str, spec: LayerSpec, m: int) -> None:
    rng = np.random.default_rng(spec.d * 1000 + m)
    types = dict.fromkeys(("q", "k", "v", "o", "gate", "up", "down"), 0)
    layer, f64 = make_layer(rng, spec, types, bias=spec.d != 64)
    x = torch.from_numpy(rng.standard_normal((m, spec.d))).float()
    o = torch.from_numpy(rng.standard_normal((m, spec.n_heads * spec.head_dim))).float()
    cs = rope_rows(rng, m, spec.rope_dim)
    qkv = layer.qkv(x, cs)
    x_out = x.clone()
    layer.out_mlp(x_out, o)
    want_qkv, want_x = layer_ref(spec, f64, x.double().numpy(), cs.double().numpy(), o.double().numpy())
    assert np.abs(qkv.double().numpy() - want_qkv).max() <= 1e-5 * np.abs(want_qkv).max()
    assert np.abs(x_out.double().numpy() - want_x).max() <= 1e-5 * np.abs(want_x).max()




@pytest.mark.parametrize("mix", list(QUANT_MIXES))
def test_layer_with_quantized_weights(path: str, mix: str) -> None:
    spec = LayerSpec(256, 8, 2, 32, 32, True, 512, 1e-6)
    rng = np.random.default_rng(len(mix))
    layer, f64 = make_layer(rng, spec, QUANT_MIXES[mix], bias=True)
    m = 2
    x = torch.from_numpy(rng.standard_normal((m, spec.d))).float()
    o = torch.from_numpy(rng.standard_normal((m, spec.n_heads * spec.head_dim))).float()
    cs = rope_rows(rng, m, spec.rope_dim)
    qkv = layer.qkv(x, cs).double().numpy()
    x_out = x.clone()
    layer.out_mlp(x_out, o)
    want_qkv, want_x = layer_ref(spec, f64, x.double().numpy(), cs.double().numpy(), o.double().numpy())
    assert np.linalg.norm(qkv - want_qkv) <= 3e-2 * np.linalg.norm(want_qkv)
    delta, want_delta = x_out.double().numpy() - x.double().numpy(), want_x - x.double().numpy()
    assert np.linalg.norm(delta - want_delta) <= 3e-2 * np.linalg.norm(want_delta)
    # the same products through fx_qmatmul (QuantGroup), the norms and RoPE in numpy
    w = layer._weights
    h = torch.from_numpy(rms(x.double().numpy(), f64["attn_norm"], spec.eps)).float()
    parts = quant.QuantGroup(list(w[:3])).matmul(h)
    composed = np.concatenate([p.double().numpy() for p in parts], 1) + f64["bias"]
    hq_hkv = (spec.n_heads + spec.n_kv_heads) * spec.head_dim
    composed[:, :hq_hkv] = rope_ref(composed[:, :hq_hkv], spec.n_heads + spec.n_kv_heads, spec, cs.double().numpy())
    assert np.linalg.norm(qkv - composed) <= 1e-4 * np.linalg.norm(composed)


def test_layer_errors() -> None:
    spec = LayerSpec(64, 4, 2, 16, 16, True, 96, 1e-6)
    rng = np.random.default_rng(5)
    types = dict.fromkeys(("q", "k", "v", "o", "gate", "up", "down"), 8)
    layer, _ = make_layer(rng, spec, types, bias=False)
    x = torch.randn(MAX_ROWS + 1, 64)
    with pytest.raises(ValueError, match="bad shapes"):
        layer.qkv(x, rope_rows(rng, MAX_ROWS + 1, 16))
    w = layer._weights
    with pytest.raises(ValueError, match="bad shapes"):  # a weight of the wrong role's size: k in place of q
        NativeLayer(spec, torch.ones(64), torch.ones(64), None, w[1], w[1], w[2], w[3], w[4], w[5], w[6])
    with pytest.raises(ValueError, match="bad shapes"):  # 4 query heads over 3 KV heads
        NativeLayer(LayerSpec(64, 4, 3, 16, 16, True, 96, 1e-6), torch.ones(64), torch.ones(64), None, *w)
    with pytest.raises(ValueError, match="bad shapes"):  # an odd rope_dim
        NativeLayer(LayerSpec(64, 4, 2, 16, 15, True, 96, 1e-6), torch.ones(64), torch.ones(64), None, *w)
    # the C checks: a short workspace, no rope rows when the layer rotates
    c = layer.c
    fp = lambda t: ffi.cast("float *", t.data_ptr())  # noqa: E731
    need = lib.fx_layer_workspace(c, 1)
    buf = np.empty(need, np.uint8)
    work = ffi.from_buffer("uint8_t[]", buf)
    x1, qkv = torch.randn(1, 64), torch.empty(1, layer.width)
    cs = rope_rows(rng, 1, 16)
    assert lib.fx_layer_qkv(c, fp(x1), 1, fp(cs), 32, fp(qkv), work, need - 1) == lib.FX_E_OUTPUT
    assert lib.fx_layer_qkv(c, fp(x1), 1, ffi.NULL, 32, fp(qkv), work, need) == lib.FX_E_QSHAPE
    assert lib.fx_layer_qkv(c, fp(x1), 1, fp(cs), 31, fp(qkv), work, need) == lib.FX_E_QSHAPE
    assert lib.fx_layer_out_mlp(c, fp(x1), ffi.NULL, 1, work, need) == lib.FX_E_QSHAPE
    assert lib.fx_layer_qkv(c, fp(x1), 0, fp(cs), 32, fp(qkv), work, need) == lib.FX_OK  # no rows: nothing to do


# ------------------------------------------------------------------------------------------- the decode step --

def decode_step_ref(spec: LayerSpec, f64s: list[dict], x: np.ndarray, cs: np.ndarray, k: np.ndarray, v: np.ndarray,
                    pos: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """float64: every layer's q/k/v, its k and v written at token pos of its cache, attention over pos + 1 tokens,
    output products and MLP. x [1, d]; k, v [L, Hkv, cap, D] (copies are returned with the appends)."""
    k, v = k.copy(), v.copy()
    hq, hkv, D = spec.n_heads * spec.head_dim, spec.n_kv_heads * spec.head_dim, spec.head_dim
    dummy = np.zeros((1, hq))
    for layer, f64 in enumerate(f64s):
        qkv, _ = layer_ref(spec, f64, x, cs, dummy)
        k[layer, :, pos] = qkv[0, hq : hq + hkv].reshape(spec.n_kv_heads, D)
        v[layer, :, pos] = qkv[0, hq + hkv :].reshape(spec.n_kv_heads, D)
        q = torch.from_numpy(qkv[0, :hq].reshape(spec.n_heads, D))
        o = attention_ref(q, torch.from_numpy(k[layer]), torch.from_numpy(v[layer]), pos + 1, D ** -0.5)
        _, x = layer_ref(spec, f64, x, cs, o.numpy().reshape(1, hq))
    return x, k, v


def decoder(rng: np.random.Generator, spec: LayerSpec, types: dict[str, int], n_layers: int
            ) -> tuple[NativeDecoder, list[NativeLayer], list[dict]]:
    made = [make_layer(rng, spec, types, bias=True) for _ in range(n_layers)]
    layers = [m[0] for m in made]
    return NativeDecoder(layers), layers, [m[1] for m in made]


@pytest.mark.parametrize("pos", [0, 37, 300])
@pytest.mark.parametrize("spec", SPECS[:3], ids=lambda s: f"d{s.d}-h{s.n_heads}x{s.n_kv_heads}-r{s.rope_dim}")
def test_decode_step_matches_float64(path: str, spec: LayerSpec, pos: int) -> None:
    """fx_decode_layers over F32-weight layers: x after every layer and the appended K/V against float64."""
    rng = np.random.default_rng(pos + spec.d)
    n_layers, cap = 3, pos + 9
    stack, _, f64s = decoder(rng, spec, dict.fromkeys(("q", "k", "v", "o", "gate", "up", "down"), 0), n_layers)
    k = torch.from_numpy(rng.standard_normal((n_layers, spec.n_kv_heads, cap, spec.head_dim))).float()
    v = torch.from_numpy(rng.standard_normal((n_layers, spec.n_kv_heads, cap, spec.head_dim))).float()
    x = torch.from_numpy(rng.standard_normal((1, spec.d))).float()
    cs = rope_rows(rng, 1, spec.rope_dim)
    want_x, want_k, want_v = decode_step_ref(spec, f64s, x.double().numpy(), cs.double().numpy(), k.double().numpy(),
                                             v.double().numpy(), pos)
    stack.step(x, cs, k, v, pos, spec.head_dim ** -0.5)
    assert np.abs(x.double().numpy() - want_x).max() <= 1e-4 * np.abs(want_x).max()
    assert np.abs(k.double().numpy() - want_k).max() <= 1e-5 * np.abs(want_k).max()
    assert np.abs(v.double().numpy() - want_v).max() <= 1e-5 * np.abs(want_v).max()


@pytest.mark.parametrize("mix", list(QUANT_MIXES))
def test_decode_step_equals_the_per_layer_calls(path: str, mix: str) -> None:
    """Quantized layers: the one call gives bit for bit what qkv, decode_attention (appending) and out_mlp give
    when called layer by layer (the engine's path before)."""
    spec = LayerSpec(256, 8, 2, 32, 32, True, 512, 1e-6)
    rng = np.random.default_rng(len(mix) + 7)
    stack, layers, _ = decoder(rng, spec, QUANT_MIXES[mix], 4)
    pos, cap = 200, 256
    k = torch.from_numpy(rng.standard_normal((4, 2, cap, 32))).float()
    v = torch.from_numpy(rng.standard_normal((4, 2, cap, 32))).float()
    x = torch.from_numpy(rng.standard_normal((1, 256))).float()
    cs = rope_rows(rng, 1, 32)
    k2, v2, x2 = k.clone(), v.clone(), x.clone()
    stack.step(x, cs, k, v, pos, 32 ** -0.5)
    hq, hkv = 8 * 32, 2 * 32
    for i, layer in enumerate(layers):
        qkv = layer.qkv(x2, cs)[0]
        o = decode_attention(qkv[:hq].reshape(8, 32).contiguous(), k2[i], v2[i], pos + 1, 32 ** -0.5,
                             k_new=qkv[hq : hq + hkv].reshape(2, 32).contiguous(),
                             v_new=qkv[hq + hkv :].reshape(2, 32).contiguous())
        layer.out_mlp(x2, o.reshape(1, hq))
    assert torch.equal(x, x2) and torch.equal(k, k2) and torch.equal(v, v2)


def test_decode_step_errors() -> None:
    spec = LayerSpec(64, 4, 2, 16, 16, True, 96, 1e-6)
    rng = np.random.default_rng(9)
    types = dict.fromkeys(("q", "k", "v", "o", "gate", "up", "down"), 8)
    stack, layers, _ = decoder(rng, spec, types, 2)
    other, _ = make_layer(rng, LayerSpec(64, 4, 1, 16, 16, True, 96, 1e-6), types, bias=False)
    with pytest.raises(ValueError, match="at least one layer"):
        NativeDecoder([])
    x, cs = torch.randn(1, 64), rope_rows(rng, 1, 16)
    k, v = torch.zeros(2, 2, 10, 16), torch.zeros(2, 2, 10, 16)
    with pytest.raises(ValueError, match="bad shapes"):  # a layer of another shape in the stack
        NativeDecoder([layers[0], other]).step(x, cs, k, v, 3, 0.25)
    with pytest.raises(ValueError, match="bad shapes"):  # position past the cache
        stack.step(x, cs, k, v, 10, 0.25)
    fp = lambda t: ffi.cast("float *", t.data_ptr())  # noqa: E731
    arr = stack.c_layers
    need = lib.fx_decode_layers_workspace(arr, 2, 3)
    buf = np.empty(need, np.uint8)
    work = ffi.from_buffer("uint8_t[]", buf)
    args = (arr, 2, fp(x), fp(cs), fp(k), fp(v))
    assert lib.fx_decode_layers(*args, k.stride(0), k.stride(1), 3, 0.25, work, need - 1) == lib.FX_E_OUTPUT
    assert lib.fx_decode_layers(*args, k.stride(1), k.stride(1), 3, 0.25, work, need) == lib.FX_E_QSHAPE  # layers overlap
    assert lib.fx_decode_layers(arr, 2, fp(x), ffi.NULL, fp(k), fp(v), k.stride(0), k.stride(1), 3, 0.25, work,
                                need) == lib.FX_E_QSHAPE  # no RoPE row for rotating layers
    assert lib.fx_decode_layers_workspace(arr, 0, 3) == -lib.FX_E_QSHAPE
    assert lib.fx_decode_layers_workspace(arr, 2, -1) == -lib.FX_E_QSHAPE
    assert torch.equal(k, torch.zeros_like(k)) and torch.equal(v, torch.zeros_like(v))  # errors wrote nothing
