"""dense_kernels' RMSNorm and RoPE against float64 references on random data: several widths, batch rows, strided
inputs (the qkv buffer's q/k view), both RoPE pair layouts, bf16 and fp32. Runs the Triton kernels compiled on a GPU,
else through the interpreter (TRITON_INTERPRET=1, FLUXION_TRITON=1 with Triton installed); skipped without Triton."""
from __future__ import annotations

import pytest
import torch

from fluxion_lite import dense_kernels
from fluxion_lite.config import ModelConfig
from fluxion_lite.model import RotaryEmbedding

pytestmark = pytest.mark.skipif(dense_kernels.triton is None, reason="Triton not installed")
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2}  # relative: fp32 rounding; bf16 one ulp (2^-7) and the weight's


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,d", [(1, 576), (3, 896), (2, 4096), (5, 64)])
def test_rms_norm_matches_float64(dtype: torch.dtype, T: int, d: int) -> None:
    gen = torch.Generator().manual_seed(T * 7 + d)
    wide = torch.randn(T, d + 9, generator=gen) * 3.0  # a row stride wider than d
    x = wide[:, 5:5 + d]
    w = torch.rand(d, generator=gen) + 0.5
    x64 = x.to(dtype).double()
    want = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * w.to(dtype).double()
    got = dense_kernels.rms_norm(x.to(DEV) if dtype == torch.float32 else x.to(dtype).to(DEV), w.to(dtype).to(DEV),
                                 1e-6)  # fp32: the strided view itself; bf16: a contiguous cast
    assert got.dtype == dtype and got.shape == (T, d)
    torch.testing.assert_close(got.double().cpu(), want, rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("style", ["neox", "interleaved"])
@pytest.mark.parametrize("T,hq,hkv,d", [(1, 14, 2, 64), (4, 32, 8, 128), (3, 9, 3, 64)])
def test_rope_matches_float64(dtype: torch.dtype, style: str, T: int, hq: int, hkv: int, d: int) -> None:
    gen = torch.Generator().manual_seed(T + hq + d)
    cfg = ModelConfig(arch="llama", n_layers=1, d_model=hq * d, d_ff=8, n_heads=hq, n_kv_heads=hkv, head_dim=d,
                      vocab_size=8, context_length=4096, rms_eps=1e-6, rope_theta=10000.0, rope_dim=d,
                      rope_style=style)  # type: ignore[arg-type]
    rope = RotaryEmbedding(cfg, DEV, dtype)
    table = rope.ensure(4096)
    positions = torch.randint(0, 4000, (T,), generator=gen)
    cs = table[positions.to(DEV)][:, :, None, :]  # [T, 2, 1, R]
    qkv = (torch.randn(T, (hq + 2 * hkv) * d, generator=gen) * 2.0).to(dtype)
    qk = qkv.to(DEV)[:, : (hq + hkv) * d].view(T, hq + hkv, d)  # strided like model.pre_attention's view
    x64 = qk.double().cpu()
    half = d // 2
    pair = (torch.arange(d) + half) % d if style == "neox" else torch.arange(d) ^ 1
    c64, s64 = cs[:, 0].double().cpu(), cs[:, 1].double().cpu()
    want = x64 * c64 + x64[..., pair] * s64
    dense_kernels.rope_(qk, cs[:, 0], cs[:, 1], style == "neox")
    torch.testing.assert_close(qk.double().cpu(), want, rtol=TOL[dtype], atol=TOL[dtype] * 4)
