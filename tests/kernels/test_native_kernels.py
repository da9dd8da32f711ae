"""Every native kernel against float64 references, across head_dim, GQA ratio, granularity, dtype, ragged lengths,
k from 1 to all, thread counts and every SIMD path this CPU supports."""
from __future__ import annotations


import numpy as np
import pytest
import torch

import native_reference as ref
from native_cases import Case, LENGTHS, N_KV, N_THREADS, PATHS, ragged_store, rotated_cases
from fluxion_lite.hostkv import native
from fluxion_lite.hostkv.store import HostKVStore


def _cases() -> list[Case]:
    # The rotation, then fixed cases so each path also sees each granularity, dtype and head_dim.
    cases = rotated_cases()
    for simd in PATHS:
        # make sure each path sees every granularity, both dtypes and both head_dims
        for g, dt, d in ((16, torch.bfloat16, 128), (32, torch.float16, 64), (64, torch.bfloat16, 64),
                         (128, torch.float16, 128)):
            cases.append(Case(simd, 4, d, g, dt, N_THREADS))
        # the kernels' other register blockings: GQA 2, 5, 6 and more than 8 heads (two passes), and head_dims that
        # are not a multiple of 32 (AVX-512's 16-wide fallback, AVX2's leftover strips); AVX-512's pv takes 64-wide
        # strips when head_dim % 64 == 0 and r <= 4 (one head, d = 64), 32-wide ones otherwise (d = 96)
        for ratio, d, g, dt in ((1, 64, 32, torch.float16), (4, 96, 64, torch.bfloat16), (2, 80, 32, torch.bfloat16), (5, 48, 64, torch.float16), (6, 128, 16, torch.bfloat16),
                                (12, 64, 128, torch.float16), (2, 128, 64, torch.float16), (1, 80, 16, torch.bfloat16),
                                (12, 128, 32, torch.bfloat16), (8, 48, 64, torch.bfloat16), (3, 128, 64, torch.bfloat16)):
            cases.append(Case(simd, ratio, d, g, dt, 1))
    return cases


CASES = _cases()


