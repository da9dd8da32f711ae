"""Midrange block scoring of the native top-k (native.group_topk(..., scoring="midrange")): the summed query heads
against each block's (min + max) / 2, from the same summaries the Quest bound uses.  Against a float64 reference
across head_dim, GQA ratio, granularity, dtype, ragged lengths, excluded ranges, k, thread counts and every SIMD path
this CPU supports; with pins; and a block the bound over-ranks (one large coordinate) that the midrange does not."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import native_reference as ref
from native_cases import Case, LENGTHS, PATHS, rotated_cases, topk_setup
from fluxion_lite.hostkv import native
from fluxion_lite.hostkv.store import HostKVStore


@pytest.mark.parametrize("case", rotated_cases(), ids=str)
def test_midrange_topk_matches_float64_reference(case: Case, settings: None) -> None:
    t = topk_setup(case, ("midrange", str(case)))
    g, r, d = case.g, case.ratio, case.head_dim
    n_blocks = [-(-n // g) for n in LENGTHS]
    all_ids, all_scores, all_counts = native.group_topk(t.view, t.q, t.tasks(max(n_blocks)), scoring="midrange")
    for k in sorted({1, 3, max(n_blocks) // 2, max(n_blocks) + 5}):
        ids, scores, counts = native.group_topk(t.view, t.q, t.tasks(k), scoring="midrange")
        for ti, (si, h) in enumerate(t.rows):
            mins, maxs = ref.block_summaries(t.keys[si][:, h], g)
            eligible = ref.eligible_blocks(LENGTHS[si], g, t.excludes[si])
            qg = t.q[si, h * r:(h + 1) * r]
            want = ref.midrange_scores(qg, mins, maxs)
            # fp32 sums of r * d products of magnitude |q| * |k|
            tol = 1e-5 * np.abs(qg).sum(axis=0).max() * np.abs(np.concatenate([mins, maxs])).max() * np.sqrt(d)
            chosen = ids[ti, :counts[ti]]
            assert counts[ti] == min(k, len(eligible))
            assert np.all(np.diff(chosen) > 0) and np.isin(chosen, eligible).all()
            np.testing.assert_allclose(scores[ti, :counts[ti]], want[chosen], rtol=0, atol=tol)
            rest = np.setdiff1d(eligible, chosen)
            if len(rest) and len(chosen):
                assert want[chosen].min() >= want[rest].max() - 2 * tol
            e_ids, e_sc = all_ids[ti, :all_counts[ti]], all_scores[ti, :all_counts[ti]]
            want_ids, _ = ref.exact_topk(e_ids, e_sc, k)
            assert chosen.tolist() == want_ids.tolist(), "the k best of the kernel's own scores, ties by lower id"


@pytest.mark.parametrize("simd", PATHS)
def test_midrange_with_pins_keeps_pins_and_fills_by_midrange(simd: str, settings: None) -> None:
    native.set_simd(simd)
    rng = np.random.default_rng(5)
    r, d, n, g = 4, 64, 16 * 30 + 7, 16
    store = HostKVStore(1, 1, d, dtype=torch.float16, max_seqs=1, page_tokens=256)
    slot = store.allocate()
    k = torch.from_numpy(rng.standard_normal((n, 1, d), dtype=np.float32) + 0.3).half()
    store.append(0, slot, k, k)
    q = rng.standard_normal((1, r, d), dtype=np.float32)
    mins, maxs = ref.block_summaries(k.float().numpy()[:, 0].astype(np.float64), g)
    want = ref.midrange_scores(q[0], mins, maxs)
    pins = np.array([[2, 11, 0]], np.int32)
    tasks = native.make_tasks(slot, 0, 0, g, 6)
    ids, _, counts = native.group_topk(store.view(0), q, tasks, scoring="midrange", pins=pins,
                                       pin_counts=np.array([2], np.int32))
    chosen = ids[0, :counts[0]].tolist()
    rest = [b for b in np.argsort(-want, kind="stable").tolist() if b not in (2, 11)][:4]
    assert counts[0] == 6 and chosen == sorted({2, 11, *rest})


def test_a_block_with_one_large_coordinate_is_not_over_ranked() -> None:
    """Why the midrange exists: the bound credits a block for one token's large coordinate on every query sign,
    so a block of ordinary keys with one outlier dimension outranks the block whose keys all align with q."""
    d, g = 64, 16
    rng = np.random.default_rng(0)
    q = np.zeros((1, 2, d), np.float32)
    q[0, :, :8] = 1.0  # both heads look along the first 8 dims
    q[0, :, 8:] = rng.choice([-0.3, 0.3], size=(2, d - 8))
    keys = rng.standard_normal((3 * g, 1, d)).astype(np.float32) * 0.2
    keys[g:2 * g, 0, :8] += 1.0  # block 1: every key aligned with q
    keys[2 * g + 3, 0, 8:] = 6.0 * np.sign(q[0, 0, 8:])  # block 2: one key with a large off-axis part...
    keys[2 * g + 4, 0, 8:] = -6.0 * np.sign(q[0, 0, 8:])  # ...and one against it: huge range, mean ~0
    store = HostKVStore(1, 1, d, dtype=torch.float16, max_seqs=1)
    slot = store.allocate()
    kt = torch.from_numpy(keys).half()
    store.append(0, slot, kt, kt)
    tasks = native.make_tasks(slot, 0, 0, g, 1)
    bound_ids, _, _ = native.group_topk(store.view(0), q, tasks, scoring="group")
    mid_ids, _, _ = native.group_topk(store.view(0), q, tasks, scoring="midrange")
    assert bound_ids[0, 0] == 2 and mid_ids[0, 0] == 1


def test_decode_paths_score_by_the_midrange(monkeypatch: pytest.MonkeyPatch) -> None:
    """A backend with topk_scoring "midrange" (a plan's scoring): the eager and the graphed host decode ask the
    native top-k for it on every call and give the same logits, which differ from the group bound's."""
    from test_native_per_head import scored_decode_runs

    runs = scored_decode_runs(monkeypatch, "midrange")
    for got, want in zip(runs["graphed"], runs["eager"]):
        torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-4)
    assert any(not torch.allclose(x, y, rtol=2e-4, atol=2e-4) for x, y in zip(runs["graphed-group"], runs["graphed"]))
