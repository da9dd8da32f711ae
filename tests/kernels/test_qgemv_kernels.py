"""qgemv_kernels' three quantized-weight products against float64 references: the weights are random GGUF blocks
(native_quant_reference.random_matrix: random integer parts, finite nonzero f16 scales of random sign, 6-bit K scales
and mins in [1, 63], nonzero int8 Q6_K scales) and the reference dequantizes them with the native CPU dequantizer
(hostkv.quant.dequantize: fp32, exact) widened to float64. Every type, odd row counts, K of one block and of several,
M = 1, 3, 16, bf16 and fp32 x, with and without bias, several tilings; then the errors. The bound per output is
relative to sum |x| |w| (fp32 accumulation) plus one rounding of the output to its dtype.

Runs the Triton kernels compiled on a GPU, else through Triton's interpreter (TRITON_INTERPRET=1, which conftest
sets without CUDA); skipped without Triton (the CI's install has none)."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from fluxion_lite.model import qgemv_kernels as qk
from native_quant_reference import random_matrix

pytestmark = [
    pytest.mark.skipif(qk.triton is None, reason="Triton not installed"),
    pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                       reason="no CUDA, and Triton's interpreter is off (TRITON_INTERPRET=1 runs these on the CPU)"),
]
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
K_TYPES = [qk.Q4_K, qk.Q5_K, qk.Q6_K]
B32_TYPES = [qk.Q8_0, qk.Q4_0, qk.Q4_1, qk.Q5_0, qk.Q5_1]
ALL_TYPES = K_TYPES + B32_TYPES
REL = 3e-5  # fp32 accumulation, relative to sum |x| |w|
# one rounding of the output to its dtype: half a unit on the GPU; Triton's interpreter truncates to bf16 (a unit)
ROUND = {torch.float32: 0.0, torch.bfloat16: 2.0 ** (-8 if DEV.type == "cuda" else -7), torch.float16: 2.0 ** -11}


def _name(t: int) -> str:
    return qk.TYPES[t][0]


def _shapes(t: int) -> list[tuple[int, int]]:
    """(N, K): K of one block and of several (a K-type K of 3 super-blocks: not a multiple of KB; 28 blocks of 32)."""
    return [(33, 256), (257, 768)] if t in K_TYPES else [(33, 32), (67, 896)]


def _matrix(t: int, n: int, k: int, seed: int) -> tuple[qk.QuantMatrix, torch.Tensor]:
    """(the QuantMatrix on DEV, its float64 values [n, k] from the native dequantizer)."""
    from fluxion_lite.hostkv import quant

    raw = random_matrix(t, n, k, np.random.default_rng(seed))  # uint8 [n, row_bytes]
    w64 = torch.from_numpy(quant.dequantize(t, raw, k)).double()
    assert torch.isfinite(w64).all()
    return qk.QuantMatrix.from_bytes(t, raw, n, k, DEV), w64


def _x(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return (torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * 2.0).to(dtype)


def _check(got: torch.Tensor, want: torch.Tensor, err: torch.Tensor, dtype: torch.dtype) -> None:
    """|got - want| <= err + one rounding of want to dtype, elementwise."""
    assert got.dtype == dtype and got.shape == want.shape, (got.dtype, got.shape, want.shape)
    diff = (got.double().cpu() - want).abs()
    bound = err + ROUND[dtype] * want.abs() + 1e-30
    worst = float((diff / bound).max())
    assert worst <= 1.0, f"max |error| / bound = {worst:.3g} (max |error| {float(diff.max()):.3g})"


@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("t", ALL_TYPES, ids=_name)
def test_qgemv_matches_float64(t: int, m: int) -> None:
    for i, (n, k) in enumerate(_shapes(t)):
        w, w64 = _matrix(t, n, k, seed=t * 100 + i)
        for dtype, with_bias in ((torch.bfloat16, True), (torch.float32, False)):
            x = _x(m, k, dtype, seed=n + m)
            bias = (torch.randn(n, generator=torch.Generator().manual_seed(k)) * 0.1).to(dtype) if with_bias else None
            want = x.double() @ w64.T + (bias.double() if bias is not None else 0.0)  # [M, N]
            err = REL * (x.double().abs() @ w64.abs().T)
            got = qk.qgemv(x.to(DEV), w, bias.to(DEV) if bias is not None else None)
            _check(got, want, err, dtype)


@pytest.mark.parametrize("m", [1, 16])
@pytest.mark.parametrize("t", ALL_TYPES, ids=_name)
def test_qgemv_add_matches_float64(t: int, m: int) -> None:
    n, k = _shapes(t)[1]
    w, w64 = _matrix(t, n, k, seed=t + 7)
    for dtype in (torch.bfloat16, torch.float32):
        x = _x(m, k, dtype, seed=m)
        res = (torch.randn(m, n, generator=torch.Generator().manual_seed(n)) * 0.5).to(dtype)
        want = res.double() + x.double() @ w64.T
        err = REL * (x.double().abs() @ w64.abs().T)
        res_dev = res.to(DEV)
        out = qk.qgemv_add_(res_dev, x.to(DEV), w)
        assert out is res_dev  # in place
        _check(res_dev, want, err, dtype)


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("t", ALL_TYPES, ids=_name)
def test_qgemv_silu_mul_matches_float64(t: int, m: int) -> None:
    f, k = 33, _shapes(t)[1][1]
    w, w64 = _matrix(t, 2 * f, k, seed=t + 11)
    for dtype in (torch.bfloat16, torch.float32):
        x = _x(m, k, dtype, seed=f + m) / 8  # gate and up of order 10, where silu bends (and exp(-gate) is finite)
        gu = x.double() @ w64.T  # [M, 2F]
        e = REL * (x.double().abs() @ w64.abs().T)
        g, u, eg, eu = gu[:, :f], gu[:, f:], e[:, :f], e[:, f:]
        silu = g / (1.0 + torch.exp(-g))
        want = silu * u
        err = 1.1 * eg * (u.abs() + eu) + silu.abs() * eu  # |silu'| <= 1.1
        got = qk.qgemv_silu_mul(x.to(DEV), w)
        _check(got, want, err, dtype)


@pytest.mark.parametrize("tiles", [(1, 2, 1), (4, 32, 2), (64, 2, 1), (16, 8, 4), (2, 16, 8)])
@pytest.mark.parametrize("t", [qk.Q4_K, qk.Q6_K, qk.Q5_K, qk.Q4_0, qk.Q8_0, qk.Q5_1], ids=_name)
def test_tilings(t: int, tiles: qk.Tiles) -> None:
    """Forced tilings: one row per program, a whole 32-byte run per thread, more rows than threads (several rows
    per thread), wide programs; each PE is capped to what the type allows."""
    n, k = 33, _shapes(t)[1][1]
    w, w64 = _matrix(t, n, k, seed=3)
    x = _x(3, k, torch.float32, seed=5)
    got = qk.qgemv(x.to(DEV), w, tiles=tiles)
    _check(got, x.double() @ w64.T, REL * (x.double().abs() @ w64.abs().T), torch.float32)


def test_out_dtype_and_strided_x() -> None:
    """bf16 x with an fp32 output (the sum rounded once to fp32); x rows with a stride wider than K (a view)."""
    n, k = 40, 512
    w, w64 = _matrix(qk.Q4_K, n, k, seed=9)
    wide = _x(5, k + 8, torch.bfloat16, seed=9)
    x = wide[:, 3:3 + k]  # [5, K], row stride K + 8, unaligned start
    got = qk.qgemv(x.to(DEV), w, out_dtype=torch.float32)
    _check(got, x.double() @ w64.T, REL * (x.double().abs() @ w64.abs().T), torch.float32)
    x1 = wide[2:3, 3:3 + k]  # one row
    got1 = qk.qgemv(x1.to(DEV), w, out_dtype=torch.float32)
    _check(got1, x1.double() @ w64.T, REL * (x1.double().abs() @ w64.abs().T), torch.float32)
    empty = qk.qgemv(torch.zeros(0, k, dtype=torch.bfloat16, device=DEV), w)
    assert empty.shape == (0, n)


def test_quant_matrix_sources() -> None:
    """From a hostkv QuantWeight, a numpy array of the file's bytes and a torch tensor: the same matrix."""
    from fluxion_lite.hostkv import quant

    t, n, k = qk.Q6_K, 5, 512
    raw = random_matrix(t, n, k, np.random.default_rng(1))
    a = qk.QuantMatrix.from_quant_weight(quant.QuantWeight("Q6_K", raw, n, k), DEV)
    b = qk.QuantMatrix.from_bytes("q6_k", raw.reshape(-1), n, k, DEV)
    c = qk.QuantMatrix.from_bytes(t, torch.from_numpy(raw), n, k, DEV)
    assert a.wtype == b.wtype == c.wtype == t and a.name == "Q6_K" and a.row_bytes == quant.row_bytes(t, k)
    assert torch.equal(a.data, b.data) and torch.equal(a.data, c.data) and a.data.shape == (n, a.row_bytes)
    assert a.device.type == DEV.type


