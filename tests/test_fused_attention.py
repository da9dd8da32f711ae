"""The fused (SDPA) causal attention used for CUDA prefill against a float64 reference, on CPU."""
from __future__ import annotations

import pytest
import torch

from fluxion_lite.attention import causal_attention, fused_causal_attention


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """float64, one head at a time: query i (absolute position L - n + i) sees keys 0..L - n + i."""
    n, hq, _ = q.shape
    hkv, total, _ = k.shape
    out = torch.empty(n, hq, q.shape[2], dtype=torch.float64)
    for h in range(hq):
        kh, vh = k[h // (hq // hkv)].double(), v[h // (hq // hkv)].double()
        s = q[:, h].double() @ kh.T * scale  # [n, L]
        mask = torch.arange(total)[None, :] > (total - n + torch.arange(n))[:, None]
        out[:, h] = torch.softmax(s.masked_fill(mask, float("-inf")), dim=-1) @ vh
    return out


@pytest.mark.parametrize("n,total,hq,hkv,d", [(5, 5, 4, 4, 64), (37, 100, 14, 2, 64), (64, 300, 12, 2, 128),
                                               (2, 257, 7, 1, 64), (16, 16, 8, 8, 128)])
def test_fused_matches_float64_reference(n: int, total: int, hq: int, hkv: int, d: int) -> None:
    g = torch.Generator().manual_seed(n * 1000 + total)
    q, k, v = (torch.randn(*s, generator=g) for s in ((n, hq, d), (hkv, total, d), (hkv, total, d)))
    scale = d**-0.5
    ref = reference(q, k, v, scale)
    fused = fused_causal_attention(q, k, v, scale)
    assert fused.shape == (n, hq, d)
    assert (fused.double() - ref).abs().max() < 1e-5
    # and the tiled path agrees with both
    assert (causal_attention(q, k, v, total - n, scale).double() - ref).abs().max() < 1e-5
