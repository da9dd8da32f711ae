"""gemv_kernels' three one-row weight products against float64 references on random data: several weight shapes
(ragged against every block size, a row stride wider than K as a sliced weight has), with and without bias and
residual, bf16 and fp32, and a forced tiling; then a one-row forward of a small model with the kernels against the
same model's matmuls. Runs the Triton kernels compiled on a GPU, else through the interpreter (TRITON_INTERPRET=1,
FLUXION_TRITON=1 with Triton installed, as conftest sets); skipped without Triton."""
from __future__ import annotations

import pytest
import torch

from fluxion_lite.model import gemv_kernels
from fluxion_lite.errors import RequestError
from fluxion_lite.settings import Settings

pytestmark = pytest.mark.skipif(gemv_kernels.triton is None, reason="Triton not installed")
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# relative to the output's scale: fp32 summation order; bf16 one rounding of the output (2^-8) and of gate / up
TOL = {torch.float32: 2e-5, torch.bfloat16: 1.6e-2}
SHAPES = [(7, 64), (130, 896), (33, 1000), (257, 520)]  # (N, K)


def _weights(n: int, k: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(n, k + 5, generator=gen).to(dtype)  # rows 5 elements wider than K: a strided weight view
    x = (torch.randn(1, k, generator=gen) * 2.0).to(dtype)
    return wide[:, 2:2 + k], x


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    scale = float(want.abs().max())
    torch.testing.assert_close(got.double().cpu(), want, rtol=TOL[dtype], atol=TOL[dtype] * scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemv_matches_float64(dtype: torch.dtype, n: int, k: int, with_bias: bool) -> None:
    w, x = _weights(n, k, dtype, n * 31 + k)
    bias = (torch.randn(n, generator=torch.Generator().manual_seed(k)) * 3.0).to(dtype) if with_bias else None
    want = x.double() @ w.double().T + (bias.double() if bias is not None else 0.0)  # [1, N]
    got = gemv_kernels.gemv(x.to(DEV), w.to(DEV), bias.to(DEV) if bias is not None else None)
    assert got.dtype == dtype and got.shape == (1, n)
    _close(got, want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", SHAPES)
def test_gemv_add_matches_float64(dtype: torch.dtype, n: int, k: int) -> None:
    w, x = _weights(n, k, dtype, n + 7 * k)
    res = (torch.randn(1, n, generator=torch.Generator().manual_seed(n)) * 10.0).to(dtype)
    want = res.double() + x.double() @ w.double().T
    res_dev = res.to(DEV)
    out = gemv_kernels.gemv_add_(res_dev, x.to(DEV), w.to(DEV))
    assert out is res_dev  # in place
    _close(res_dev, want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("f,k", [(7, 64), (130, 896), (257, 520)])
def test_gemv_silu_mul_matches_float64(dtype: torch.dtype, f: int, k: int) -> None:
    w, x = _weights(2 * f, k, dtype, f * 3 + k)
    w = w / k**0.5  # gate / up of order 1, where silu bends
    gate_up = x.double() @ w.double().T  # [1, 2F]
    gate_up = gate_up.to(dtype).double()  # the matmul output the kernel rounds to, as cuBLAS would
    g, u = gate_up[:, :f], gate_up[:, f:]
    want = g / (1.0 + torch.exp(-g)) * u
    got = gemv_kernels.gemv_silu_mul(x.to(DEV), w.to(DEV))
    assert got.dtype == dtype and got.shape == (1, f)
    _close(got, want, dtype)


def _rms_norm64(x: torch.Tensor, g: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * g.double()


def _rope64(y: torch.Tensor, rows: int, d: int, neox: bool, pos: float) -> torch.Tensor:
    """float64 RoPE of the first `rows` entries of y [1, N] (heads of d), theta 10000 at position pos."""
    out = y.clone()
    heads = out[0, :rows].view(rows // d, d)  # a view: rotated in place below
    inv = 1.0 / 10000.0 ** (torch.arange(d // 2, dtype=torch.float64) * 2 / d)
    c, s = torch.cos(pos * inv), torch.sin(pos * inv)
    if neox:
        a, b = heads[:, : d // 2].clone(), heads[:, d // 2:].clone()
        heads[:, : d // 2], heads[:, d // 2:] = a * c - b * s, b * c + a * s
    else:
        a, b = heads[:, 0::2].clone(), heads[:, 1::2].clone()
        heads[:, 0::2], heads[:, 1::2] = a * c - b * s, b * c + a * s
    return out


def _rope_rows(d: int, neox: bool, pos: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin_signed [1, 1, d] as model.RotaryEmbedding's table stores them."""
    inv = 1.0 / 10000.0 ** (torch.arange(d // 2, dtype=torch.float64) * 2 / d)
    c, s = torch.cos(pos * inv), torch.sin(pos * inv)
    if neox:
        cos, sin = torch.cat((c, c)), torch.cat((-s, s))
    else:
        cos, sin = c.repeat_interleave(2), torch.stack((-s, s), -1).flatten()
    return cos.to(dtype).view(1, 1, d), sin.to(dtype).view(1, 1, d)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", SHAPES)
def test_gemv_with_norm_matches_float64(dtype: torch.dtype, n: int, k: int) -> None:
    """gemv / gemv_silu_mul with the RMS norm of x inside equal the norm then the product in float64."""
    w, x = _weights(n, k, dtype, n * 5 + k)
    gen = torch.Generator().manual_seed(n + k)
    g = (torch.rand(k, generator=gen) + 0.5).to(dtype)
    x = x + 3.0  # a mean far from zero: the norm's scale matters
    h = _rms_norm64(x, g, 1e-5)
    norm = gemv_kernels.Norm(g.to(DEV), 1e-5)
    got = gemv_kernels.gemv(x.to(DEV), w.to(DEV), norm=norm)
    _close(got, h @ w.double().T, dtype)
    if n % 2 == 0:
        f = n // 2
        w2 = w / k**0.5
        gu = (h @ w2.double().T).to(dtype).double()
        want = gu[:, :f] / (1.0 + torch.exp(-gu[:, :f])) * gu[:, f:]
        _close(gemv_kernels.gemv_silu_mul(x.to(DEV), w2.to(DEV), norm=norm), want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("heads,d,extra,k,bn", [(3, 64, 64, 96, 2), (2, 16, 24, 200, 8), (5, 32, 0, 130, 4),
                                                (1, 8, 40, 64, 16)])
def test_gemv_with_norm_bias_and_rope_matches_float64(dtype: torch.dtype, neox: bool, heads: int, d: int,
                                                       extra: int, k: int, bn: int,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """q/k/v in one kernel: norm, product, bias, then RoPE on the first heads * d rows (both pair layouts); the rows
    after them (v) are not rotated. Several tilings, a pair count per program larger and smaller than a head's."""
    n = heads * d + extra
    w, x = _weights(n, k, dtype, n + k + d)
    gen = torch.Generator().manual_seed(d)
    g = (torch.rand(k, generator=gen) + 0.5).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    pos = 37.0
    y = _rms_norm64(x, g, 1e-6) @ w.double().T + bias.double()
    want = _rope64(y, heads * d, d, neox, pos)
    cos, sin = _rope_rows(d, neox, pos, dtype)
    tiles = (bn, 64, 4)  # the tiling FLUXION_GEMV_CONFIG would force
    got = gemv_kernels.gemv(x.to(DEV), w.to(DEV), bias.to(DEV), norm=gemv_kernels.Norm(g.to(DEV), 1e-6),
                            rope=gemv_kernels.Rope(cos.to(DEV), sin.to(DEV), heads * d, d, neox), tiles=tiles)
    _close(got, want, dtype)


def test_fp32_output_is_the_rounded_value_widened() -> None:
    """out_dtype=float32 on a bf16 product (the logits) stores the bf16-rounded values, as `.float()` of the
    unfused bf16 output would."""
    w, x = _weights(130, 896, torch.bfloat16, 9)
    plain = gemv_kernels.gemv(x.to(DEV), w.to(DEV))
    wide = gemv_kernels.gemv(x.to(DEV), w.to(DEV), out_dtype=torch.float32)
    assert wide.dtype == torch.float32
    assert torch.equal(wide.cpu(), plain.float().cpu())


def test_forced_config_tiles_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    """FLUXION_GEMV_CONFIG (bench/gemv.py's sweep) changes only the tiling, not the result beyond fp32 order."""
    w, x = _weights(130, 1000, torch.float32, 5)
    default = gemv_kernels.gemv(x.to(DEV), w.to(DEV)).cpu()
    monkeypatch.setenv("FLUXION_GEMV_CONFIG", "16,128,2")
    tiles = Settings.load().experimental.gemv_config  # the setting, as model.py passes it to the kernels
    assert gemv_kernels.config(130, 1000, forced=tiles) == (16, 128, 2)
    forced = gemv_kernels.gemv(x.to(DEV), w.to(DEV), tiles=tiles).cpu()
    torch.testing.assert_close(forced, default, rtol=1e-5, atol=1e-4)


def test_bad_shapes_are_refused() -> None:
    w, x = _weights(8, 64, torch.float32, 1)
    with pytest.raises(AssertionError):
        gemv_kernels.gemv(torch.cat([x, x]).to(DEV), w.to(DEV))  # two rows: not a matrix-vector product
    with pytest.raises(AssertionError):
        gemv_kernels.gemv(x.to(DEV), w.t().contiguous().t().to(DEV))  # column-major weight


@pytest.mark.parametrize("fused", ["none", "rope", "all"])  # gemv_kernels.fuse_mode
@pytest.mark.parametrize("arch", ["qwen2", "llama"])  # with and without the q/k/v bias; neox / interleaved RoPE
def test_one_row_forward_with_the_kernels_equals_float64(arch: str, fused: str) -> None:
    """A model whose batch-1 decode steps take the kernels (forced on, as on CUDA) still gives the unfused float64
    forward's logits: q/k/v with bias, the o- and down-projections' residual adds, gate/up/silu and the vocabulary,
    with the norms and RoPE fused into them or not."""
    from pathlib import Path

    from fluxion_lite.model.attention import DenseAttention, SeqChunk
    from fluxion_lite.model.gguf_loader import GGUFModel
    from fluxion_lite.model.transformer import Transformer
    from tiny_model import make_cfg, random_weights, unfused_logits

    cfg = make_cfg(arch)
    w = random_weights(cfg, seed=3)
    model = Transformer(GGUFModel(Path(arch), cfg, {}, w), DEV, torch.float32, prepack=False)
    model._gemv = True  # on a CPU the kernels run in Triton's interpreter
    model._gemv_rope, model._gemv_norm = fused in ("rope", "all"), fused == "all"
    model._l2_hints = True  # the eviction policies change no value
    tokens = torch.randint(0, cfg.vocab_size, (24,), generator=torch.Generator().manual_seed(1))
    want = unfused_logits(cfg, w, tokens)  # [24, V] float64
    attn = DenseAttention(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, torch.float32, DEV)
    attn.allocate(0)
    model.forward(tokens[:20].to(DEV), torch.arange(20).to(DEV), [SeqChunk(0, 0, 20)], attn)  # prefill: matmuls
    for p in range(20, 24):  # decode: one row, the kernels
        got = model.forward(tokens[p:p + 1].to(DEV), torch.tensor([p]).to(DEV), [SeqChunk(0, p, 1)], attn)
        scale = float(want[p].abs().max())
        assert (got.double().cpu()[0] - want[p]).abs().max() < 1e-4 * scale


def test_tuned_table_is_read_and_unknown_shapes_fall_back() -> None:
    """The shipped table (bench/gemv.py --write-table on the H200) parses into power-of-two tilings; a shape it does
    not list gets DEFAULT_CONFIG."""
    table = gemv_kernels._table()
    assert table, "fluxion_lite/gemv_configs.json is missing or empty"
    for key, (bn, bk, warps) in table.items():
        kind, shape = key.split(":")
        n, k = (int(v) for v in shape.split("x"))
        assert kind in ("plain", "silu") and n > 0 and k > 0
        assert all(v > 0 and v & (v - 1) == 0 for v in (bn, bk, warps)), key
        assert gemv_kernels.config(n, k, kind) == (bn, bk, warps)
    assert gemv_kernels.config(3, 5) == gemv_kernels.DEFAULT_CONFIG


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_fused_query_ahead_and_pre_attention_match_the_unfused_kernels(arch: str) -> None:
    """The early query (Transformer.query_ahead) and q/k/v with the norm and RoPE inside one kernel equal the
    separate norm, product and RoPE kernels on the same bf16 stream (up to fp32 summation order and the norm's
    rounding)."""
    from pathlib import Path

    from fluxion_lite.model.gguf_loader import GGUFModel
    from fluxion_lite.model.transformer import Transformer
    from tiny_model import make_cfg, random_weights

    cfg = make_cfg(arch)
    model = Transformer(GGUFModel(Path(arch), cfg, {}, random_weights(cfg, seed=4)), DEV, torch.bfloat16,
                        prepack=False)
    model._gemv = True
    x = (torch.randn(1, cfg.d_model, generator=torch.Generator().manual_seed(2)) * 3).to(torch.bfloat16).to(DEV)
    _, cos, sin = model.embed_tokens(torch.tensor([5]).to(DEV), torch.tensor([301]).to(DEV))
    lw = model.layers[1]
    outs = {}
    for fused in ("none", "rope", "all"):
        model._gemv_rope, model._gemv_norm = fused in ("rope", "all"), fused == "all"
        q, k, v = model.pre_attention(lw, x, cos, sin)
        outs[fused] = (q.clone(), k.clone(), v.clone(), model.query_ahead(lw, x, cos, sin))
    for fused in ("rope", "all"):
        for unfused, got in zip(outs["none"], outs[fused]):
            assert unfused.shape == got.shape
            _close(got, unfused.double().cpu(), torch.bfloat16)
        assert torch.equal(outs[fused][0], outs[fused][3])  # the early query is the layer's own q for one stream


def test_fuse_mode_and_eviction_policy_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """FLUXION_GEMV_FUSE takes none / rope / all (0 / 1 as none / all) and names a bad value; an unknown eviction
    policy is refused before any launch."""
    for value, mode in (("rope", "rope"), ("0", "none"), ("1", "all"), ("all", "all")):
        monkeypatch.setenv("FLUXION_GEMV_FUSE", value)
        assert gemv_kernels.fuse_mode() == mode
    monkeypatch.setenv("FLUXION_GEMV_FUSE", "norm")
    with pytest.raises(RequestError, match="FLUXION_GEMV_FUSE"):  # a FluxionError: the CLI prints the message
        gemv_kernels.fuse_mode()
    w, x = _weights(8, 64, torch.float32, 1)
    with pytest.raises(AssertionError):
        gemv_kernels.gemv(x.to(DEV), w.to(DEV), evict="keep")
    same = gemv_kernels.gemv(x.to(DEV), w.to(DEV), evict="evict_last")  # a hint only: the same values
    assert torch.equal(same, gemv_kernels.gemv(x.to(DEV), w.to(DEV)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="programmatic dependent launch needs CUDA (sm_90)")
def test_programmatic_dependent_launch_changes_no_value(monkeypatch: pytest.MonkeyPatch) -> None:
    """FLUXION_PDL=1 (where supported): the chain norm -> gemv -> gemv_add_ -> gemv_silu_mul -> gemv_add_, eagerly
    and replayed from a CUDA graph, gives the same values as without it (each kernel waits before reading what the
    previous one wrote)."""
    from fluxion_lite.model import dense_kernels
    from fluxion_lite.sparse.device import kernels as device_kernels

    if not device_kernels.pdl_enabled(torch.device("cuda"), True) and not device_kernels._pdl_supported(0):
        pytest.skip("no programmatic dependent launch on this GPU / Triton")
    gen = torch.Generator(device="cuda").manual_seed(5)
    d, f = 1024, 1536
    w_qkv, w_o = (torch.randn(n, d, device="cuda", generator=gen, dtype=torch.bfloat16) / 32 for n in (1536, d))
    w_gu = torch.randn(2 * f, d, device="cuda", generator=gen, dtype=torch.bfloat16) / 32
    w_down = torch.randn(d, f, device="cuda", generator=gen, dtype=torch.bfloat16) / 40
    g = torch.rand(d, device="cuda", generator=gen, dtype=torch.bfloat16) + 0.5
    x0 = torch.randn(1, d, device="cuda", generator=gen, dtype=torch.bfloat16)

    def chain(x: torch.Tensor) -> torch.Tensor:
        h = dense_kernels.rms_norm(x, g, 1e-5, pdl=pdl)
        qkv = gemv_kernels.gemv(h, w_qkv, pdl=pdl)
        gemv_kernels.gemv_add_(x, qkv[:, :d], w_o, pdl=pdl)
        act = gemv_kernels.gemv_silu_mul(dense_kernels.rms_norm(x, g, 1e-5, pdl=pdl), w_gu, pdl=pdl)
        return gemv_kernels.gemv_add_(x, act, w_down, pdl=pdl)

    pdl = False  # FLUXION_PDL=0 (the setting, as model.py and the device step pass it to the kernels)
    want = chain(x0.clone())
    pdl = True  # FLUXION_PDL=1
    assert torch.equal(chain(x0.clone()), want)
    x = x0.clone()
    chain(x.clone())  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(x)
    x.copy_(x0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)
