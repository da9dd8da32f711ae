"""sampling.sample / sample_rows / Penalties (tensor ops only, so they run on the model's device) against a numpy
reference of the chain: penalties -> top-k -> top-p -> min-p -> temperature -> draw."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fluxion_lite.engine.sampling import REPETITION_WINDOW, Penalties, SamplingParams, penalised, sample, sample_rows


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
    draws = np.array([int(sample(logits, params, None, rng)) for _ in range(n)])
    assert set(draws.tolist()) <= set(np.flatnonzero(want > 0).tolist())  # nothing outside the kept set
    freq = np.bincount(draws, minlength=want.size) / n
    assert np.abs(freq - want).max() < 4 * np.sqrt(want.max() / n) + 1e-3  # within sampling noise


def reference_penalised(logits: np.ndarray, p: SamplingParams, ids: list[int], n_prompt: int) -> np.ndarray:
    """float64: llama.cpp's repetition penalty on the distinct ids of the last REPETITION_WINDOW, then OpenAI's
    presence / frequency penalties on the generated ids (ids = prompt + generated so far)."""
    x = logits.astype(np.float64).copy()
    for t in set(ids[-REPETITION_WINDOW:]):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    gen, counts = np.unique(np.array(ids[n_prompt:], dtype=np.int64), return_counts=True)
    if gen.size:
        x[gen] -= p.presence_penalty + p.frequency_penalty * counts
    return x


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n_prompt,n_gen", [(10, 0), (100, 3), (30, 90), (5, 200)])
def test_penalties_follow_the_reference_as_tokens_arrive(n_prompt: int, n_gen: int, device: str) -> None:
    """The device history filled from the ids at a first choice and fed chosen ids afterwards gives the penalised
    logits of the host rule over the ids so far (the window wraps past REPETITION_WINDOW)."""
    gen = torch.Generator().manual_seed(n_prompt + n_gen)
    vocab = 80
    ids = torch.randint(0, vocab, (n_prompt + n_gen,), generator=gen).tolist()  # repeats: the sets matter
    p = SamplingParams(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.25)
    split = n_prompt + n_gen // 2  # the history starts here, the rest arrives one id at a time
    pen = Penalties(ids[:split], n_prompt, vocab, torch.device(device))
    for k in range(split, len(ids) + 1):
        logits = torch.randn(vocab, generator=gen)
        want = reference_penalised(logits.numpy(), p, ids[:k], n_prompt)
        got = pen.apply(logits.to(device), p).cpu().numpy()
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
        if k < len(ids):
            pen.push(torch.tensor(ids[k], device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_rows_greedy_penalised_and_sampled(device: str) -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 50, generator=gen).to(device)  # [R, V]
    kept = logits.clone()
    greedy = SamplingParams(temperature=0.0)
    assert torch.equal(sample_rows(logits, [(greedy, None, None)] * 3), logits.argmax(-1))
    rep = SamplingParams(temperature=0.0, repetition_penalty=10.0)
    top = int(logits[1].argmax())
    pen = Penalties([top], 1, 50, torch.device(device))
    rows = [(greedy, None, None), (rep, pen, None),
            (SamplingParams(temperature=0.5, seed=1), None, torch.Generator(device=device).manual_seed(4))]
    got = sample_rows(logits, rows)
    assert torch.equal(logits, kept)  # the caller's logits are left as they were
    assert int(got[0]) == int(logits[0].argmax()) and int(got[1]) != top  # the penalty moved row 1 off its top
    assert penalised(rep) and not penalised(greedy) and got.dtype == torch.long and got.shape == (3,)
    assert pen.valid == 2 and int(pen.ring[1]) == int(got[1]) and float(pen.counts[int(got[1])]) == 1.0  # pushed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host syncs exist only on CUDA")
def test_choosing_on_cuda_never_waits_for_the_device() -> None:
    """Async decode queues the next step with these choices still being computed: any host sync in the chain
    (a read, a pageable copy to the device) would stall it. torch's sync debug mode turns each into an error."""
    dev = torch.device("cuda")
    logits = torch.randn(4, 1000, device=dev)  # [R, V]
    pens = [Penalties([1, 2, 3, 2], 2, 1000, dev) for _ in range(2)]
    rows = [(SamplingParams(temperature=0.0), None, None),
            (SamplingParams(temperature=0.0, repetition_penalty=1.2, frequency_penalty=0.3), pens[0], None),
            (SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.02, repetition_penalty=1.1,
                            presence_penalty=0.2, seed=3), pens[1], torch.Generator(device=dev).manual_seed(3)),
            (SamplingParams(temperature=0.7, top_p=0.95, seed=4), None, torch.Generator(device=dev).manual_seed(4))]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            chosen = sample_rows(logits, rows)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert chosen.shape == (4,) and chosen.device.type == "cuda"
