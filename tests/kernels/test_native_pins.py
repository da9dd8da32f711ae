"""Pinned blocks in the native top-k (fluxion.h, PINNED BLOCKS; native.group_topk / PreparedSelection with pins):
a task's selection is its pins plus the k - P best eligible blocks that are not pinned, ids ascending. Checked
against the definition (native_reference.pinned_selection) on float64 scores and on the kernel's own scores (ties
exact), and against the path it replaced (top-k of all k blocks, then the numpy merge), for both scorings across
the SIMD paths, GQA ratios, head_dim, g, dtype and thread counts (native_cases.rotated_cases); P = 0, P = k, ties;
the one-call select_attend with pins; bad pins rejected with errors naming the entry."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import native_reference as ref
from native_cases import Case, LENGTHS, N_KV, PATHS, excluded_ranges, ragged_store, rotated_cases, topk_setup
from fluxion_lite.hostkv import native
from fluxion_lite.hostkv.store import HostKVStore

SCORINGS = ("group", "per-head")


def _ref_scores(q_group: np.ndarray, keys: np.ndarray, g: int, eligible: np.ndarray, scoring: str) -> np.ndarray:
    """float64 scores of the eligible blocks (in eligible's order)."""
    mins, maxs = ref.block_summaries(keys, g)
    if scoring == "group":
        return ref.block_scores(q_group, mins[eligible], maxs[eligible])
    return ref.per_head_scores(q_group, mins, maxs, eligible)[eligible]


def _pin_table(rng: np.random.Generator, eligible: list[np.ndarray], sizes: list[int], width: int
               ) -> tuple[np.ndarray, np.ndarray]:
    """Random pins (sorted, distinct, eligible) of the given sizes per task: int32 [T, width] padded with garbage
    (the C side must not read past a count), counts int32 [T]."""
    pins = rng.integers(-5, 10**6, size=(len(sizes), width)).astype(np.int32)
    for i, (e, p) in enumerate(zip(eligible, sizes)):
        pins[i, :p] = np.sort(rng.choice(e, size=p, replace=False))
    return pins, np.array(sizes, np.int32)


def _cases() -> list[tuple[Case, str]]:
    return [(case, scoring) for case in rotated_cases() for scoring in SCORINGS]


@pytest.mark.parametrize("case,scoring", _cases(), ids=lambda x: str(x))
def test_pinned_topk_matches_the_definition(case: Case, scoring: str, settings: None) -> None:
    t = topk_setup(case, (str(case), scoring))
    view, keys, q, rows, rng, tasks_with = t.view, t.keys, t.q, t.rows, t.rng, t.tasks
    g, r, d = case.g, case.ratio, case.head_dim
    eligible = [ref.eligible_blocks(LENGTHS[si], g, t.excludes[si]) for si, _ in rows]
    n_blocks = max(-(-n // g) for n in LENGTHS)

    # every eligible block with the kernel's own fp32 score (the scores do not depend on pins)
    all_ids, all_scores, all_counts = native.group_topk(view, q, tasks_with(n_blocks), scoring=scoring)
    for k in sorted({1, 3, n_blocks // 2, n_blocks + 5}):
        tasks = tasks_with(k)
        # P per task: 0, 1, about k / 2 and k (all of the eligible blocks when fewer), rotating over the tasks
        sizes = [min((0, 1, k // 2, k)[(i + k) % 4], len(e)) for i, e in enumerate(eligible)]
        pins, pin_counts = _pin_table(rng, eligible, sizes, width=max(sizes) + 2)
        ids, scores, counts = native.group_topk(view, q, tasks, scoring=scoring, pins=pins, pin_counts=pin_counts)
        ids_k, scores_k, counts_k = native.group_topk(view, q, tasks, scoring=scoring)  # the path it replaces
        for ti, (si, h) in enumerate(rows):
            pin = pins[ti, :sizes[ti]]
            chosen = ids[ti, :counts[ti]]
            assert counts[ti] == min(k, len(eligible[ti])), (k, ti)
            assert np.all(np.diff(chosen) > 0), "ids ascending and unique"
            assert np.isin(pin, chosen).all() and np.isin(chosen, eligible[ti]).all()
            # exactly the definition on the kernel's own scores (ties to the lower id included)
            e_ids, e_sc = all_ids[ti, :all_counts[ti]], all_scores[ti, :all_counts[ti]]
            assert chosen.tolist() == ref.pinned_selection(e_ids, e_sc, pin, k).tolist()
            # and what top-k of all k blocks followed by the merge of its non-pinned best gave before
            assert chosen.tolist() == ref.pinned_selection(ids_k[ti, :counts_k[ti]], scores_k[ti, :counts_k[ti]],
                                                           pin, k).tolist()
            # each returned score is that block's own score, bit for bit, pinned blocks included
            own = dict(zip(e_ids.tolist(), e_sc.view(np.int32).tolist()))
            assert scores[ti, :counts[ti]].view(np.int32).tolist() == [own[b] for b in chosen.tolist()]
            # against float64 scores: the non-pinned picks are the best non-pinned blocks, to fp32 rounding
            want = _ref_scores(q[si, h * r:(h + 1) * r], keys[si][:, h], g, eligible[ti], scoring)
            by_id = dict(zip(eligible[ti].tolist(), want.tolist()))
            tol = 1e-5 * max(1.0, float(np.abs(want).max(initial=0.0))) * np.sqrt(d)
            np.testing.assert_allclose(scores[ti, :counts[ti]], [by_id[b] for b in chosen.tolist()], rtol=0,
                                       atol=tol)
            picked = [by_id[b] for b in chosen.tolist() if b not in set(pin.tolist())]
            rest = [by_id[b] for b in eligible[ti].tolist() if b not in set(chosen.tolist())]
            if picked and rest:
                assert min(picked) >= max(rest) - tol


@pytest.mark.parametrize("scoring", SCORINGS)
def test_no_pins_and_zero_counts_equal_the_plain_call_bitwise(scoring: str, settings: None) -> None:
    """P = 0 everywhere (and a zero-width table) gives the plain top-k's ids, scores and counts bit for bit;
    P = k gives exactly the pins."""
    rng = np.random.default_rng(5)
    store, slots, _, _ = ragged_store(64, torch.bfloat16, rng)
    q = rng.standard_normal((len(slots), N_KV * 4, 64), dtype=np.float32)
    tasks = np.concatenate([native.make_tasks(s, i, np.arange(N_KV), 16, 7, exclude=[(0, 16)])
                            for i, s in enumerate(slots)])
    view = store.view(0)
    plain = native.group_topk(view, q, tasks, scoring=scoring)
    for width in (0, 3):
        got = native.group_topk(view, q, tasks, scoring=scoring, pins=np.zeros((len(tasks), width), np.int32),
                                pin_counts=np.zeros(len(tasks), np.int32))
        np.testing.assert_array_equal(got[2], plain[2])
        for i, c in enumerate(plain[2].tolist()):  # columns past a count are not written
            np.testing.assert_array_equal(got[0][i, :c], plain[0][i, :c])
            np.testing.assert_array_equal(got[1][i, :c].view(np.int32), plain[1][i, :c].view(np.int32))
    # P = k: the pins and nothing else (the 37-token slot has fewer eligible blocks than k: P = all of them)
    eligible = [ref.eligible_blocks(int(view.n_tokens[t[0]]), 16, [(0, 16)]) for t in tasks]
    sizes = [min(7, len(e)) for e in eligible]
    pins, counts = _pin_table(rng, eligible, sizes, 7)
    ids, _, got_counts = native.group_topk(view, q, tasks, scoring=scoring, pins=pins, pin_counts=counts)
    assert got_counts.tolist() == sizes
    for i, p in enumerate(sizes):
        assert ids[i, :p].tolist() == pins[i, :p].tolist()


@pytest.mark.parametrize("scoring", SCORINGS)
def test_ties_go_to_the_lower_unpinned_ids(scoring: str, settings: None) -> None:
    """20 identical blocks score identically: after the pins, the lowest non-pinned, non-excluded ids win."""
    store = HostKVStore(1, 1, 64, dtype=torch.bfloat16, max_seqs=1)
    slot = store.allocate()
    pattern = torch.randn(16, 1, 64, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    store.append(0, slot, pattern.repeat(20, 1, 1), pattern.repeat(20, 1, 1))
    q = np.random.default_rng(1).standard_normal((1, 4, 64), dtype=np.float32)
    for simd in PATHS:
        native.set_simd(simd)
        for k, exclude, pin, want in ((5, [(16, 48)], [0, 7], [0, 3, 4, 5, 7]), (3, [], [1], [0, 1, 2]),
                                      (2, [(0, 16)], [19], [1, 19]), (2, [], [4, 5], [4, 5])):
            tasks = native.make_tasks(slot, 0, 0, 16, k, exclude=exclude)
            ids, _, counts = native.group_topk(store.view(0), q, tasks, scoring=scoring,
                                               pins=np.array([pin], np.int32), pin_counts=np.array([len(pin)],
                                                                                              np.int32))
            assert ids[0, :counts[0]].tolist() == want, (simd, k, pin)


@pytest.mark.parametrize("scoring", SCORINGS)
def test_select_attend_with_pins_equals_topk_then_attention(scoring: str, settings: None) -> None:
    """The one-call path with pins: the same selection as group_topk with pins, attention over it bit for bit as
    sparse_attention, and within fp32 rounding of the float64 attention over those blocks."""
    rng = np.random.default_rng(9)
    r, d, g = 3, 64, 32
    store, slots, keys, values = ragged_store(d, torch.float16, rng)
    q = torch.from_numpy(rng.standard_normal((len(slots), N_KV * r, d), dtype=np.float32))
    excludes = excluded_ranges(g)
    rows_sh = [(si, h) for si in range(len(slots)) for h in range(N_KV)]
    tasks = np.concatenate([native.make_tasks(slots[si], si, h, g, 6, exclude=excludes[si]) for si, h in rows_sh])
    eligible = [ref.eligible_blocks(LENGTHS[si], g, excludes[si]) for si, _ in rows_sh]
    pins, pin_counts = _pin_table(rng, eligible, [min(p, len(e)) for p, e in zip((3, 0, 1, 6, 2, 5), eligible)], 6)
    n_rows, scale = 2 * len(tasks) + 1, d**-0.5
    rows = np.arange(len(tasks), dtype=np.int64) * 2 + 1
    out, lse = np.full((n_rows, r, d), 7.0, np.float32), np.zeros((n_rows, r), np.float32)
    view = store.view(0)
    sel = native.PreparedSelection(view, q, tasks, scale, rows=rows, out=out, lse=lse)
    tokens, _, _ = sel.select_attend(view, 0, len(tasks), scoring, pins, pin_counts)
    ids_w, _, counts_w = native.group_topk(view, q, tasks, scoring=scoring, pins=pins, pin_counts=pin_counts)
    out_w, lse_w = native.sparse_attention(view, q, tasks, ids_w, counts_w, scale)
    np.testing.assert_array_equal(sel.counts, counts_w)
    for i in range(len(tasks)):
        np.testing.assert_array_equal(sel.ids[i, :counts_w[i]], ids_w[i, :counts_w[i]])
    assert tokens == int((counts_w.astype(np.int64) * g).sum())
    np.testing.assert_array_equal(out[rows], out_w)
    np.testing.assert_array_equal(lse[rows], lse_w)
    assert np.isneginf(lse[::2]).all() and (out[::2] == 7.0).all()
    for i, (si, h) in enumerate(rows_sh):
        toks = ref.block_tokens(sel.ids[i, :sel.counts[i]], g, LENGTHS[si])
        o_ref, lse_ref = ref.attention(q[si, h * r:(h + 1) * r].double().numpy(), keys[si][toks, h],
                                       values[si][toks, h], scale)
        np.testing.assert_allclose(out[rows[i]], o_ref, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(lse[rows[i]], lse_ref, rtol=1e-5, atol=1e-5)
    # a sub-range of the table with the pins of those rows only; and PreparedSelection.topk agrees
    sel.select_attend(view, 2, 5, scoring, pins[2:5], pin_counts[2:5])
    np.testing.assert_array_equal(out[rows[2:5]], out_w[2:5])
    sel.topk(view, 0, len(tasks), scoring, pins, pin_counts)
    for i in range(len(tasks)):
        np.testing.assert_array_equal(sel.ids[i, :sel.counts[i]], ids_w[i, :counts_w[i]])


def test_bad_pins_are_rejected_with_the_entry_named(settings: None) -> None:
    rng = np.random.default_rng(3)
    store, slots, _, _ = ragged_store(32, torch.bfloat16, rng)
    view = store.view(0)
    q = rng.standard_normal((len(slots), N_KV, 32), dtype=np.float32)
    # slot 0: 1000 tokens, g = 16 -> 63 blocks, sink block 0 and the window from token 900 (block 56) excluded
    tasks = native.make_tasks(slots[0], 0, np.arange(N_KV), 16, 4, exclude=[(0, 16), (900, 1000)])
    good = np.array([[3, 9, 0, 0], [1, 2, 55, 0]], np.int32)
    good_counts = np.array([2, 3], np.int32)
    native.group_topk(view, q, tasks, pins=good, pin_counts=good_counts)  # accepted
    cases = [
        (good, np.array([2, 5], np.int32), r"pin_counts\[1\]=5 out of range \[0, 4\]"),
        (good, np.array([-1, 0], np.int32), r"pin_counts\[0\]=-1 out of range"),
        (np.array([[3, 9, 10, 11, 12], [1, 2, 3, 4, 5]], np.int32), np.array([5, 0], np.int32),
         r"pin_counts\[0\]=5 exceeds the task's k=4"),
        (np.array([[9, 3, 0, 0], [1, 2, 55, 0]], np.int32), good_counts, r"pins\[0\]: ids must be strictly ascending"),
        (np.array([[3, 3, 0, 0], [1, 2, 55, 0]], np.int32), good_counts, r"pins\[0\]: ids must be strictly ascending"),
        (np.array([[3, 9, 0, 0], [1, 2, 63, 0]], np.int32), good_counts, r"pins\[1, 2\]=63 out of range \[0, 63\)"),
        (np.array([[-2, 9, 0, 0], [1, 2, 55, 0]], np.int32), good_counts, r"pins\[0, 0\]=-2 out of range"),
        (np.array([[0, 9, 0, 0], [1, 2, 55, 0]], np.int32), good_counts,
         r"pins\[0, 0\]=0 .*intersects the task's excluded range \[0, 16\)"),
        (np.array([[3, 9, 0, 0], [1, 2, 56, 0]], np.int32), good_counts,
         r"pins\[1, 2\]=56 .*intersects the task's excluded range \[900, 1000\)"),
    ]
    for pins, counts, match in cases:
        with pytest.raises(ValueError, match="group_topk: " + match):
            native.group_topk(view, q, tasks, pins=pins, pin_counts=counts)
        out, lse = np.zeros((N_KV, 1, 32), np.float32), np.zeros((N_KV, 1), np.float32)
        sel = native.PreparedSelection(view, q, tasks, 0.5, rows=np.arange(N_KV), out=out, lse=lse)
        with pytest.raises(ValueError, match="select_attend: " + match):
            sel.select_attend(view, 0, N_KV, "per-head", pins, counts)
        with pytest.raises(ValueError, match="group_topk: " + match):
            sel.topk(view, 0, N_KV, "group", pins, counts)
    with pytest.raises(ValueError, match="pins and pin_counts go together"):
        native.group_topk(view, q, tasks, pins=good)
    with pytest.raises(ValueError, match="pins must have dtype int32"):
        native.group_topk(view, q, tasks, pins=good.astype(np.int64), pin_counts=good_counts)
    with pytest.raises(ValueError, match="pins has shape"):
        native.group_topk(view, q, tasks, pins=good[:1], pin_counts=good_counts)
    with pytest.raises(ValueError, match="pin_counts has shape"):
        native.group_topk(view, q, tasks, pins=good, pin_counts=good_counts[:1])
    with pytest.raises(ValueError, match="scoring must be one of"):
        native.PreparedSelection(view, q, tasks, 0.5).topk(view, 0, N_KV, "exact")


def test_c_rejects_a_negative_stride_and_missing_pins() -> None:
    """What the wrapper cannot pass: pin_stride < 0 (FX_E_PIN, no task named) and pins NULL while a count is > 0
    (FX_E_PIN naming the task); pins NULL with every count 0 is no pins. Outputs untouched on rejection."""
    rng = np.random.default_rng(4)
    store, slots, _, _ = ragged_store(32, torch.float16, rng)
    q = rng.standard_normal((len(slots), N_KV, 32), dtype=np.float32)
    tasks = native.make_tasks(slots[0], 0, np.arange(N_KV), 16, 3)
    ffi, lib = native.ffi, native.lib
    err = ffi.new("int64_t[1]")
    ids, sc, cnt = np.zeros((2, 3), np.int32), np.zeros((2, 3), np.float32), np.full(2, -7, np.int32)
    ws = np.zeros(1 << 14, np.float32)
    pins, counts = np.array([[1, 2], [3, 4]], np.int32), np.array([0, 2], np.int32)

    def call(pins_ptr: object, counts_ptr: object, stride: int) -> int:
        return lib.fx_group_topk_pinned(store.view(0).struct, ffi.from_buffer("float[]", q), len(slots), N_KV,
                                        ffi.from_buffer("int32_t[]", tasks), 2, 3, 0, pins_ptr, counts_ptr, stride,
                                        ffi.from_buffer("int32_t[]", ids), ffi.from_buffer("float[]", sc),
                                        ffi.from_buffer("int32_t[]", cnt), ffi.from_buffer("float[]", ws), len(ws),
                                        err)

    assert call(ffi.from_buffer("int32_t[]", pins), ffi.from_buffer("int32_t[]", counts), -1) == 14 and err[0] == -1
    assert call(ffi.NULL, ffi.from_buffer("int32_t[]", counts), 2) == 14 and err[0] == 1
    assert (cnt == -7).all()
    assert call(ffi.NULL, ffi.from_buffer("int32_t[]", np.zeros(2, np.int32)), 0) == 0 and (cnt == 3).all()
    assert call(ffi.from_buffer("int32_t[]", pins), ffi.from_buffer("int32_t[]", counts), 2) == 0
    assert ids[1].tolist()[:3] == sorted(set(ids[1].tolist())) and {3, 4} <= set(ids[1].tolist())
    assert lib.fx_version() >= 6  # 7: value sums and the unread background (test_native_background.py)
