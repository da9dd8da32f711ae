"""research/background_mass.py's unread-background estimate and research/background_fidelity.py's simulated top-k
backend, checked against float64 attention on random data and against dense decoding of a real model; and the
engine's native term against the estimate the simulations use."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import native_reference as ref
from fluxion_lite.hostkv import native
from fluxion_lite.hostkv.store import HostKVStore

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "research"))

from background_fidelity import SimulatedTopK  # noqa: E402
from background_mass import RANGE_PER_SIGMA, SUMMARY_SUB, background_output, minmax_logits  # noqa: E402

from real_model import decode_logits, engine, essay_tokens  # noqa: E402,F401  (fixtures)


def _attention64(qg: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, read: torch.Tensor,
                 scale: float) -> torch.Tensor:
    """Reference: softmax attention over the `read` tokens in float64, qg [M, r, D], read [M, N] -> [M, r, D]."""
    s = torch.einsum("mrd,nd->mrn", qg.double(), keys.double()) * scale
    p = torch.softmax(s.masked_fill(~read[:, None, :], float("-inf")), dim=-1)
    return p @ values.double()


def _case(m: int, r: int, n: int, d: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    qg = torch.randn(m, r, d, generator=gen) * 2.0
    keys, values = torch.randn(n, d, generator=gen), torch.randn(n, d, generator=gen)
    allowed = torch.rand(m, n, generator=gen) < 0.3
    allowed[:, :4] = True  # a sink, so no row reads nothing
    causal = torch.ones(m, n, dtype=torch.bool)
    return qg, keys, values, allowed, causal


@pytest.mark.parametrize("m,r,n,d", [(1, 1, 17, 8), (3, 7, 100, 64), (2, 4, 257, 32), (5, 2, 64, 16)])
@pytest.mark.parametrize("mass", ["mean", "oracle"])
def test_one_token_blocks_give_exact_attention(m: int, r: int, n: int, d: int, mass: str) -> None:
    """With summary blocks of one token, an unread span is one token: its mean key is its key, so the estimate is
    exact and the result is full attention over every causal token."""
    qg, keys, values, allowed, causal = _case(m, r, n, d, seed=n + d)
    got, ratio = background_output(qg, keys, values, allowed, causal, 1, d**-0.5, mass)
    ref = _attention64(qg, keys, values, causal, d**-0.5)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-6)
    assert ratio == pytest.approx(1.0, rel=1e-9)


@pytest.mark.parametrize("block", [4, 16, 64])
def test_oracle_mass_keeps_each_block_mean_value(block: int) -> None:
    """`oracle` gives each unread span its true mass with the span's mean value: float64 reference built token by
    token."""
    m, r, n, d = 2, 3, 150, 16
    qg, keys, values, allowed, causal = _case(m, r, n, d, seed=block)
    got, _ = background_output(qg, keys, values, allowed, causal, block, d**-0.5, "oracle")
    ref = _oracle_reference(qg, keys, values, allowed, causal, block, d**-0.5, block_value=False)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-6)


def _oracle_reference(qg: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor,
                      causal: torch.Tensor, block: int, scale: float, block_value: bool) -> torch.Tensor:
    """Token by token in float64: the read tokens exactly, plus per block one term with its unread tokens' true mass
    and, as value, their mean (block_value: the mean of all the block's valid tokens). -> [M, r, D]"""
    m, r, d = qg.shape
    n = keys.shape[0]
    s = torch.einsum("mrd,nd->mrn", qg.double(), keys.double()) * scale  # [M, r, N]
    ref = torch.zeros(m, r, d, dtype=torch.float64)
    for i in range(m):
        for h in range(r):
            weights = [math.exp(float(s[i, h, j])) for j in range(n) if allowed[i, j]]
            vecs = [values[j].double() for j in range(n) if allowed[i, j]]
            for b0 in range(0, n, block):
                span = [j for j in range(b0, min(n, b0 + block)) if causal[i, j] and not allowed[i, j]]
                valid = [j for j in range(b0, min(n, b0 + block)) if causal[i, j]]
                if span:
                    weights.append(sum(math.exp(float(s[i, h, j])) for j in span))
                    vecs.append(torch.stack([values[j].double() for j in (valid if block_value else span)]).mean(0))
            w = torch.tensor(weights, dtype=torch.float64)
            ref[i, h] = (w[:, None] * torch.stack(vecs)).sum(0) / w.sum()
    return ref


@pytest.mark.parametrize("block", [4, 16])
def test_block_value_is_the_whole_block_mean(block: int) -> None:
    """value="block" keeps the oracle mass but gives each block with unread tokens the mean value of all its valid
    tokens, read ones included: float64 reference built token by token."""
    m, r, n, d = 2, 3, 90, 8
    qg, keys, values, allowed, causal = _case(m, r, n, d, seed=30 + block)
    causal[1, 70:] = False  # a shorter row: its last blocks' means count only its valid tokens
    allowed &= causal
    got, _ = background_output(qg, keys, values, allowed, causal, block, d**-0.5, "oracle", value="block")
    ref = _oracle_reference(qg, keys, values, allowed, causal, block, d**-0.5, block_value=True)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-6)


