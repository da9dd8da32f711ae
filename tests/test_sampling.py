"""sampling.sample / sample_rows (tensor ops only, so they run on the model's device) against a numpy reference of
the chain: penalties -> top-k -> top-p -> min-p -> temperature -> draw."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fluxion_lite.sampling import SamplingParams, penalised, sample, sample_rows


def reference_probs(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """float64: the distribution the chain draws from (no penalties)."""
    x = logits.astype(np.float64).copy()
    if 0 < p.top_k < x.size:
        kth = np.sort(x)[::-1][p.top_k - 1]
        x[x < kth] = -np.inf
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    if p.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        before = np.cumsum(probs[order]) - probs[order]  # mass of the tokens ranked above
        probs[order[before >= p.top_p]] = 0.0
    if p.min_p > 0.0:
        probs[probs < p.min_p * probs.max()] = 0.0
    with np.errstate(divide="ignore"):
        t = np.log(probs) / p.temperature
    out = np.exp(t - t.max())
    return out / out.sum()


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, top_k=5),
    SamplingParams(temperature=0.7, top_p=0.6),
    SamplingParams(temperature=1.4, min_p=0.05),
    SamplingParams(temperature=0.9, top_k=12, top_p=0.8, min_p=0.01),
])
def test_draws_follow_the_reference_distribution(params: SamplingParams) -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(64, generator=gen) * 2.0  # [V]
    want = reference_probs(logits.numpy(), params)
    rng = torch.Generator().manual_seed(2)
    n = 6000
    draws = np.array([int(sample(logits.clone(), params, [], [], rng)) for _ in range(n)])
    assert set(draws.tolist()) <= set(np.flatnonzero(want > 0).tolist())  # nothing outside the kept set
    freq = np.bincount(draws, minlength=want.size) / n
    assert np.abs(freq - want).max() < 4 * np.sqrt(want.max() / n) + 1e-3  # within sampling noise


def test_rows_greedy_penalised_and_sampled() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 50, generator=gen)  # [R, V]
    kept = logits.clone()
    greedy = SamplingParams(temperature=0.0)
    assert torch.equal(sample_rows(logits, [(greedy, [], [], None)] * 3), logits.argmax(-1))
    rep = SamplingParams(temperature=0.0, repetition_penalty=10.0)
    top = int(logits[1].argmax())
    rows = [(greedy, [], [], None), (rep, [top], [], None),
            (SamplingParams(temperature=0.5, seed=1), [], [], torch.Generator().manual_seed(4))]
    got = sample_rows(logits, rows)
    assert torch.equal(logits, kept)  # the caller's logits are left as they were
    assert int(got[0]) == int(logits[0].argmax()) and int(got[1]) != top  # the penalty moved row 1 off its top
    assert penalised(rep) and not penalised(greedy) and got.dtype == torch.long and got.shape == (3,)
