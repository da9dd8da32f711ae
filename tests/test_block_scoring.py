"""bench/block_scoring.py's rankings against float64 references on random data."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
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