def test_mean_mass_underestimates_by_jensen() -> None:
    """|U| exp(s q.kbar) <= sum over U of exp(s q.k) (convexity): the estimated / true mass ratio is at most 1."""
    qg, keys, values, allowed, causal = _case(4, 3, 300, 32, seed=9)
    _, ratio = background_output(qg, keys, values, allowed, causal, 32, 32**-0.5, "mean")
    assert 0.0 < ratio <= 1.0


def test_nothing_unread_is_plain_attention() -> None:
    qg, keys, values, _, causal = _case(3, 2, 80, 16, seed=4)
    got, ratio = background_output(qg, keys, values, causal.clone(), causal, 16, 0.25, "mean")
    torch.testing.assert_close(got.double(), _attention64(qg, keys, values, causal, 0.25), rtol=1e-5, atol=1e-6)
    assert ratio == 1.0


def test_simulated_topk_at_full_budget_decodes_as_dense(engine, essay_tokens) -> None:  # noqa: F811
    """Budget 1.0 reads every block, so the simulated backend must give dense decoding's logits (with and without
    the background term, which then has nothing to add)."""
    dense = decode_logits(engine, engine.attn, essay_tokens, 4)
    for summary_g in (None, 64):
        sim = SimulatedTopK(engine.attn, 16, 1.0, 16, 64, summary_g)
        got = decode_logits(engine, sim, essay_tokens, 4)
        torch.testing.assert_close(got.float(), dense.float(), rtol=2e-3, atol=2e-3)
        assert min(sim.read) == pytest.approx(1.0)
    small = SimulatedTopK(engine.attn, 16, 0.02, 16, 64, None)
    decode_logits(engine, small, essay_tokens, 2)
    assert max(small.read) < 0.5  # a small budget does read less


def test_unknown_mass_rule_is_refused() -> None:
    qg, keys, values, allowed, causal = _case(1, 1, 20, 8, seed=1)
    with pytest.raises(ValueError, match="mass="):
        background_output(qg, keys, values, allowed, causal, 4, 0.3, "median")
    with pytest.raises(ValueError, match="value="):
        background_output(qg, keys, values, allowed, causal, 4, 0.3, "mean", value="median")


