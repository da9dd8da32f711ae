"""The fused (SDPA) causal attention used for CUDA prefill against a float64 reference, on CPU."""
from __future__ import annotations

import pytest
import torch

from fluxion_lite.model.attention import causal_attention, fused_causal_attention


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
    from fluxion_lite.model.attention import gqa_decode

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


@pytest.mark.parametrize("n,total,hq,hkv,d", [(64, 64, 12, 2, 128), (200, 1000, 14, 2, 64), (33, 515, 9, 3, 64),
                                               (128, 2048, 12, 2, 128)])
def test_cpu_prefill_in_bf16_stays_at_the_rounding_floor(n: int, total: int, hq: int, hkv: int, d: int) -> None:
    """Sharp attention (scores up to ~40, as long-context retrieval heads give) in bf16: the CPU prefill's error
    against float64 stays within 3x that of rounding the exact output to bf16. Scores rounded to bf16 before the
    softmax (the old matmul path) gave ~10x."""
    g = torch.Generator().manual_seed(n + total)
    q, k, v = (torch.randn(*s, generator=g) for s in ((n, hq, d), (hkv, total, d), (hkv, total, d)))
    q, k = q * 2.5, k * 2.5  # scores of std ~ 6 * sqrt(d) * d^-0.5: peaks near 30-40
    scale = d**-0.5
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    ref = reference(qb, kb, vb, scale)  # exact attention over the bf16 inputs
    floor = (ref.bfloat16().double() - ref).norm() / ref.norm()
    got = causal_attention(qb, kb, vb, total - n, scale)
    assert got.dtype == torch.bfloat16 and got.shape == (n, hq, d)
    assert (got.double() - ref).norm() / ref.norm() < 3 * floor


@pytest.mark.parametrize("start,n", [(0, 40), (1, 39), (100, 1), (100, 2), (300, 77)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cpu_prefill_prefix_and_chunk_merge(start: int, n: int, dtype: torch.dtype) -> None:
    """The prefix call and the causal-square call merged by LSE (fp32; float64 takes the masked path) equal the
    float64 reference for chunks at the start, one key in, one or two queries and a long prefix."""
    g = torch.Generator().manual_seed(start * 100 + n)
    hq, hkv, d = 14, 2, 64
    total = start + n
    q, k, v = (torch.randn(*s, generator=g).to(dtype) for s in ((n, hq, d), (hkv, total, d), (hkv, total, d)))
    ref = reference(q, k, v, d**-0.5)
    got = causal_attention(q, k, v, start, d**-0.5)
    assert got.shape == (n, hq, d) and got.dtype == dtype
    assert (got.double() - ref).abs().max() < (1e-12 if dtype == torch.float64 else 1e-5)
