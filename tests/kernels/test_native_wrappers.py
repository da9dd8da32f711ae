"""The Python wrappers' fast paths (numpy arrays and CPU torch tensors passed straight to C) give the same results as
the generic path and reject the same mistakes; the per-thread workspace grows when C says it is short; make_tasks and
append keep their checks."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from fluxion_lite.hostkv import native
from fluxion_lite.hostkv.store import HostKVStore

H, D, R = 2, 64, 2  # KV heads, head_dim, query heads per KV head


@pytest.fixture()
def store() -> tuple[HostKVStore, list[int]]:
    store = HostKVStore(1, H, D, dtype=torch.float16, max_seqs=3, granularities=(16, 64))
    rng = torch.Generator().manual_seed(0)
    slots = []
    for n in (300, 77):
        slot = store.allocate()
        store.append(0, slot, torch.randn(n, H, D, generator=rng).half(), torch.randn(n, H, D, generator=rng).half())
        slots.append(slot)
    return store, slots


def _query(rows: int) -> np.ndarray:
    return np.random.default_rng(1).standard_normal((rows, H * R, D), dtype=np.float32)


def test_numpy_and_torch_arguments_agree(store) -> None:
    st, slots = store
    view = st.view(0)
    q = _query(2)
    tasks = native.make_tasks(np.repeat(slots, H), np.repeat([0, 1], H), np.tile(np.arange(H), 2), 16, 3)
    ids, scores, counts = native.group_topk(view, q, tasks)
    # torch query, torch int32 tasks / selections (the generic path for the int arrays), preallocated torch outputs
    out_t = (torch.empty(ids.shape, dtype=torch.int32), torch.empty(scores.shape), torch.empty(counts.shape,
                                                                                               dtype=torch.int32))
    got = native.group_topk(view, torch.from_numpy(q), torch.from_numpy(tasks), out=out_t)
    assert all(g is o for g, o in zip(got, out_t))  # filled and returned as given
    np.testing.assert_array_equal(out_t[0].numpy(), ids)
    np.testing.assert_array_equal(out_t[1].numpy(), scores)
    np.testing.assert_array_equal(out_t[2].numpy(), counts)

    want_o, want_l = native.sparse_attention(view, q, tasks, ids, counts, 0.125)
    o, lse = torch.empty(want_o.shape), torch.empty(want_l.shape)
    got_o, got_l = native.sparse_attention(view, torch.from_numpy(q), tasks, torch.from_numpy(ids),
                                           torch.from_numpy(counts), 0.125, out=o, lse=lse)
    assert got_o is o and got_l is lse
    np.testing.assert_array_equal(o.numpy(), want_o)
    np.testing.assert_array_equal(lse.numpy(), want_l)
    o_np, l_np = np.empty_like(want_o), np.empty_like(want_l)
    assert native.sparse_attention(view, q, tasks, ids, counts, 0.125, out=o_np, lse=l_np)[0] is o_np
    np.testing.assert_array_equal(o_np, want_o)

    rows = int(counts.sum()) * 16
    # zeroed: rows past a partial last block stay unwritten
    k_t, v_t = torch.zeros(rows, D, dtype=torch.float16), torch.zeros(rows, D, dtype=torch.float16)
    k_n, v_n = np.zeros((rows, D), np.float16), np.zeros((rows, D), np.uint16)  # fp16 numpy is viewed as uint16
    offs_t, tok_t = native.gather(view, tasks, ids, counts, k_t, v_t)
    offs_n, tok_n = native.gather(view, tasks, ids, counts, k_n, v_n)
    np.testing.assert_array_equal(offs_t, np.concatenate([[0], np.cumsum(counts[:-1].astype(np.int64) * 16)]))
    np.testing.assert_array_equal(offs_t, offs_n)
    np.testing.assert_array_equal(tok_t, tok_n)
    np.testing.assert_array_equal(k_t.view(torch.int16).numpy().view(np.uint16), k_n.view(np.uint16))
    np.testing.assert_array_equal(v_t.view(torch.int16).numpy().view(np.uint16), v_n)


def test_empty_calls_and_empty_tensors(store) -> None:
    """No tasks: zero-size torch buffers (data_ptr 0) take the generic path; nothing is written, nothing fails."""
    st, _ = store
    view = st.view(0)
    tasks = np.zeros((0, native.TASK_FIELDS), np.int32)
    q = torch.from_numpy(_query(1))
    ids, scores, counts = native.group_topk(view, q, tasks)
    assert ids.shape == (0, 0) and counts.shape == (0,)
    o, lse = native.sparse_attention(view, q, tasks, ids, counts, 0.1, out=torch.empty(0, R, D),
                                     lse=torch.empty(0, R))
    assert tuple(o.shape) == (0, R, D) and tuple(lse.shape) == (0, R)
    offs, tok = native.gather(view, tasks, ids, counts, torch.empty(0, D, dtype=torch.float16),
                              torch.empty(0, D, dtype=torch.float16))
    assert offs.shape == (0,) and tok.shape == (0,)


def test_torch_arguments_are_checked(store) -> None:
    st, slots = store
    view = st.view(0)
    q = torch.from_numpy(_query(2))
    tasks = native.make_tasks(slots[0], 0, [0, 1], 16, 2)
    with pytest.raises(ValueError, match="q must be C-contiguous"):
        native.group_topk(view, q.transpose(0, 1).contiguous().transpose(0, 1), tasks)
    with pytest.raises(ValueError, match="q must have dtype float32, got float64"):
        native.group_topk(view, q.double(), tasks)
    with pytest.raises(ValueError, match="q must be a CPU tensor"):
        native.group_topk(view, q.to("meta"), tasks)
    ids, _, counts = native.group_topk(view, q, tasks)
    with pytest.raises(ValueError, match=r"out has shape \(2, 2, 32\), expected 64 on axis 2"):
        native.sparse_attention(view, q, tasks, ids, counts, 0.1, out=torch.empty(2, R, 32))
    with pytest.raises(ValueError, match="lse must be C-contiguous"):
        native.sparse_attention(view, q, tasks, ids, counts, 0.1, lse=torch.empty(R, 2).t())
    with pytest.raises(ValueError, match="lse must be writable"):
        ro = np.empty((2, R), np.float32)
        ro.flags.writeable = False
        native.sparse_attention(view, q, tasks, ids, counts, 0.1, lse=ro)
    with pytest.raises(ValueError, match=r"counts has shape \(3,\), expected 2 on axis 0"):
        native.sparse_attention(view, q, tasks, ids, np.zeros(3, np.int32), 0.1)
    with pytest.raises(ValueError, match="ids must have dtype int32, got int64"):
        native.gather(view, tasks, ids.astype(np.int64), counts, torch.empty(64, D, dtype=torch.float16),
                      torch.empty(64, D, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"v_out has shape \(63, 64\), expected 64 on axis 0"):
        native.gather(view, tasks, ids, counts, torch.empty(64, D, dtype=torch.float16),
                      torch.empty(63, D, dtype=torch.float16))


def test_workspace_grows_when_c_says_it_is_short(store) -> None:
    """A fresh thread starts with the initial workspace; calls needing more succeed (C reports the shortage before
    touching memory and the wrapper retries with a larger one)."""
    st, slots = store
    view = st.view(0)
    q = _query(1)
    one = native.make_tasks(slots[0], 0, 1, 16, 4)
    copies = 2000  # of one task (19 blocks): top-k needs 2000 * (2 * 19 + 2) floats, attention 2000 * R * (D + 1)
    many = np.repeat(one, copies, axis=0)
    want_ids, want_scores, want_counts = native.group_topk(view, q, one)
    want_o, want_l = native.sparse_attention(view, q, one, want_ids, want_counts, 0.1)
    results: dict[str, object] = {}

    def worker() -> None:
        try:
            results["start"] = native._scratch.ws_floats
            ids, scores, counts = native.group_topk(view, q, many)
            results["after_topk"] = native._scratch.ws_floats
            o, lse = native.sparse_attention(view, q, many, ids, counts, 0.1)
            results["after_attention"] = native._scratch.ws_floats
            results["ok"] = (ids, scores, counts, o, lse)
        except Exception as e:  # noqa: BLE001 - re-raised in the main thread
            results["error"] = e

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    if "error" in results:
        raise results["error"]  # type: ignore[misc]
    ids, scores, counts, o, lse = results["ok"]  # type: ignore[misc]
    # both calls really outgrew what the thread had
    assert results["start"] < results["after_topk"] < results["after_attention"]  # type: ignore[operator]
    assert native._scratch.ws_floats < results["after_attention"]  # type: ignore[operator]  # per thread
    np.testing.assert_array_equal(ids, np.repeat(want_ids, copies, axis=0))
    np.testing.assert_array_equal(scores, np.repeat(want_scores, copies, axis=0))
    np.testing.assert_array_equal(counts, np.repeat(want_counts, copies))
    # a lone task is split into more work items than one of 2000: same values up to float rounding
    np.testing.assert_allclose(o, np.repeat(want_o, copies, axis=0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse, np.repeat(want_l, copies, axis=0), rtol=1e-5, atol=1e-6)


def test_make_tasks_broadcasts_and_checks_int32() -> None:
    t = native.make_tasks([3, 4], 0, np.array([1, 0]), 16, 5, exclude=[(0, np.array([16, 32])), (90, 100)])
    assert t.dtype == np.int32 and t.flags.c_contiguous and t.shape == (2, native.TASK_FIELDS)
    np.testing.assert_array_equal(t, [[3, 0, 1, 16, 5, 0, 16, 90, 100], [4, 0, 0, 16, 5, 0, 32, 90, 100]])
    np.testing.assert_array_equal(native.make_tasks(1, 2, 3, 32), [[1, 2, 3, 32, 0, 0, 0, 0, 0]])
    lo, hi = np.iinfo(np.int32).min, np.iinfo(np.int32).max
    np.testing.assert_array_equal(native.make_tasks(0, 0, 0, 16, hi, exclude=[(lo, 0)])[0, [4, 5]], [hi, lo])
    for bad in (hi + 1, lo - 1, np.iinfo(np.int64).max, np.iinfo(np.int64).min):
        with pytest.raises(ValueError, match="does not fit in int32"):
            native.make_tasks(0, 0, [0, 1], 16, np.array([1, bad], np.int64))
    with pytest.raises(ValueError):
        native.make_tasks([0, 1], [0, 1, 2], 0, 16)  # lengths that do not broadcast
    with pytest.raises(ValueError, match="at most 2 ranges"):
        native.make_tasks(0, 0, 0, 16, exclude=[(0, 1)] * 3)


def test_append_checks_every_item_before_writing(store) -> None:
    st, slots = store
    view = st.view(0)
    k = torch.randn(3, H, D).half()
    before = view.n_tokens.copy()
    cases = [
        (([slots[0], slots[0]], [0, 1], 1, k, k), "each slot may appear once"),
        (([slots[0], 7], [0, 1], 1, k, k), r"slots: values must be in \[0, 3\)"),
        (([slots[0], -1], [0, 1], 1, k, k), r"slots: values must be in \[0, 3\)"),
        (([slots[0], slots[1]], [0, -1], 1, k, k), "rows must lie within k's 3 rows"),
        (([slots[0], slots[1]], 0, [1, -1], k, k), "rows must lie within k's 3 rows"),
        (([slots[0], slots[1]], [0, 2], [2, 2], k, k), "rows must lie within k's 3 rows"),
        (([slots[0]], 0, 1, k.bfloat16(), k.bfloat16()), "k has dtype torch.bfloat16, the KV store holds float16"),
        (([slots[0]], 0, 1, k, k.bfloat16()), "v has dtype torch.bfloat16, the KV store holds float16"),
        (([slots[0]], 0, 1, k.float(), k), "k must be float16 or bfloat16"),
        (([slots[0]], 0, 1, k, k[:2]), r"v has shape \(2, 2, 64\), expected 3 on axis 0"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            native.append(view, *args)
        np.testing.assert_array_equal(view.n_tokens, before)  # a rejected call wrote nothing
    # scalar row_start / row_count broadcast over the slots; numpy fp16 rows are accepted as raw 16-bit
    native.append(view, np.array(slots, np.int32), 0, 2, k.numpy(), k.numpy())
    np.testing.assert_array_equal(view.n_tokens[slots], before[slots] + 2)
    got_k, _ = st.read(0, slots[1])
    torch.testing.assert_close(got_k[-2:], k[:2], rtol=0, atol=0)
