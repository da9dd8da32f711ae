"""model/quantized_gpu.dequantize, the torch form of the block layouts that the GPU's prefill products and embedding
lookups use: bit for bit the native dequantizer (itself checked against float64 from hand-packed blocks) for every
type, whole matrices, chosen rows, pieces smaller than a matrix, and bf16 output as the fp32 values rounded once.
Plain torch: runs on the CPU here, on the GPU's bytes there."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fluxion_lite.hostkv import quant
from fluxion_lite.model import qgemv_kernels as qk
from fluxion_lite.model import quantized_gpu
from native_quant_reference import random_matrix

TYPES = sorted(qk.TYPES)


def _case(t: int, n: int, k: int, seed: int) -> tuple[qk.QuantMatrix, torch.Tensor]:
    raw = random_matrix(t, n, k, np.random.default_rng(seed))  # uint8 [n, row_bytes]
    return qk.QuantMatrix.from_bytes(t, raw, n, k), torch.from_numpy(quant.dequantize(t, raw, k))


@pytest.mark.parametrize("t", TYPES, ids=lambda t: qk.TYPES[t][0])
def test_dequantize_is_the_native_dequantizer(t: int, monkeypatch: pytest.MonkeyPatch) -> None:
    block = qk.TYPES[t][1]
    for i, (n, k) in enumerate([(1, block), (37, 3 * block), (130, 1024 if block == 256 else 896)]):
        w, want = _case(t, n, k, seed=10 * t + i)
        assert torch.isfinite(want).all()
        assert torch.equal(quantized_gpu.dequantize(w), want)
        rows = torch.tensor([n - 1, 0, n // 2, n - 1])  # any order, repeats: an embedding lookup
        assert torch.equal(quantized_gpu.dequantize(w, rows=rows), want[rows])
        got16 = quantized_gpu.dequantize(w, dtype=torch.bfloat16)
        assert got16.dtype == torch.bfloat16 and torch.equal(got16, want.to(torch.bfloat16))
    # pieces of a few rows (the chunking that bounds the temporaries) give the same values
    w, want = _case(t, 45, 2 * block, seed=t)
    monkeypatch.setattr(quantized_gpu, "DEQUANT_CHUNK", 3 * 2 * block)
    out = torch.full((45, 2 * block), float("nan"))
    assert quantized_gpu.dequantize(w, out=out) is out and torch.equal(out, want)


def test_gpu_linear_groups_runs_of_one_type() -> None:
    """q, k of one type and v of another: two device matrices (one launch each), the rows in order."""
    rng = np.random.default_rng(0)
    parts = []
    for t, n in ((qk.Q4_K, 64), (qk.Q4_K, 32), (qk.Q6_K, 32)):
        parts.append(quant.QuantWeight(qk.TYPES[t][0], random_matrix(t, n, 256, rng), n, 256))
    lin = quantized_gpu.GpuQuantLinear(parts, torch.device("cpu"), quantized_gpu.GpuScratch(torch.device("cpu"),
                                                                                            torch.float32))
    assert [(g.name, g.n_rows) for g in lin.groups] == [("Q4_K", 96), ("Q6_K", 32)] and lin.shape == (128, 256)
    want = torch.cat([torch.as_tensor(p.dequantize()) for p in parts])
    assert torch.equal(lin.dense(torch.float32), want)
    assert torch.equal(lin.head(64).dense(torch.float32, scratch=False), want[:64])
    with pytest.raises(ValueError, match="span two block types"):
        lin.head(100)
    x = torch.randn(40, 256)  # prefill rows (> MAX_M): dequantized into the scratch, then torch's GEMM
    torch.testing.assert_close(lin(x), x @ want.T, rtol=1e-5, atol=1e-5)
