"""research/sampled_background.py's weighted even sample of unread blocks and research/copy_heads.py's bookkeeping (the
copy alignment and the simulated selection), against float64 references and hand-worked cases on random data."""
from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "research"))

from copy_heads import answer_lines, copy_offset, line_offset, read_mask  # noqa: E402
from sampled_background import group_step, sampled_selection  # noqa: E402

from fluxion_lite.plan.sparse_plan import GroupPlan, SparsePlan  # noqa: E402


def _bound64(qg: torch.Tensor, keys: torch.Tensor, g: int, n_blocks: int) -> torch.Tensor:
    """Group-summed Quest bound per block in float64: qg [r, D], keys [>= n_blocks g, D] -> [n_blocks]."""
    blocks = keys[: n_blocks * g].double().view(n_blocks, g, -1)
    lo, hi = blocks.amin(1), blocks.amax(1)
    q = qg.double()
    return torch.stack([torch.maximum(q * lo[b], q * hi[b]).sum() for b in range(n_blocks)])


@pytest.mark.parametrize("first,last,k,share", [(1, 40, 8, 0.25), (2, 9, 4, 0.5), (1, 30, 10, 0.0), (0, 12, 12, 0.5)])
def test_sampled_selection_splits_top_and_even_sample(first: int, last: int, k: int, share: float) -> None:
    gen = torch.Generator().manual_seed(first * 100 + k)
    bound = torch.randn(last + 3, generator=gen)
    top, picks, weight = sampled_selection(bound, first, last, k, share)
    s = int(round(share * k))
    order = sorted(range(first, last), key=lambda b: -float(bound[b]))
    assert top == order[: k - s]  # the best k - s blocks, best first
    rest = sorted(order[k - s :])
    assert len(picks) == (s if rest else 0) and not set(picks) & set(top)
    assert all(first <= b < last for b in picks) and picks == sorted(picks)
    if picks:
        assert weight == pytest.approx(len(rest) / s)
        # evenly spread: one pick in each of s equal slices of the rest
        for i, b in enumerate(picks):
            assert i * len(rest) / s <= rest.index(b) < (i + 1) * len(rest) / s


@pytest.mark.parametrize("n,g,r,d,budget,share", [(300, 16, 4, 32, 0.1, 0.5), (517, 32, 7, 64, 0.05, 0.25),
                                                  (200, 16, 2, 16, 0.2, 0.0)])
@pytest.mark.parametrize("weighted", [True, False])
def test_group_step_matches_float64_weighted_attention(n: int, g: int, r: int, d: int, budget: float, share: float,
                                                       weighted: bool) -> None:
    gen = torch.Generator().manual_seed(n + r)
    qg = torch.randn(r, d, generator=gen)
    keys, values = torch.randn(n, d, generator=gen), torch.randn(n, d, generator=gen)
    sink, window, scale = 16, 64, d**-0.5
    out, frac = group_step(qg, keys, values, g, budget, sink, window, share, weighted, scale)
    # reference: the same blocks, picked from a float64 bound, each token weighted in float64
    sink_hi, win_lo = -(-sink // g) * g, ((n - window) // g) * g
    first, last = sink_hi // g, win_lo // g
    k = math.ceil(budget * n / g)
    top, picks, weight = sampled_selection(_bound64(qg, keys, g, last).float(), first, last, k, share)
    w = torch.zeros(n, dtype=torch.float64)
    w[:sink_hi] = 1.0
    w[win_lo:] = 1.0
    for b in top:
        w[b * g : (b + 1) * g] = 1.0
    for b in picks:
        w[b * g : (b + 1) * g] = weight if weighted else 1.0
    e = torch.exp((qg.double() @ keys.double().T) * scale) * w[None, :]
    ref = (e / e.sum(-1, keepdim=True)) @ values.double()
    assert frac == pytest.approx(float((w > 0).double().mean()))
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-5)


def test_group_step_whole_budget_is_dense() -> None:
    gen = torch.Generator().manual_seed(7)
    qg, keys, values = torch.randn(3, 16, generator=gen), torch.randn(256, 16, generator=gen), torch.randn(256, 16, generator=gen)
    out, frac = group_step(qg, keys, values, 16, 1.0, 16, 64, 0.0, True, 0.25)
    ref = torch.softmax((qg.double() @ keys.double().T) * 0.25, -1) @ values.double()
    assert frac == 1.0
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)


def test_copy_offset_finds_the_best_alignment() -> None:
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, 50, 400).tolist()
    out = prompt[123:150]
    out[5] = 999  # one miscopied token
    offset, copied = copy_offset(prompt, out)
    assert offset == 123
    assert copied.tolist() == [j != 5 for j in range(len(out))]


def test_answer_lines_and_line_offset_align_each_listed_value_to_its_own_needle() -> None:
    rng = np.random.default_rng(8)
    prompt = rng.integers(100, 200, 600).tolist()
    nl, colon = 7, 8  # token ids standing for a newline and ':' (none of them in the prompt)
    first, second = prompt[50:57], prompt[400:407]  # two 7-token values at different places
    second = second[:3] + [999] + second[4:]  # miscopied fourth token
    out = [colon, nl, nl, 1, 2, *first, nl, 3, 2, *second]
    lines = answer_lines(out, {nl})
    assert lines == [list(range(3, 12)), list(range(13, 22))]  # ':' and the blank line are skipped
    offset, copied = line_offset(prompt, out, lines[1])
    # value tokens of line 1 start at step 15 and come from prompt 400: offset + 15 == 400
    assert offset == 400 - 15
    assert copied.tolist() == [j in (15, 16, 17, 19, 20, 21) for j in range(len(out))]
    offset, copied = line_offset(prompt, out, lines[0])
    assert offset == 50 - 5 and copied.sum() == 7 and copied[5:12].all()


def test_read_mask_holds_sink_window_pins_and_topk() -> None:
    plan = SparsePlan(sink=16, window=64, groups=[[GroupPlan(False, 32, 0.1), GroupPlan(True)]])
    n = 640  # 20 blocks of 32; k = ceil(0.1 x 640 / 32) = 2
    bound = torch.arange(20, dtype=torch.float32)  # block 19 best, then 18, ...
    mask = read_mask(plan, plan.groups[0][0], n, bound, np.array([3]))
    # sink rounded up to 32, window from (640 - 64) // 32 * 32 = 576; eligible blocks 1..17 (18 and 19 are window)
    expect = torch.zeros(n, dtype=torch.bool)
    expect[:32] = True
    expect[576:] = True
    expect[3 * 32 : 4 * 32] = True  # the pin
    expect[17 * 32 : 18 * 32] = True  # the best eligible block fills the second slot
    assert torch.equal(mask, expect)
    stream = read_mask(plan, plan.groups[0][1], n, None, np.zeros(0))
    assert int(stream.sum()) == 16 + 64 and bool(stream[:16].all()) and bool(stream[-64:].all())
