"""The streaming spans of a decode layer (native.attend_spans, fluxion.h "the streaming spans of a decode layer"):
each task's two token ranges attended from the host pages and merged by log-sum-exp into what its output row holds,
against float64 references over the stored keys and values: ragged lengths, ranges crossing pages, empty and
clipped ranges, rows holding an earlier partial (or nothing), GQA ratios, head_dim, dtype, 1 and N threads, every
SIMD path; select_attend + attend_spans over one table equals full attention over selection and ranges; errors."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import native_reference as ref
from native_cases import LENGTHS, N_KV, N_THREADS, PATHS, Case, ragged_store, rotated_cases
from fluxion_lite.hostkv import native


def _ranges(rng: np.random.Generator, n: int) -> list[tuple[int, int]]:
    """Two disjoint ranges of a sequence of n tokens, drawn to cover the shapes a decode step gives: a sink and a
    window, one range empty, a range past the end (clipped), a range crossing a 256-token page, a single token."""
    kind = int(rng.integers(6))
    if kind == 0:  # sink + window
        sink = int(rng.integers(1, min(n, 70) + 1))
        return [(0, sink), (max(sink, n - int(rng.integers(1, 400))), n)]
    if kind == 1:  # window only (empty sink)
        return [(0, 0), (max(0, n - int(rng.integers(1, n + 1))), n)]
    if kind == 2:  # a range reaching past the sequence: clipped to it
        lo = int(rng.integers(0, n))
        return [(lo, n + 500), (0, 0)]
    if kind == 3:  # around a page boundary, then a later single token
        lo = max(0, min(n - 2, 200 + int(rng.integers(0, 30))))
        hi = min(n - 1, lo + 100)
        return [(lo, hi), (n - 1, n)] if hi > lo else [(0, 0), (n - 1, n)]
    if kind == 4:  # both empty: the row stays
        return [(3, 3), (9, 2)]
    a = sorted(int(x) for x in rng.choice(n + 1, 4, replace=False)) if n >= 3 else [0, 0, 0, n]
    return [(a[0], a[1]), (a[2], a[3])]


def _tokens(ranges: list[tuple[int, int]], n: int) -> np.ndarray:
    parts = [np.arange(max(lo, 0), min(hi, n)) for lo, hi in ranges]
    return np.concatenate(parts).astype(np.int64)


def _merge64(o1: np.ndarray, l1: np.ndarray, o2: np.ndarray, l2: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Log-sum-exp merge of two float64 partials [r, D] / [r] (lse -inf: empty)."""
    m = np.maximum(l1, l2)
    safe = np.where(np.isinf(m), 0.0, m)
    w1 = np.where(np.isinf(l1), 0.0, np.exp(l1 - safe))
    w2 = np.where(np.isinf(l2), 0.0, np.exp(l2 - safe))
    tot = w1 + w2
    with np.errstate(invalid="ignore", divide="ignore"):
        out = np.where(tot[:, None] > 0, (w1[:, None] * o1 + w2[:, None] * o2) / np.where(tot > 0, tot, 1)[:, None],
                       0.0)
        lse = np.where(tot > 0, safe + np.log(np.where(tot > 0, tot, 1)), -np.inf)
    return out, lse


@pytest.mark.parametrize("case", rotated_cases() + [Case(PATHS[-1], 16, 256, 16, torch.bfloat16, N_THREADS),
                                                    Case(PATHS[0], 1, 16, 16, torch.float16, 1)], ids=str)
def test_spans_merge_into_rows_as_float64_attention(case: Case, settings: None) -> None:
    native.set_simd(case.simd)
    native.set_threads(case.threads)
    rng = np.random.default_rng(hash(("spans", str(case))) % 2**32)
    store, slots, keys, values = ragged_store(case.head_dim, case.dtype, rng)
    view, r, d = store.view(0), case.ratio, case.head_dim
    q = rng.standard_normal((len(slots), N_KV * r, d), dtype=np.float32)
    scale = d**-0.5
    for trial in range(3):
        items = [(si, h) for si in range(len(slots)) for h in range(N_KV)]
        ranges = [_ranges(rng, LENGTHS[si]) for si, _ in items]
        tasks = np.concatenate([native.make_tasks(slots[si], si, h, case.g, int(rng.integers(0, 5)), exclude=ex)
                                for (si, h), ex in zip(items, ranges)])
        n_rows = len(items) + 3
        rows = np.sort(rng.choice(n_rows, len(items), replace=False)).astype(np.int64)
        # rows hold an earlier partial (some empty: lse -inf with garbage out, which must be ignored)
        out = rng.standard_normal((n_rows, r, d)).astype(np.float32)
        lse = (rng.standard_normal((n_rows, r)) * 3).astype(np.float32)
        lse[rng.random((n_rows, r)) < 0.3] = -np.inf
        before_o, before_l = out.copy(), lse.copy()
        got_tokens = native.attend_spans(view, q, tasks, scale, rows, out, lse)
        want_tokens = 0
        for i, ((si, h), ex) in enumerate(zip(items, ranges)):
            tok = _tokens(ex, LENGTHS[si])
            want_tokens += len(tok)
            row = rows[i]
            o_s, l_s = ref.attention(q[si, h * r:(h + 1) * r], keys[si][tok, h], values[si][tok, h], scale)
            prev_o = np.where(np.isinf(before_l[row])[:, None], 0.0, before_o[row].astype(np.float64))
            want_o, want_l = _merge64(prev_o, before_l[row].astype(np.float64), o_s, l_s)
            if len(tok) == 0:  # the row stays as it was
                np.testing.assert_array_equal(out[row], before_o[row])
                np.testing.assert_array_equal(lse[row], before_l[row])
                continue
            np.testing.assert_allclose(lse[row], want_l, rtol=0, atol=2e-4 * max(1.0, np.abs(want_l).max()),
                                       err_msg=f"trial {trial} task {i} ranges {ex}")
            np.testing.assert_allclose(out[row], want_o, rtol=0, atol=2e-4, err_msg=f"trial {trial} task {i}")
        assert got_tokens == want_tokens
        untouched = np.setdiff1d(np.arange(n_rows), rows)
        np.testing.assert_array_equal(out[untouched], before_o[untouched])
        np.testing.assert_array_equal(lse[untouched], before_l[untouched])


