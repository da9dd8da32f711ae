"""dense_kernels' RMSNorm, RoPE and silu * mul against float64 references on random data (RoPE: the kernel fed the model's
RoPE table rows vs support/tiny_model.py's textbook rotation of the same positions): several widths, batch rows, strided
inputs (the qkv buffer's q/k view), both RoPE pair layouts, bf16 and fp32. Runs the Triton kernels compiled on a GPU,
else through the interpreter (TRITON_INTERPRET=1, FLUXION_TRITON=1 with Triton installed); skipped without Triton."""
from __future__ import annotations

import pytest
import torch

from fluxion_lite.model import dense_kernels
from fluxion_lite.model.transformer import RotaryEmbedding
from tiny_model import make_cfg, rope_formula

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
@pytest.mark.parametrize("arch", ["qwen2", "llama"])  # neox and interleaved pairs
@pytest.mark.parametrize("T,hq,hkv,d", [(1, 14, 2, 64), (4, 32, 8, 128), (3, 9, 3, 64)])
def test_rope_matches_float64(dtype: torch.dtype, arch: str, T: int, hq: int, hkv: int, d: int) -> None:
    gen = torch.Generator().manual_seed(T + hq + d)
    cfg = make_cfg(arch, hq=hq, hkv=hkv, d=d)
    rope = RotaryEmbedding(cfg, DEV, dtype)
    positions = torch.randint(0, 4000, (T,), generator=gen)
    cs = rope.ensure(4096)[positions.to(DEV)][:, :, None, :]  # [T, 2, 1, R]: the rows a decode step gathers
    qkv = (torch.randn(T, (hq + 2 * hkv) * d, generator=gen) * 2.0).to(dtype)
    qk = qkv.to(DEV)[:, : (hq + hkv) * d].view(T, hq + hkv, d)  # strided like model.pre_attention's view
    want = rope_formula(qk.double().cpu(), positions, cfg)
    dense_kernels.rope_(qk, cs[:, 0], cs[:, 1], cfg.rope_style == "neox")
    torch.testing.assert_close(qk.double().cpu(), want, rtol=TOL[dtype], atol=TOL[dtype] * 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,f", [(1, 4864), (3, 1000), (2, 14336), (4, 64)])
def test_silu_mul_matches_float64(dtype: torch.dtype, T: int, f: int) -> None:
    gen = torch.Generator().manual_seed(T * 5 + f)
    wide = torch.randn(T, 2 * f + 7, generator=gen) * 4.0  # a row stride wider than 2F (as a sliced buffer)
    gate_up = wide[:, 3:3 + 2 * f].to(dtype)
    g64, u64 = gate_up[:, :f].double(), gate_up[:, f:].double()
    want = g64 / (1.0 + torch.exp(-g64)) * u64
    got = dense_kernels.silu_mul(gate_up.to(DEV) if dtype == torch.bfloat16 else wide.to(DEV)[:, 3:3 + 2 * f])
    assert got.dtype == dtype and got.shape == (T, f)
    torch.testing.assert_close(got.double().cpu(), want, rtol=TOL[dtype], atol=TOL[dtype])
