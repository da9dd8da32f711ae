"""Bad input to the native wrappers raises ValueError naming the argument; the C side rejects what slips past."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fluxion_lite.hostkv import native
from fluxion_lite.errors import CapacityError
from fluxion_lite.hostkv.store import HostKVStore


@pytest.fixture()
def setup():
    store = HostKVStore(1, 2, 64, dtype=torch.float16, max_seqs=2, granularities=(16, 64))
    slot = store.allocate()
    store.append(0, slot, torch.randn(100, 2, 64).half(), torch.randn(100, 2, 64).half())
    q = np.random.default_rng(0).standard_normal((1, 4, 64), dtype=np.float32)
    tasks = native.make_tasks(slot, 0, [0, 1], 16, 3)
    return store, store.view(0), q, tasks


def _raises(match: str):
    return pytest.raises(ValueError, match=match)


def test_query_shape_and_dtype(setup) -> None:
    _, view, q, tasks = setup
    with _raises("q must have dtype float32"):
        native.group_topk(view, q.astype(np.float64), tasks)
    with _raises("q has head_dim 32"):
        native.group_topk(view, q[..., :32].copy(), tasks)
    with _raises("not a multiple of n_kv_heads"):
        native.group_topk(view, q[:, :3].copy(), tasks)
    with _raises("q must be C-contiguous"):
        native.group_topk(view, np.asfortranarray(np.ones((2, 4, 64), np.float32)), tasks)
    with _raises("q must be 3-D"):
        native.group_topk(view, q[0], tasks)


def test_task_fields_out_of_range(setup) -> None:
    _, view, q, tasks = setup
    for col, name, value in ((0, "slot", 9), (1, "q_row", 1), (2, "kv_head", 2), (3, "g", 32)):
        bad = tasks.copy()
        bad[1, col] = value
        with _raises(rf"tasks\[1\]\.{name}={value}"):
            native.group_topk(view, q, bad)
    bad = tasks.copy()
    bad[0, 4] = -1
    with _raises(r"tasks\[0\]\.k=-1"):
        native.group_topk(view, q, bad, k_cap=3)
    with _raises("tasks must have dtype int32"):
        native.group_topk(view, q, tasks.astype(np.int64))


def test_selection_out_of_range(setup) -> None:
    _, view, q, tasks = setup
    ids = np.array([[0, 1, 7], [0, 1, 2]], np.int32)  # 100 tokens / g=16 -> 7 blocks: id 7 is past the end
    with _raises(r"ids\[0, 2\]=7 out of range \[0, 7\)"):
        native.sparse_attention(view, q, tasks, ids, np.array([3, 3], np.int32), 0.1)
    with _raises(r"counts\[1\]=4 out of range"):
        native.sparse_attention(view, q, tasks, ids, np.array([2, 4], np.int32), 0.1)
    with _raises("scale must be a positive finite number"):
        native.sparse_attention(view, q, tasks, ids, np.array([2, 2], np.int32), float("nan"))


def test_gather_capacity(setup) -> None:
    _, view, _, tasks = setup
    ids = np.array([[0, 1, 6], [2, 3, 4]], np.int32)
    counts = np.array([3, 3], np.int32)
    small = torch.empty(40, 64, dtype=torch.float16)
    with _raises("capacity"):
        native.gather(view, tasks, ids, counts, small, small.clone())
    k_out = torch.empty(100, 64, dtype=torch.float16)
    with _raises("capacity"):
        native.gather(view, tasks, ids, counts, k_out, k_out.clone(), out_offset=np.array([0, 90], np.int64))
    with _raises("k_out has shape"):
        native.gather(view, tasks, ids, counts, torch.empty(100, 32, dtype=torch.float16),
                      torch.empty(100, 32, dtype=torch.float16))


def test_c_validation_catches_what_bypasses_python(setup) -> None:
    """Call the C entry point directly with a bad block id and a missing page: an error code, no crash."""
    store, view, q, tasks = setup
    ids = np.array([[0, 1, 1000], [0, 1, 2]], np.int32)
    counts = np.array([3, 3], np.int32)
    ffi, lib = native.ffi, native.lib
    out = np.empty((2, 2, 64), np.float32)
    lse = np.empty((2, 2), np.float32)
    ws = np.empty(lib.fx_attention_workspace_floats(2, 2, 64), np.float32)
    err = ffi.new("int64_t[1]")
    p = native._ptr
    rc = lib.fx_sparse_attention(view.struct, p(q, "float *"), 1, 4, p(tasks, "int32_t *"), 2, p(ids, "int32_t *"),
                                 p(counts, "int32_t *"), 3, 0.1, p(out, "float *"), p(lse, "float *"),
                                 p(ws, "float *"), ws.size, err)
    assert rc == 7 and err[0] == 0  # FX_E_BLOCK in task 0
    saved = view.pages[0, 0]
    view.pages[0, 0] = 0
    try:
        with _raises("page .* missing"):
            native.group_topk(view, q, tasks)
    finally:
        view.pages[0, 0] = saved
    rc = lib.fx_sparse_attention(view.struct, p(q, "float *"), 1, 4, p(tasks, "int32_t *"), 2, p(ids, "int32_t *"),
                                 p(counts, "int32_t *"), 3, 0.1, p(out, "float *"), p(lse, "float *"),
                                 p(ws, "float *"), 10, err)
    assert rc in (7, 9)  # still rejected (bad id or too small workspace), never a crash


def test_settings_reject_bad_values() -> None:
    with _raises("simd must be one of"):
        native.set_simd("sse9")
    with _raises("threads must be a positive int"):
        native.set_threads(0)
    with _raises("granularities"):
        native.page_bytes(2, 64, 256, (24,))


def test_store_input_errors() -> None:
    store = HostKVStore(2, 2, 64, dtype=torch.bfloat16, max_seqs=1)
    slot = store.allocate()
    with pytest.raises(CapacityError):
        store.allocate()
    with _raises("dtype torch.float16"):
        store.append(0, slot, torch.randn(3, 2, 64).half(), torch.randn(3, 2, 64).half())
    with _raises(r"k must be \[T, 2, 64\]"):
        store.append(0, slot, torch.randn(3, 64).bfloat16(), torch.randn(3, 64).bfloat16())
    with _raises("layer 2 out of range"):
        store.append(2, slot, torch.randn(3, 2, 64).bfloat16(), torch.randn(3, 2, 64).bfloat16())
    with _raises("slot 5 is not allocated"):
        store.append(0, 5, torch.randn(3, 2, 64).bfloat16(), torch.randn(3, 2, 64).bfloat16())
    with _raises("page_tokens must be a positive multiple of 128"):
        HostKVStore(1, 1, 64, page_tokens=100)
    with _raises("head_dim must be a multiple of 16"):
        HostKVStore(1, 1, 72)