@pytest.mark.parametrize("simd", PATHS)
@pytest.mark.parametrize("threads", (1, N_THREADS))
def test_select_attend_then_spans_is_attention_over_selection_and_ranges(simd: str, threads: int,
                                                                         settings: None) -> None:
    """One task table, as a CPU decode layer runs it: retrieval rows (k > 0) select blocks outside their sink and
    window, streaming rows (k = 0) select nothing; after both calls every row holds softmax attention over its
    selected blocks' tokens and its two ranges."""
    native.set_simd(simd)
    native.set_threads(threads)
    rng = np.random.default_rng(17 + threads)
    d, r, g = 64, 7, 32
    store, slots, keys, values = ragged_store(d, torch.bfloat16, rng)
    view, scale = store.view(0), d**-0.5
    q = rng.standard_normal((len(slots), N_KV * r, d), dtype=np.float32)
    items = [(si, h) for si in range(len(slots)) for h in range(N_KV)]
    ranges, ks = [], []
    for si, h in items:
        n = LENGTHS[si]
        sink_hi = min(n, g)
        win_lo = max(sink_hi, (max(n - 100, 0) // g) * g)
        ranges.append([(0, sink_hi), (win_lo, n)])
        ks.append(0 if h == 1 else 3)
    tasks = np.concatenate([native.make_tasks(slots[si], si, h, g, k, exclude=ex)
                            for (si, h), ex, k in zip(items, ranges, ks)])
    rows = np.arange(len(items), dtype=np.int64)
    out = np.full((len(items), r, d), np.nan, np.float32)
    lse = np.zeros((len(items), r), np.float32)
    prep = native.PreparedSelection(view, q, tasks, scale, rows=rows, out=out, lse=lse)
    selected, _, _ = prep.select_attend(view, 0, len(tasks))
    spans = prep.attend_spans(view, 0, len(tasks))
    assert selected == int((prep.counts * g).sum())
    assert spans == sum(len(_tokens(ex, LENGTHS[si])) for (si, _), ex in zip(items, ranges))
    for i, (si, h) in enumerate(items):
        n = LENGTHS[si]
        blocks = ref.block_tokens(prep.ids[i, :prep.counts[i]].astype(np.int64), g, n)
        tok = np.concatenate([blocks, _tokens(ranges[i], n)])
        assert len(np.unique(tok)) == len(tok)  # the selection skips the ranges
        want_o, want_l = ref.attention(q[si, h * r:(h + 1) * r], keys[si][tok, h], values[si][tok, h], scale)
        np.testing.assert_allclose(lse[i], want_l, rtol=0, atol=2e-4 * max(1.0, np.abs(want_l).max()))
        np.testing.assert_allclose(out[i], want_o, rtol=0, atol=2e-4)


def test_spans_errors_name_the_task_and_leave_rows(settings: None) -> None:
    rng = np.random.default_rng(5)
    store, slots, _, _ = ragged_store(64, torch.bfloat16, rng)
    view, r = store.view(0), 2
    q = rng.standard_normal((len(slots), N_KV * r, 64), dtype=np.float32)
    out, lse = np.zeros((4, r, 64), np.float32), np.full((4, r), -np.inf, np.float32)
    ok = native.make_tasks(slots[0], 0, 0, 16, 0, exclude=[(0, 4), (900, 1000)])
    overlap = native.make_tasks(slots[0], 0, 1, 16, 0, exclude=[(0, 100), (50, 200)])
    with pytest.raises(ValueError, match=r"tasks\[1\]: the ranges \[0, 100\) and \[50, 200\) overlap"):
        native.attend_spans(view, q, np.concatenate([ok, overlap]), 0.125, np.array([0, 1]), out, lse)
    with pytest.raises(ValueError, match=r"rows\[1\]=0: rows must be strictly ascending in \[0, 4\)"):
        native.attend_spans(view, q, np.concatenate([ok, ok]), 0.125, np.array([0, 0]), out, lse)
    with pytest.raises(ValueError, match=r"rows\[0\]=4"):
        native.attend_spans(view, q, ok, 0.125, np.array([4]), out, lse)
    bad_head = native.make_tasks(slots[0], 0, N_KV, 16, 0, exclude=[(0, 4)])
    with pytest.raises(ValueError, match=r"tasks\[0\]\.kv_head=2 out of range"):
        native.attend_spans(view, q, bad_head, 0.125, np.array([0]), out, lse)
    bad_g = native.make_tasks(slots[0], 0, 0, 1, 0, exclude=[(0, 4)])
    with pytest.raises(ValueError, match=r"tasks\[0\]\.g=1 is not one of"):
        native.attend_spans(view, q, bad_g, 0.125, np.array([0]), out, lse)
    with pytest.raises(ValueError, match="scale"):
        native.attend_spans(view, q, ok, float("nan"), np.array([0]), out, lse)
    assert np.isinf(lse).all() and not out.any()  # every rejected call left the rows alone
