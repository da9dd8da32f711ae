"""native.PreparedSelection / PreparedAppend (the graphed decode step's per-layer calls, checked once per step):
they give what the float64 definitions give (native_reference.py) and what the checked wrappers give, over row
ranges of one shared task table, and they still reject bad input with errors naming it. HostKVStore.reserve_decode
makes a decode step's appends leave the page tables (and so the views) alone."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import native_reference as ref
from fluxion_lite.hostkv import native
from fluxion_lite.hostkv.store import HostKVStore

H, D, R = 2, 32, 3  # KV heads, head_dim, query heads per KV head
LENGTHS = (300, 517, 90)


def filled_store(n_layers: int = 2) -> tuple[HostKVStore, list[int], dict[tuple[int, int], tuple[np.ndarray, ...]]]:
    """A bf16 store with random K/V; also returns every (layer, slot)'s K/V as float64 [n, H, D]."""
    store = HostKVStore(n_layers, H, D, dtype=torch.bfloat16, max_seqs=4, granularities=(16, 32, 64))
    g = torch.Generator().manual_seed(0)
    kv: dict[tuple[int, int], tuple[np.ndarray, ...]] = {}
    slots = []
    for n in LENGTHS:
        slot = store.allocate()
        slots.append(slot)
        for layer in range(n_layers):
            k = torch.randn(n, H, D, generator=g).bfloat16()
            v = torch.randn(n, H, D, generator=g).bfloat16()
            store.append(layer, slot, k, v)
            kv[layer, slot] = (k.double().numpy(), v.double().numpy())
    return store, slots, kv


