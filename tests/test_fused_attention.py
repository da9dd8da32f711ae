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


@pytest.mark.parametrize("hkv,r,total,d", [(2, 7, 300, 64), (8, 4, 1000, 128), (1, 1, 17, 64)])
def test_gqa_decode_matmul_path_matches_reference(hkv: int, r: int, total: int, d: int) -> None:
    """The matmul route that CUDA decode takes, run here on CPU tensors through the same arithmetic."""
    from fluxion_lite.attention import gqa_decode

    g = torch.Generator().manual_seed(total)
    q = torch.randn(1, hkv * r, d, generator=g)
    big_k, big_v = torch.randn(hkv, total + 50, d, generator=g), torch.randn(hkv, total + 50, d, generator=g)
    k, v = big_k[:, :total], big_v[:, :total]  # views into a larger buffer, as the cache hands them out
    ref = reference(q, k, v, d**-0.5)
    scores = torch.matmul(q.view(1, hkv, r, d), k[None].transpose(-1, -2)).float() * d**-0.5
    manual = torch.matmul(torch.softmax(scores, dim=-1), v[None]).reshape(1, hkv * r, d)
    assert (manual.double() - ref).abs().max() < 1e-5
    assert (gqa_decode(q.view(1, hkv, r, d), k[None], v[None], d**-0.5).reshape(1, hkv * r, d).double()
            - ref).abs().max() < 1e-5
