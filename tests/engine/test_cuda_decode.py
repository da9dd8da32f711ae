"""CUDA-only: split-L decode attention (attention.split_decode) against a float64 reference, over head dims, GQA
ratios, context lengths (shorter than one chunk, exact multiples, ragged tails) and cache views with spare capacity.
Skipped without CUDA (CI); on a GPU host without pytest run it as a script:
`python tests/engine/test_cuda_decode.py`."""
from __future__ import annotations

import itertools

import pytest
import torch

from fluxion_lite.model import attention

CASES = list(itertools.product([64, 128], [(2, 7), (8, 4), (4, 1)], [1, 100, 128, 1000, 4096, 33000]))


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [1, Hkv, r, D], k, v [1, Hkv, L, D] -> [1, Hkv, r, D] in float64."""
    s = torch.matmul(q.double(), k.double().transpose(-1, -2)) * scale
    return torch.matmul(torch.softmax(s, -1), v.double())


def check(d: int, hkv: int, r: int, n: int) -> float:
    g = torch.Generator(device="cuda").manual_seed(d * 7 + hkv * 131 + n)
    cap = n + 37  # a view into a larger buffer, as the dense cache hands out
    kbuf = torch.randn(1, hkv, cap, d, generator=g, device="cuda").to(torch.bfloat16)
    vbuf = torch.randn(1, hkv, cap, d, generator=g, device="cuda").to(torch.bfloat16)
    q = (torch.randn(1, hkv, r, d, generator=g, device="cuda") * 2).to(torch.bfloat16)
    k, v = kbuf[:, :, :n], vbuf[:, :, :n]
    got = attention.split_decode(q, k, v, d**-0.5)
    want = reference(q, k, v, d**-0.5)
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    return float((got.double() - want).abs().max())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("d,hr,n", CASES)
def test_split_decode_matches_float64(d: int, hr: tuple[int, int], n: int) -> None:
    assert check(d, *hr, n) < 2e-2  # bf16 output rounding of values of magnitude ~1


if __name__ == "__main__":
    worst = 0.0
    for d, (hkv, r), n in CASES:
        err = check(d, hkv, r, n)
        worst = max(worst, err)
        print(f"d={d} hkv={hkv} r={r} n={n}: chunk {attention.split_chunk(n, hkv)} max err {err:.2e}")
    print(f"split_decode vs float64: worst {worst:.2e} over {len(CASES)} cases: {'OK' if worst < 2e-2 else 'FAIL'}")