def tasks_for(slots: list[int]) -> np.ndarray:
    """Two layers' worth of tasks in one layer-major table: rows 0..5 and 6..9 (different g and k per row)."""
    rows = []
    for i, (slot, n) in enumerate(zip(slots, LENGTHS)):
        for h in range(H):
            g = (16, 32, 64)[(i + h) % 3]
            rows.append((slot, i, h, g, 2 + i + h, 0, g, (n - 40) // g * g, n))
    first = np.array(rows, np.int32)  # the fields of native.TASK_FIELDS: exclude the sink block and the window
    return np.concatenate([first, first[:4]])


def test_selection_matches_float64_reference_and_the_wrappers() -> None:
    store, slots, kv = filled_store()
    q = torch.from_numpy(np.random.default_rng(2).standard_normal((len(slots), H * R, D), dtype=np.float32))
    tasks = tasks_for(slots)
    scale = D**-0.5
    sel = native.PreparedSelection(store.view(0), q, tasks, scale)
    assert sel.k_cap == int(tasks[:, 4].max())
    for layer, (lo, hi) in enumerate(((0, 6), (6, 10))):
        view = store.view(layer)
        sel.topk(view, lo, hi)
        out, lse = np.full((hi - lo, R, D), np.nan, np.float32), np.full((hi - lo, R), np.nan, np.float32)
        sel.attention(view, lo, hi, out, lse)
        ids_w, _, counts_w = native.group_topk(view, q, tasks[lo:hi])
        out_w, lse_w = native.sparse_attention(view, q, tasks[lo:hi], ids_w, counts_w, scale)
        for i, t in enumerate(tasks[lo:hi]):
            slot, row, h, g, k = (int(x) for x in t[:5])
            n = int(view.n_tokens[slot])
            keys, values = kv[layer, slot]
            qg = q[row, h * R:(h + 1) * R].double().numpy()
            # top-k: the k best eligible blocks by the float64 bound (random data: no near-ties at this size)
            elig = ref.eligible_blocks(n, g, [(int(t[5]), int(t[6])), (int(t[7]), int(t[8]))])
            mins, maxs = ref.block_summaries(keys[:, h], g)
            scores = ref.block_scores(qg, mins[elig], maxs[elig])
            want = np.sort(elig[np.argsort(-scores, kind="stable")[:k]])
            count = int(sel.counts[lo + i])
            assert count == len(want) == int(counts_w[i])
            np.testing.assert_array_equal(sel.ids[lo + i, :count], want)
            np.testing.assert_array_equal(sel.ids[lo + i, :count], ids_w[i, :count])
            toks = ref.block_tokens(want, g, n)
            o_ref, lse_ref = ref.attention(qg, keys[toks, h], values[toks, h], scale)
            np.testing.assert_allclose(out[i], o_ref, rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(lse[i], lse_ref, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(out, out_w)  # the same kernels, the same chunking: bit for bit
        np.testing.assert_array_equal(lse, lse_w)


def test_selection_reads_q_in_place_and_rejects_bad_input() -> None:
    store, slots, _ = filled_store(1)
    q = torch.zeros(len(slots), H * R, D)
    tasks = tasks_for(slots)[:6]
    sel = native.PreparedSelection(store.view(0), q, tasks, 0.5)
    q.copy_(torch.randn(q.shape, generator=torch.Generator().manual_seed(3)))  # refilled after preparing
    sel.topk(store.view(0), 0, 6)
    ids_w, _, counts_w = native.group_topk(store.view(0), q, tasks)
    np.testing.assert_array_equal(sel.counts, counts_w)
    for i, c in enumerate(counts_w):
        np.testing.assert_array_equal(sel.ids[i, :c], ids_w[i, :c])
    with pytest.raises(ValueError, match="scale"):
        native.PreparedSelection(store.view(0), q, tasks, float("nan"))
    with pytest.raises(ValueError, match="q has head_dim"):
        native.PreparedSelection(store.view(0), torch.zeros(3, H * R, D + 16), tasks, 0.5)
    bad = tasks.copy()
    bad[2, 0] = 7  # a slot past the store's 4
    sel = native.PreparedSelection(store.view(0), q, bad, 0.5)
    with pytest.raises(ValueError, match=r"tasks\[2\]\.slot=7"):
        sel.topk(store.view(0), 0, 6)
    other = HostKVStore(1, H, 2 * D, dtype=torch.bfloat16, max_seqs=4)
    with pytest.raises(ValueError, match="shape"):
        native.PreparedSelection(store.view(0), q, tasks, 0.5).topk(other.view(0), 0, 6)
    sel = native.PreparedSelection(store.view(0), q, tasks, 0.5)
    for lo, hi in ((0, 7), (-1, 3), (4, 2)):
        with pytest.raises(ValueError, match="outside the task table"):
            sel.topk(store.view(0), lo, hi)
    sel.topk(store.view(0), 0, 6)
    sel.counts[1] = sel.k_cap + 1  # a selection the C side must refuse
    with pytest.raises(ValueError, match=r"counts\[1\]"):
        sel.attention(store.view(0), 0, 6, np.zeros((6, R, D), np.float32), np.zeros((6, R), np.float32))
    with pytest.raises(ValueError, match="out"):
        sel.attention(store.view(0), 0, 6, np.zeros((5, R, D), np.float32), np.zeros((6, R), np.float32))


def test_append_from_strided_staging_rows_matches_append_batch() -> None:
    """The graphed step appends k and v straight out of its staging copy [B, Hq + 2 Hkv, D]: row b * w + r of the
    [Hkv, D]-row view is batch row b's k, the next row its v."""
    a, slots, _ = filled_store(2)
    b, _, _ = filled_store(2)
    w = R + 2
    g = torch.Generator().manual_seed(4)
    staged = torch.randn(len(slots), w * H, D, generator=g).bfloat16()  # [B, Hq + 2 Hkv, D]
    rows = staged.view(len(slots) * w, H, D)
    n_rows = len(slots) * w - R - 1
    slots32 = np.array(slots, np.int32)
    app = native.PreparedAppend(a.view(0), slots32, np.arange(len(slots)) * w, rows[R:R + n_rows],
                                rows[R + 1:R + 1 + n_rows])
    a.reserve_decode(np.array(slots, np.int64))
    for layer in range(2):
        app.run(a.view(layer))
        b.append_batch(layer, slots, staged[:, R * H:(R + 1) * H].contiguous(), staged[:, (R + 1) * H:].contiguous())
    for layer in range(2):
        for slot, n in zip(slots, LENGTHS):
            assert a.n_tokens(layer, slot) == n + 1
            for x, y in zip(a.read(layer, slot), b.read(layer, slot)):
                torch.testing.assert_close(x, y, rtol=0, atol=0)
            for gran in (16, 32, 64):
                torch.testing.assert_close(a.summaries(layer, slot, gran), b.summaries(layer, slot, gran),
                                           rtol=0, atol=0)
    # refilled slots are used as they are at the call (a step's slots change in place)
    slots32[:] = slots32[::-1]
    a.reserve_decode(slots32.astype(np.int64))
    app.run(a.view(0))
    assert [a.n_tokens(0, s) for s in slots] == [n + 2 for n in LENGTHS]
    torch.testing.assert_close(a.read(0, slots[0])[0][-1], staged[-1, R * H:(R + 1) * H], rtol=0, atol=0)
    with pytest.raises(ValueError, match="row_start"):
        native.PreparedAppend(a.view(0), slots32, np.arange(3) * 100, rows[R:R + n_rows], rows[R + 1:R + 1 + n_rows])
    with pytest.raises(ValueError, match="k has dtype"):
        native.PreparedAppend(a.view(0), slots32, 0, rows.half(), rows.half())


@pytest.mark.parametrize("ahead", [1, 2])
def test_reserve_decode_leaves_the_step_no_page_table_change(ahead: int) -> None:
    """Pages for `ahead` tokens per slot: that many appends (the device path's queued token and its own) change no
    page table, whether a slot ends at a page boundary or one token before it."""
    store = HostKVStore(3, H, D, dtype=torch.bfloat16, max_seqs=3, initial_pages_per_seq=1)
    slots = np.array([store.allocate(), store.allocate(), store.allocate()], np.int64)
    lengths = (256, 100, 255)  # slot 0 ends exactly at a page boundary, slot 2 one token before one
    g = torch.Generator().manual_seed(5)
    for layer in range(3):
        for slot, n in zip(slots.tolist(), lengths):
            store.append(layer, slot, torch.randn(n, H, D, generator=g).bfloat16(),
                         torch.randn(n, H, D, generator=g).bfloat16())
    store.reserve_decode(slots, ahead)
    views = [store.view(layer) for layer in range(3)]
    versions = store.layer_version.copy()
    ks = [torch.randn(3, H, D, generator=g).bfloat16() for _ in range(ahead)]
    for k in ks:
        for layer in range(3):
            native.append(views[layer], slots.astype(np.int32), np.arange(3), 1, k, k)
    assert all(store.view(layer) is views[layer] for layer in range(3))
    np.testing.assert_array_equal(store.layer_version, versions)
    for i, n in enumerate(lengths):
        assert [store.n_tokens(layer, int(slots[i])) for layer in range(3)] == [n + ahead] * 3
        for j, k in enumerate(ks):
            torch.testing.assert_close(store.read(2, int(slots[i]))[0][n + j], k[i], rtol=0, atol=0)


def test_select_attend_writes_rows_in_place_like_topk_then_attention() -> None:
    """One call: top-k, then attention into rows[i] of the caller's buffers; rows without a task get lse = -inf and
    keep their out; the selected-token count and both phases' times come back."""
    store, slots, kv = filled_store(1)
    q = torch.from_numpy(np.random.default_rng(6).standard_normal((len(slots), H * R, D), dtype=np.float32))
    tasks = tasks_for(slots)[:6]
    n_rows = 9
    rows = np.array([0, 2, 3, 5, 7, 8], np.int64)
    out, lse = np.full((n_rows, R, D), 7.0, np.float32), np.zeros((n_rows, R), np.float32)
    scale = D**-0.5
    sel = native.PreparedSelection(store.view(0), q, tasks, scale, rows=rows, out=out, lse=lse)
    tokens, t_select, t_attend = sel.select_attend(store.view(0), 0, 6)
    view = store.view(0)
    ids_w, _, counts_w = native.group_topk(view, q, tasks)
    out_w, lse_w = native.sparse_attention(view, q, tasks, ids_w, counts_w, scale)
    np.testing.assert_array_equal(sel.counts, counts_w)
    assert tokens == int((counts_w.astype(np.int64) * tasks[:, 3]).sum()) and t_select > 0 and t_attend > 0
    np.testing.assert_array_equal(out[rows], out_w)
    np.testing.assert_array_equal(lse[rows], lse_w)
    free = np.setdiff1d(np.arange(n_rows), rows)
    assert np.isneginf(lse[free]).all() and (out[free] == 7.0).all()
    for i, t in enumerate(tasks):  # and against the float64 definition
        slot, row, h, g = (int(x) for x in t[:4])
        keys, values = kv[0, slot]
        toks = ref.block_tokens(sel.ids[i, :sel.counts[i]], g, int(view.n_tokens[slot]))
        o_ref, lse_ref = ref.attention(q[row, h * R:(h + 1) * R].double().numpy(), keys[toks, h], values[toks, h],
                                       scale)
        np.testing.assert_allclose(out[rows[i]], o_ref, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(lse[rows[i]], lse_ref, rtol=1e-5, atol=1e-5)
    # a sub-range of the table, rows taken from the same offset
    sel.select_attend(view, 2, 5)
    np.testing.assert_array_equal(out[rows[2:5]], out_w[2:5])
    assert np.isneginf(lse[[0, 1, 2, 4, 6, 7, 8]]).all()


def test_select_attend_rejects_bad_rows_and_needs_a_destination() -> None:
    store, slots, _ = filled_store(1)
    q = torch.zeros(len(slots), H * R, D)
    tasks = tasks_for(slots)[:3]
    out, lse = np.zeros((4, R, D), np.float32), np.zeros((4, R), np.float32)
    for bad in ([0, 2, 2], [1, 0, 3], [0, 1, 4], [-1, 0, 1]):
        sel = native.PreparedSelection(store.view(0), q, tasks, 0.5, rows=np.array(bad, np.int64), out=out, lse=lse)
        with pytest.raises(ValueError, match="strictly ascending"):
            sel.select_attend(store.view(0), 0, 3)
    with pytest.raises(ValueError, match="select_attend needs rows"):
        native.PreparedSelection(store.view(0), q, tasks, 0.5).select_attend(store.view(0), 0, 3)
    with pytest.raises(ValueError, match="go together"):
        native.PreparedSelection(store.view(0), q, tasks, 0.5, rows=np.arange(3))
    with pytest.raises(ValueError, match="lse"):
        native.PreparedSelection(store.view(0), q, tasks, 0.5, rows=np.arange(3), out=out, lse=lse[:3])
    bad = tasks.copy()
    bad[1, 2] = H  # a KV head the store does not have
    sel = native.PreparedSelection(store.view(0), q, bad, 0.5, rows=np.arange(3), out=out, lse=lse)
    with pytest.raises(ValueError, match=r"tasks\[1\]\.kv_head=2"):
        sel.select_attend(store.view(0), 0, 3)


def test_select_attend_grows_a_fresh_threads_workspace() -> None:
    """A new thread starts with a small workspace (65536 floats); 1200 tasks over 517 tokens at g=16 need more for
    top-k, which C reports before doing anything, and the call grows it and goes on."""
    import threading

    store, slots, _ = filled_store(1)
    q = torch.from_numpy(np.random.default_rng(8).standard_normal((len(slots), H * R, D), dtype=np.float32))
    one = np.array([[slots[1], 1, 1, 16, 5, 0, 16, 448, 517]], np.int32)
    tasks = np.repeat(one, 1200, axis=0)
    out, lse = np.zeros((1200, R, D), np.float32), np.zeros((1200, R), np.float32)
    results: list[object] = []

    def work() -> None:
        try:
            assert native._scratch.ws_floats < 1200 * (2 * 33 + 2)
            sel = native.PreparedSelection(store.view(0), q, tasks, 0.25, rows=np.arange(1200), out=out, lse=lse)
            results.append(sel.select_attend(store.view(0), 0, 1200))
        except Exception as e:  # noqa: BLE001 - reported by the main thread
            results.append(e)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert not isinstance(results[0], Exception), results[0]
    o1, l1 = native.sparse_attention(store.view(0), q, tasks[:1], *native.group_topk(store.view(0), q, tasks[:1])[::2],
                                     0.25)
    # the same selection everywhere; attention splits blocks into chunks by the call's total work: fp32 rounding
    np.testing.assert_allclose(out, np.repeat(o1, 1200, axis=0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse, np.repeat(l1, 1200, axis=0), rtol=1e-6, atol=1e-6)