@pytest.mark.parametrize("m,r,n,d,block", [(1, 1, 40, 8, 16), (2, 3, 150, 16, 32), (3, 2, 257, 64, 128)])
def test_minmax_logits_match_a_token_by_token_reference(m: int, r: int, n: int, d: int, block: int) -> None:
    """Each 16-token sub-block's log-normal mass from its keys' min / max, times its unread count, summed per summary
    block: float64 reference written out sub-block by sub-block."""
    qg, keys, _, allowed, causal = _case(m, r, n, d, seed=n * 3 + d)
    unread = (causal & ~allowed).double()
    got = minmax_logits(qg, keys, unread, block, d**-0.5)
    scale = d**-0.5
    for i in range(m):
        for h in range(r):
            q = qg[i, h].double()
            for b0 in range(0, n, block):
                terms = []
                for s0 in range(b0, min(n, b0 + block), SUMMARY_SUB):
                    ks = keys[s0 : min(n, s0 + SUMMARY_SUB)].double()
                    lo, hi = ks.min(0).values, ks.max(0).values
                    count = float(unread[i, s0 : s0 + SUMMARY_SUB].sum())
                    if count == 0:
                        continue
                    mean = float(q @ (lo + hi) / 2) * scale
                    var = float((q * q) @ ((hi - lo) / RANGE_PER_SIGMA) ** 2) * scale * scale
                    terms.append(mean + var / 2 + math.log(count))
                want = torch.tensor(terms, dtype=torch.float64).logsumexp(0) if terms else float("-inf")
                assert float(got[i, h, b0 // block]) == pytest.approx(float(want), rel=1e-9, abs=1e-9)


def test_minmax_mass_is_exact_when_a_sub_block_keys_are_equal() -> None:
    """Keys equal within each 16-token sub-block have zero range: the estimate is then the true mass, and the output
    the oracle's."""
    m, r, n, d = 2, 3, 160, 16
    qg, _, values, allowed, causal = _case(m, r, n, d, seed=11)
    distinct = torch.randn(n // SUMMARY_SUB, d, generator=torch.Generator().manual_seed(3))
    keys = distinct.repeat_interleave(SUMMARY_SUB, 0)  # [N, D], one key per sub-block
    got, ratio = background_output(qg, keys, values, allowed, causal, 32, d**-0.5, "minmax")
    want, _ = background_output(qg, keys, values, allowed, causal, 32, d**-0.5, "oracle")
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    assert ratio == pytest.approx(1.0, rel=1e-9)


def test_minmax_needs_whole_sub_blocks() -> None:
    qg, keys, _, allowed, causal = _case(1, 1, 40, 8, seed=2)
    with pytest.raises(ValueError, match="multiple of 16"):
        minmax_logits(qg, keys, (causal & ~allowed).double(), 24, 0.3)


def test_background_is_the_simulations_midrange_block_value_term() -> None:
    """The engine's term (native.background) is what research/background_answers.py simulates as --background
    128:midrange:block (research/background_mass.py's background_output): merged with the read part, the same output
    on random data with a block-aligned read mask."""
    rng = np.random.default_rng(11)
    n, d, r, g, sink, window = 900, 64, 3, 32, 16, 64
    kt = torch.from_numpy(rng.standard_normal((n, 1, d), dtype=np.float32) + 0.2).to(torch.bfloat16)
    vt = torch.from_numpy(rng.standard_normal((n, 1, d), dtype=np.float32)).to(torch.bfloat16)
    store = HostKVStore(1, 1, d, dtype=torch.bfloat16, max_seqs=1, page_tokens=256, value_sums=True)
    slot = store.allocate()
    store.append(0, slot, kt, vt)
    q = (rng.standard_normal((1, r, d), dtype=np.float32) * 2).astype(np.float32)
    lo, hi = -(-sink // g) * g, (n - window) // g * g
    tasks = native.make_tasks(slot, 0, 0, g, 4, exclude=[(0, lo), (hi, n)])
    ids, _, counts = native.group_topk(store.view(0), q, tasks)
    bg_out, bg_lse = native.background(store.view(0), q, tasks, ids, counts, d**-0.5)
    read = torch.zeros(1, n, dtype=torch.bool)
    read[0, :lo] = read[0, hi:] = True
    for b in ids[0, :counts[0]]:
        read[0, b * g:(b + 1) * g] = True
    keys, values = kt[:, 0].float(), vt[:, 0].float()
    want, _ = background_output(torch.from_numpy(q), keys, values, read, torch.ones(1, n, dtype=torch.bool), 128,
                                d**-0.5, "midrange", value="block")
    o_read, l_read = ref.attention(q[0].astype(np.float64), keys.double().numpy()[read[0].numpy()],
                                   values.double().numpy()[read[0].numpy()], d**-0.5)
    m = np.maximum(l_read, bg_lse[0])
    w_r, w_b = np.exp(l_read - m), np.exp(bg_lse[0] - m)
    merged = (o_read * w_r[:, None] + bg_out[0] * w_b[:, None]) / (w_r + w_b)[:, None]
    assert (w_b / (w_r + w_b)).min() > 0.05  # the term carries real weight here
    np.testing.assert_allclose(merged, want[0].double().numpy(), rtol=0, atol=2e-5)