def test_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    raw = random_matrix(qk.Q4_K, 4, 256, np.random.default_rng(2))
    w = qk.QuantMatrix.from_bytes(qk.Q4_K, raw, 4, 256, DEV)
    x = torch.randn(2, 256, device=DEV)
    for bad_type in (0, 1, 30, 99, "F16", "Q2_K"):
        with pytest.raises(ValueError, match="not supported"):
            qk.QuantMatrix.from_bytes(bad_type, raw, 4, 256)
    with pytest.raises(ValueError, match="multiple of Q4_K's block"):
        qk.QuantMatrix.from_bytes(qk.Q4_K, raw, 8, 128)
    with pytest.raises(ValueError, match="holds"):
        qk.QuantMatrix.from_bytes(qk.Q4_K, raw, 5, 256)
    with pytest.raises(ValueError, match="uint8"):
        qk.QuantMatrix(qk.Q4_K, torch.zeros(4, 144, dtype=torch.int16), 4, 256)
    with pytest.raises(ValueError, match="contiguous uint8"):
        qk.QuantMatrix(qk.Q4_K, torch.zeros(4, 145, dtype=torch.uint8), 4, 256)
    with pytest.raises(ValueError, match="at most 16"):
        qk.qgemv(torch.randn(17, 256, device=DEV), w)
    with pytest.raises(ValueError, match="bf16, fp16 or fp32"):
        qk.qgemv(x.double(), w)
    with pytest.raises(ValueError, match="bf16, fp16 or fp32"):
        qk.qgemv(x.to(torch.int32), w)
    with pytest.raises(ValueError, match=r"\[M, 256\]"):
        qk.qgemv(torch.randn(2, 512, device=DEV), w)
    with pytest.raises(ValueError, match="unit stride"):
        qk.qgemv(torch.randn(256, 2, device=DEV).T, w)
    with pytest.raises(ValueError, match="QuantMatrix"):
        qk.qgemv(x, torch.zeros(4, 256, device=DEV))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="bias"):
        qk.qgemv(x, w, torch.zeros(5, device=DEV))
    with pytest.raises(ValueError, match="res"):
        qk.qgemv_add_(torch.zeros(2, 5, device=DEV), x, w)
    with pytest.raises(ValueError, match="even number of rows"):
        qk.qgemv_silu_mul(x, qk.QuantMatrix.from_bytes(qk.Q4_K, raw[:3], 3, 256, DEV))
    with pytest.raises(ValueError, match="powers of two"):
        qk.qgemv(x, w, tiles=(3, 8, 4))
    if DEV.type == "cuda":
        with pytest.raises(ValueError, match="is on"):
            qk.qgemv(x.cpu(), w)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", "0")  # read per call: CPU tensors without the interpreter
        with pytest.raises(ValueError, match="run on CUDA"):
            qk.qgemv(x, w)