@pytest.mark.parametrize("case", CASES, ids=str)
def test_kernels_match_float64_reference(case: Case, settings: None) -> None:
    native.set_simd(case.simd)
    native.set_threads(case.threads)
    rng = np.random.default_rng(hash(str(case)) % 2**32)
    store, slots, keys, values = ragged_store(case.head_dim, case.dtype, rng)
    view = store.view(0)
    g, r, d = case.g, case.ratio, case.head_dim

    # summaries: exact (min/max of exactly converted values), all kept granularities
    for si, slot in enumerate(slots):
        for gg in store.granularities:
            got = store.summaries(0, slot, gg)  # [Hkv, nb, 2, D] in the store's dtype
            assert got.dtype == case.dtype
            got = got.double().numpy()
            for h in range(N_KV):
                mins, maxs = ref.block_summaries(keys[si][:, h], gg)
                np.testing.assert_array_equal(got[h, :, 0], mins)
                np.testing.assert_array_equal(got[h, :, 1], maxs)

    q = rng.standard_normal((len(slots), N_KV * r, d), dtype=np.float32)
    n_blocks = [-(-n // g) for n in LENGTHS]
    for k in sorted({1, 3, max(n_blocks) // 2, max(n_blocks) + 5}):
        excludes = [[(0, g), (n - 2 * g, n)] if si == 0 else [] for si, n in enumerate(LENGTHS)]
        rows = [(si, h) for si in range(len(slots)) for h in range(N_KV)]
        tasks = np.concatenate([
            native.make_tasks(slots[si], si, h, g, k, exclude=excludes[si] or [(0, 0)]) for si, h in rows])
        ids, scores, counts = native.group_topk(view, q, tasks)
        for ti, (si, h) in enumerate(rows):
            mins, maxs = ref.block_summaries(keys[si][:, h], g)
            want_scores = ref.block_scores(q[si, h * r:(h + 1) * r], mins, maxs)
            eligible = ref.eligible_blocks(LENGTHS[si], g, excludes[si])
            chosen = ids[ti, :counts[ti]]
            assert counts[ti] == min(k, len(eligible))
            assert np.all(np.diff(chosen) > 0), "ids ascending and unique"
            assert np.isin(chosen, eligible).all()
            np.testing.assert_allclose(scores[ti, :counts[ti]], want_scores[chosen], rtol=1e-4, atol=1e-3)
            rest = np.setdiff1d(eligible, chosen)
            if len(rest) and len(chosen):
                tol = 1e-4 * np.abs(want_scores).max()
                assert want_scores[chosen].min() >= want_scores[rest].max() - tol

        # sparse attention over the top-k selection, plus an empty selection on the last task
        counts_att = counts.copy()
        counts_att[-1] = 0
        scale = 1.0 / np.sqrt(d)
        out, lse = native.sparse_attention(view, q, tasks, ids, counts_att, scale)
        for ti, (si, h) in enumerate(rows):
            tok = ref.block_tokens(ids[ti, :counts_att[ti]], g, LENGTHS[si])
            want_out, want_lse = ref.attention(q[si, h * r:(h + 1) * r], keys[si][tok, h], values[si][tok, h], scale)
            np.testing.assert_allclose(out[ti], want_out, rtol=1e-4, atol=2e-5)
            np.testing.assert_allclose(lse[ti], want_lse, rtol=1e-5, atol=1e-4)
        assert np.isneginf(lse[-1]).all() and not np.isnan(out).any() and (out[-1] == 0).all()

        # gather: exact copies of the selected blocks' valid tokens, packed per task
        cap = int(counts.sum()) * g
        k_out = torch.empty(cap, d, dtype=case.dtype)
        v_out = torch.empty(cap, d, dtype=case.dtype)
        offs, toks = native.gather(view, tasks, ids, counts, k_out, v_out)
        for ti, (si, h) in enumerate(rows):
            tok = ref.block_tokens(ids[ti, :counts[ti]], g, LENGTHS[si])
            assert toks[ti] == len(tok)
            np.testing.assert_array_equal(k_out[offs[ti]:offs[ti] + len(tok)].float().numpy(), keys[si][tok, h])
            np.testing.assert_array_equal(v_out[offs[ti]:offs[ti] + len(tok)].float().numpy(), values[si][tok, h])

        # block read probe: reads exactly the selected blocks' valid K and V words (wrapping 64-bit sum)
        want = 0
        for ti, (si, h) in enumerate(rows):
            tok = ref.block_tokens(ids[ti, :counts[ti]], g, LENGTHS[si])
            for rows_f64 in (keys[si][tok, h], values[si][tok, h]):
                bits = torch.from_numpy(rows_f64).to(case.dtype).view(torch.int16).numpy()
                want += int(np.frombuffer(bits.tobytes(), np.uint64).sum(dtype=np.uint64))
        assert native.read_blocks_probe(view, tasks, ids, counts) == want % 2**64


@pytest.mark.parametrize("simd", PATHS)
def test_random_selection_with_partial_block_in_the_middle(simd: str, settings: None) -> None:
    """Selections in arbitrary order, partial last block not last, many blocks per task (split into chunks);
    top-k over a task long enough to be split into several work items."""
    native.set_simd(simd)
    native.set_threads(N_THREADS)
    rng = np.random.default_rng(7)
    store = HostKVStore(1, 1, 128, dtype=torch.float16, max_seqs=1, page_tokens=128)
    slot = store.allocate()
    n = 128 * 40 + 9
    k = torch.from_numpy(rng.standard_normal((n, 1, 128), dtype=np.float32)).half()
    v = torch.from_numpy(rng.standard_normal((n, 1, 128), dtype=np.float32)).half()
    store.append(0, slot, k, v)
    keys64 = k.float().numpy()[:, 0].astype(np.float64)
    g, nb = 16, -(-n // 16)
    sel = rng.permutation(nb)[:200].astype(np.int32)
    sel[50] = nb - 1  # the partial block, mid-list
    tasks = native.make_tasks(slot, 0, 0, g)
    q = rng.standard_normal((1, 8, 128), dtype=np.float32)
    out, lse = native.sparse_attention(store.view(0), q, tasks, sel[None], np.array([200], np.int32), 0.09)
    tok = ref.block_tokens(sel, g, n)
    want_out, want_lse = ref.attention(q[0], k.float().numpy()[tok, 0], v.float().numpy()[tok, 0], 0.09)
    np.testing.assert_allclose(out[0], want_out, rtol=1e-4, atol=2e-5)
    np.testing.assert_allclose(lse[0], want_lse, rtol=1e-5, atol=1e-4)
    # top-k over 321 blocks: several work items per task (split scoring, one selection)
    for k_sel in (1, 37, nb):
        exclude = [(0, 64), (n - 100, n)]
        ids, scores, counts = native.group_topk(store.view(0), q,
                                                native.make_tasks(slot, 0, 0, g, k_sel, exclude=exclude))
        mins, maxs = ref.block_summaries(keys64, g)
        want = ref.block_scores(q[0], mins, maxs)
        eligible = ref.eligible_blocks(n, g, exclude)
        chosen = ids[0, :counts[0]]
        assert counts[0] == min(k_sel, len(eligible))
        assert np.all(np.diff(chosen) > 0) and np.isin(chosen, eligible).all()
        rest = np.setdiff1d(eligible, chosen)
        if len(rest):
            assert want[chosen].min() >= want[rest].max() - 1e-4 * np.abs(want).max()
        np.testing.assert_allclose(scores[0, :counts[0]], want[chosen], rtol=1e-4, atol=1e-3)
    k_out = torch.empty(len(tok) + 3, 128, dtype=torch.float16)
    v_out = torch.empty_like(k_out)
    offs, toks = native.gather(store.view(0), tasks, sel[None], np.array([200], np.int32), k_out, v_out,
                               out_offset=np.array([3], np.int64))
    assert toks[0] == len(tok)
    assert torch.equal(k_out[3:], k[tok, 0]) and torch.equal(v_out[3:], v[tok, 0])


def test_ties_prefer_lower_block_ids(settings: None) -> None:
    """Identical blocks score identically: the lower ids must win, whatever the path."""
    store = HostKVStore(1, 1, 64, dtype=torch.bfloat16, max_seqs=1)
    slot = store.allocate()
    pattern = torch.randn(16, 1, 64).to(torch.bfloat16)
    store.append(0, slot, pattern.repeat(20, 1, 1), pattern.repeat(20, 1, 1))  # 20 identical 16-token blocks
    q = np.random.default_rng(1).standard_normal((1, 2, 64), dtype=np.float32)
    for simd in PATHS:
        native.set_simd(simd)
        ids, scores, counts = native.group_topk(store.view(0), q, native.make_tasks(slot, 0, 0, 16, 5,
                                                                                 exclude=[(16, 48)]))
        assert ids[0, :counts[0]].tolist() == [0, 3, 4, 5, 6]
        assert len(set(scores[0].tolist())) == 1


def test_topk_threshold_inside_a_tie_group(settings: None) -> None:
    """k-th best falls inside a group of equal scores (mixed signs around it): the C radix select must take every
    better block and then the lowest ids of the tie group, like a float64 (score desc, id asc) sort."""
    store = HostKVStore(1, 1, 64, dtype=torch.bfloat16, max_seqs=1)
    slot = store.allocate()
    rng = np.random.default_rng(7)
    patterns = torch.randn(4, 16, 1, 64)
    patterns[1] = -patterns[0]  # a negative-scoring pattern next to its positive mirror
    order = rng.integers(0, 4, size=48)
    k = torch.cat([patterns[i] for i in order]).to(torch.bfloat16)
    store.append(0, slot, k, k)
    q = rng.standard_normal((1, 3, 64), dtype=np.float32)
    summ = store.summaries(0, slot, 16)[0].double().numpy()  # [blocks, 2, D]
    qq = q[0].astype(np.float64)  # [r, D]
    ref_scores = np.maximum(qq[:, None, :] * summ[None, :, 0, :], qq[:, None, :] * summ[None, :, 1, :]).sum((0, 2))
    for simd in PATHS:
        native.set_simd(simd)
        for kk in (1, 5, 13, 24, 47, 48, 60):
            ids, _, counts = native.group_topk(store.view(0), q, native.make_tasks(slot, 0, 0, 16, kk))
            pattern_score = {int(i): ref_scores[np.flatnonzero(order == i)[0]] for i in set(order.tolist())}
            keyed = sorted(range(48), key=lambda b: (-pattern_score[int(order[b])], b))
            assert ids[0, :counts[0]].tolist() == sorted(keyed[:kk]), (simd, kk)


def test_k_zero_and_all_blocks_excluded(settings: None) -> None:
    store = HostKVStore(1, 1, 64, dtype=torch.float16, max_seqs=1)
    slot = store.allocate()
    store.append(0, slot, torch.randn(100, 1, 64).half(), torch.randn(100, 1, 64).half())
    q = np.ones((1, 1, 64), np.float32)
    tasks = np.concatenate([native.make_tasks(slot, 0, 0, 32, 0),
                            native.make_tasks(slot, 0, 0, 32, 4, exclude=[(0, 50), (50, 100)])])
    ids, _, counts = native.group_topk(store.view(0), q, tasks, k_cap=4)
    assert counts.tolist() == [0, 0]
    out, lse = native.sparse_attention(store.view(0), q, tasks, ids, counts, 0.1)
    assert (out == 0).all() and np.isneginf(lse).all()


def test_numpy_only_view_matches_documented_layout(settings: None) -> None:
    """Build pages by hand from the header's layout with numpy alone; the kernels must read them correctly."""
    rng = np.random.default_rng(3)
    H, D, P, n, grans = 2, 64, 128, 300, (32, 128)
    page_bytes = native.page_bytes(H, D, P, grans)
    assert page_bytes == 2 * H * P * D * 2 + H * (P // 32) * 2 * D * 2 + H * (P // 128) * 2 * D * 2
    keys = rng.standard_normal((n, H, D)).astype(np.float16)
    vals = rng.standard_normal((n, H, D)).astype(np.float16)
    n_pages = -(-n // P)
    pages = [np.zeros(page_bytes, np.uint8) for _ in range(n_pages)]
    for p, page in enumerate(pages):
        kv = page[: 2 * H * P * D * 2].view(np.float16).reshape(2, H, P, D)
        chunk = slice(p * P, min((p + 1) * P, n))
        rows = chunk.stop - chunk.start
        kv[0, :, :rows] = keys[chunk].transpose(1, 0, 2)
        kv[1, :, :rows] = vals[chunk].transpose(1, 0, 2)
    table = np.zeros((1, 4), np.uint64)
    table[0, :n_pages] = [pg.ctypes.data for pg in pages]
    n_tokens = np.array([n], np.int64)
    view = native.KVView(table, n_tokens, n_kv_heads=H, head_dim=D, page_tokens=P, dtype="float16",
                         granularities=grans)
    native.summaries_update(view, [0], [0])
    s32 = np.concatenate([pg[2 * H * P * D * 2: 2 * H * P * D * 2 + H * (P // 32) * 2 * D * 2].view(np.float16)
                          .reshape(H, P // 32, 2, D) for pg in pages], axis=1)
    mins, maxs = ref.block_summaries(keys[:, 1].astype(np.float64), 32)
    np.testing.assert_array_equal(s32[1, :len(mins), 0], mins)
    np.testing.assert_array_equal(s32[1, :len(mins), 1], maxs)
    q = rng.standard_normal((1, 2 * H, D)).astype(np.float32)
    tasks = native.make_tasks(0, 0, 1, 128, 3)
    ids, _, counts = native.group_topk(view, q, tasks)
    assert counts[0] == 3 and ids[0].tolist() == [0, 1, 2]
    out, lse = native.sparse_attention(view, q, tasks, ids, counts, 0.125)
    want_out, want_lse = ref.attention(q[0, 2:4], keys[:, 1].astype(np.float64), vals[:, 1].astype(np.float64), 0.125)
    np.testing.assert_allclose(out[0], want_out, rtol=1e-4, atol=2e-5)
    np.testing.assert_allclose(lse[0], want_lse, rtol=1e-5, atol=1e-4)


# fx_group_topk selects by one of two methods (native/fluxion.c): a direct selection when m = min(k, n-k+1) is at
# most TOPK_DIRECT_MAX_M and n*m at most TOPK_DIRECT_MAX_WORK (n = eligible blocks), else three histogram passes.
# Both must give exactly the (score desc, id asc) order's k best.  Mirrors of the C constants, only to place test
# cases on both sides of the switch (a change there must keep the results, so these tests stay valid either way).
TOPK_DIRECT_MAX_M, TOPK_DIRECT_MAX_WORK = 32, 8192


def _topk_path(n: int, k: int) -> str:
    if k == 0 or n == 0 or k >= n:
        return "all"
    m = min(k, n - k + 1)
    return "direct" if m <= TOPK_DIRECT_MAX_M and n * m <= TOPK_DIRECT_MAX_WORK else "histogram"


@pytest.mark.parametrize("threads", [1, N_THREADS])
def test_topk_exact_on_both_selection_paths(threads: int, settings: None) -> None:
    """Tasks of 3 to 600 eligible blocks with ties, score trends, zero scores and excluded ranges, several tasks
    per call and k from 1 past the block count, around both limits of the direct path (m = 32/33 and n*m = 8192),
    also from the k-near-n side: selections must equal an exact sort of the kernel's own scores, ids and bits."""
    native.set_threads(threads)
    rng = np.random.default_rng(11)
    D, g = 64, 16
    store = HostKVStore(1, 1, D, dtype=torch.bfloat16, max_seqs=9, page_tokens=256, granularities=(16, 32))
    patterns = torch.from_numpy(rng.standard_normal((4, g, 1, D), dtype=np.float32))
    patterns[3] = 0.0  # zero keys: score exactly 0 (whatever the sign of q)

    def blocks(nb: int, kind: str) -> torch.Tensor:
        out = []
        for b in range(nb):
            if kind == "ties" or (kind == "mixed" and b % 3 == 0):
                out.append(patterns[int(rng.integers(0, 4))])
            elif kind in ("rising", "falling"):  # a positive scale of one pattern: monotone scores (up to bf16)
                out.append(patterns[0] * (1.0 + 3.0 * (b if kind == "rising" else nb - b) / nb))
            else:
                out.append(torch.from_numpy(rng.standard_normal((g, 1, D), dtype=np.float32)))
        return torch.cat(out).to(torch.bfloat16)

    # (blocks, kind, excluded token ranges): block-aligned sink + window, unaligned ranges, none
    layout = [(5, "random", [(0, 16), (64, 80)]), (6, "ties", []), (40, "ties", [(20, 40), (600, 640)]),
              (66, "ties", [(0, 32)]),  # 64 eligible: k = 32 | 33 switches sides at m = 32
              (200, "mixed", [(0, 16), (3168, 3200)]), (259, "rising", [(0, 16), (4112, 4144)]),
              (259, "falling", [(8, 9)]), (301, "mixed", []), (600, "random", [(0, 64), (9500, 9600)])]
    slots, ex = [], []
    for nb, kind, exclude in layout:
        slot = store.allocate()
        k = blocks(nb, kind)
        n_tok = nb * g - (5 if kind == "random" else 0)  # a partial last block on some
        store.append(0, slot, k[:n_tok], k[:n_tok])
        slots.append(slot)
        ex.append(exclude or [(0, 0)])
    view = store.view(0)
    q = rng.standard_normal((1, 2, D), dtype=np.float32)
    q[0, 0, :8] = 0.0

    def run(ks: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        tasks = np.concatenate([native.make_tasks(s, 0, 0, g, k, exclude=e) for s, k, e in zip(slots, ks, ex)])
        return native.group_topk(view, q, tasks, k_cap=max(max(ks), 1))

    # every eligible block's score (k >= blocks: no selection at all)
    all_ids, all_scores, all_counts = run([nb for nb, _, _ in layout])
    elig = []
    for ti, (nb, kind, exclude) in enumerate(layout):
        n_tok = nb * g - (5 if kind == "random" else 0)
        want = ref.eligible_blocks(n_tok, g, exclude)
        assert all_ids[ti, :all_counts[ti]].tolist() == want.tolist()
        elig.append((all_ids[ti, :all_counts[ti]].copy(), all_scores[ti, :all_counts[ti]].copy()))
    assert any(len(np.unique(s)) < len(s) for _, s in elig), "ties present"
    assert any((s == 0).any() for _, s in elig), "zero scores present"

    seen = set()
    for round_ in range(3):
        per_task = []
        for ids_e, _ in elig:
            n = len(ids_e)
            w = TOPK_DIRECT_MAX_WORK // n
            cand = {1, 2, 7, 8, 9, 31, 32, 33, 34, n // 2, n // 2 + 1, n // 2 + 2, w, w + 1, n - w + 1, n - w,
                    n - 32, n - 31, n - 30, n - 8, n - 1, n, n + 3}
            per_task.append(sorted(k for k in cand if k >= 1))
        # each round walks every task through its own k list, so every call mixes tasks on different paths
        for step in range(max(len(c) for c in per_task)):
            ks = [c[(step + round_) % len(c)] for c in per_task]
            ids, scores, counts = run(ks)
            for ti, ((ids_e, sc_e), k) in enumerate(zip(elig, ks)):
                seen.add(_topk_path(len(ids_e), k))
                want_ids, want_sc = ref.exact_topk(ids_e, sc_e, k)
                assert counts[ti] == len(want_ids), (ti, k)
                assert ids[ti, :counts[ti]].tolist() == want_ids.tolist(), (ti, len(ids_e), k)
                np.testing.assert_array_equal(scores[ti, :counts[ti]].view(np.int32), want_sc.view(np.int32))
    assert seen == {"all", "direct", "histogram"}


def test_topk_direct_path_ties_and_small_k(settings: None) -> None:
    """Short tasks on the direct path: all-equal scores, k = 1, a tie group straddling the k-th place from both the
    small-k and the k-near-n side, and a task left with fewer eligible blocks than k by its excluded ranges."""
    native.set_threads(1)
    store = HostKVStore(1, 1, 64, dtype=torch.bfloat16, max_seqs=2, page_tokens=256)
    same = store.allocate()
    pattern = torch.randn(16, 1, 64).to(torch.bfloat16)
    store.append(0, same, pattern.repeat(12, 1, 1), pattern.repeat(12, 1, 1))  # 12 identical blocks
    q = np.random.default_rng(5).standard_normal((1, 2, 64), dtype=np.float32)
    cases = ((1, [], [0]), (3, [(0, 32)], [2, 3, 4]), (10, [(16, 32)], [0] + list(range(2, 11))),  # k = n-1
             (2, [(0, 48), (160, 192)], [3, 4]), (6, [(20, 40), (160, 192)], [0, 3, 4, 5, 6, 7]),  # unaligned
             (5, [(0, 96), (160, 192)], [6, 7, 8, 9]), (8, [(0, 96), (128, 192)], [6, 7]),  # fewer than k
             (12, [], list(range(12))), (4, [(0, 192)], []))
    for k, exclude, want in cases:
        tasks = native.make_tasks(same, 0, 0, 16, k, exclude=exclude)
        ids, scores, counts = native.group_topk(store.view(0), q, tasks)
        assert ids[0, :counts[0]].tolist() == want, (k, exclude)
        assert len(set(scores[0, :counts[0]].tolist())) <= 1

    # blocks 0..9 with scores by pattern: a tie group of 4 (ids 2, 4, 6, 8) below two better blocks
    mixed = store.allocate()
    hi, mid, lo = (torch.randn(16, 1, 64) for _ in range(3))
    order = [lo, hi, mid, lo, mid, hi, mid, lo, mid, lo]
    k_all = torch.cat(order).to(torch.bfloat16)
    store.append(0, mixed, k_all, k_all)
    all_ids, all_sc, all_n = native.group_topk(store.view(0), q, native.make_tasks(mixed, 0, 0, 16, 10))
    sc = all_sc[0, :all_n[0]]
    for k in range(1, 11):
        ids, _, counts = native.group_topk(store.view(0), q, native.make_tasks(mixed, 0, 0, 16, k))
        want, _ = ref.exact_topk(np.arange(10), sc, k)
        assert ids[0, :counts[0]].tolist() == want.tolist(), k
