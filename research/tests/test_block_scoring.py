"""research/block_scoring.py's rankings (the mass, quantised and low-rank keys, the value-aware oracle and its summary
forms) against float64 references on random data."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "research"))
from block_scoring import block_scores, quantise_rows  # noqa: E402


def reference_mass(q: np.ndarray, keys: np.ndarray, g: int, scale: float) -> np.ndarray:
    """float64: per g-token block, the softmax mass of its keys summed over the query heads (q [r, D], keys [N, D])."""
    logits = q.astype(np.float64) @ keys.astype(np.float64).T * scale  # [r, N]
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    mass = probs.sum(0)
    n_blocks = -(-len(mass) // g)
    return np.pad(mass, (0, n_blocks * g - len(mass))).reshape(n_blocks, g).sum(1)


@pytest.mark.parametrize("r,n,d,g", [(1, 37, 8, 4), (7, 200, 64, 16), (3, 129, 32, 32)])
def test_exact_is_the_block_mass_and_full_rank_equals_it(r: int, n: int, d: int, g: int) -> None:
    gen = torch.Generator().manual_seed(r * n + d)
    q, keys = torch.randn(r, d, generator=gen), torch.randn(n, d, generator=gen)
    want = reference_mass(q.numpy(), keys.numpy(), g, d**-0.5)
    np.testing.assert_allclose(block_scores("exact", q, keys, g, d**-0.5, None).numpy(), want, rtol=1e-5, atol=1e-7)
    basis = torch.linalg.qr(torch.randn(d, d, generator=gen))[0]  # any orthonormal basis of the whole space
    got = block_scores(f"lowrank{d}", q, keys, g, d**-0.5, basis).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("n,d,g", [(64, 16, 8), (100, 64, 16)])
def test_quest_bounds_every_key_of_its_block(n: int, d: int, g: int) -> None:
    gen = torch.Generator().manual_seed(n + d)
    q, keys = torch.randn(1, d, generator=gen), torch.randn(n, d, generator=gen)
    bound = block_scores("quest", q, keys, g, 1.0, None).numpy().astype(np.float64)
    dots = keys.numpy().astype(np.float64) @ q.numpy()[0].astype(np.float64)  # [N]
    for b in range(-(-n // g)):
        assert bound[b] >= dots[b * g : (b + 1) * g].max() - 1e-5


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_quantised_rows_keep_their_levels_and_error(bits: int) -> None:
    gen = torch.Generator().manual_seed(bits)
    keys = torch.randn(50, 24, generator=gen) * torch.rand(50, 1, generator=gen) * 3  # rows of different scales
    got = quantise_rows(keys, bits).numpy().astype(np.float64)
    k = keys.numpy().astype(np.float64)
    step = np.abs(k).max(-1, keepdims=True) / (2**bits / 2)
    assert np.all(np.abs(got - k) <= step / 2 + 1e-6)  # within half a step of the original
    for row, s in zip(got, step[:, 0]):
        assert len(np.unique(np.round(row / s - 0.5))) <= 2**bits  # at most 2^bits levels per row


def _softmax64(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.mark.parametrize("r,n,d,g", [(1, 37, 8, 4), (7, 200, 64, 16), (3, 129, 32, 32)])
def test_value_aware_scores_against_float64(r: int, n: int, d: int, g: int) -> None:
    gen = torch.Generator().manual_seed(3 * r + n + d)
    q, keys, values = (torch.randn(m, d, generator=gen) for m in (r, n, n))
    near_out = torch.randn(r, d, generator=gen)
    q64, k64, v64, o_near = (x.numpy().astype(np.float64) for x in (q, keys, values, near_out))
    scale = d**-0.5
    probs = _softmax64(q64 @ k64.T * scale)  # [r, N]
    n_blocks = -(-n // g)
    full_out = probs @ v64
    want_v = np.zeros(n_blocks)
    want_mass = np.zeros(n_blocks)
    bounds = np.zeros((r, n_blocks))
    dist = np.zeros((r, n_blocks))
    for b in range(n_blocks):
        sl = slice(b * g, min((b + 1) * g, n))
        for h in range(r):
            want_v[b] += np.linalg.norm((probs[h, sl, None] * (v64[sl] - full_out[h])).sum(0))
            dist[h, b] = np.linalg.norm(v64[sl].mean(0) - o_near[h])
            lo, hi = k64[sl].min(0), k64[sl].max(0)
            if sl.stop - sl.start < g:  # the padded last block: its zero rows take part in the bound
                lo, hi = np.minimum(lo, 0), np.maximum(hi, 0)
            bounds[h, b] = np.maximum(q64[h] * lo, q64[h] * hi).sum()
        want_mass[b] = (probs[:, sl].sum(1) * dist[:, b]).sum()
    want_quest = (_softmax64(bounds * scale) * dist).sum(0)
    for scoring, want in (("vaware", want_v), ("mass_meanv", want_mass), ("quest_meanv", want_quest)):
        got = block_scores(scoring, q, keys, g, scale, None, values, near_out).numpy()
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=1e-6, err_msg=scoring)

