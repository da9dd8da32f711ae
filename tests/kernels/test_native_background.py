"""The unread-background term of the native library (native.background, fluxion.h "unread background") and the
per-128-token value sums it reads: against float64 references computed from the stored keys and values, across
head_dim, GQA ratio, granularity, dtype, ragged lengths, excluded ranges, selections from the top-k (and empty
ones), thread counts and every SIMD path this CPU supports; the term completing a sparse read to full attention
where its estimate is exact; and the errors for bad input."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import native_reference as ref
from native_cases import LENGTHS, N_KV, N_THREADS, PATHS, Case, excluded_ranges, ragged_store, rotated_cases
from fluxion_lite.hostkv import native
from fluxion_lite.hostkv.store import HostKVStore


def _block_sums(values: np.ndarray) -> np.ndarray:
    """values [n, Hkv, D] float64 -> per-128-token sums [Hkv, n_blocks, D]."""
    n = len(values)
    return np.stack([values[b:b + 128].sum(axis=0) for b in range(0, n, 128)], axis=1)


@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16), ids=("fp16", "bf16"))
@pytest.mark.parametrize("head_dim", (48, 128))
def test_value_sums_follow_prefill_decode_appends_and_rebuilds(dtype: torch.dtype, head_dim: int,
                                                               settings: None) -> None:
    rng = np.random.default_rng(head_dim + (dtype == torch.bfloat16))
    store, slots, _, values = ragged_store(head_dim, dtype, rng, value_sums=True)
    plain = native.page_bytes(N_KV, head_dim, 256, store.granularities)
    assert store.page_bytes == plain + N_KV * (256 // 128) * head_dim * 4
    for slot, v in zip(slots, values):
        want = _block_sums(v)  # float64 of the stored (16-bit) values
        got = store.value_block_sums(0, slot).double().numpy()
        # fp32 sums of up to 128 terms of magnitude ~1
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)
        view = store.view(0)
        native.summaries_update(view, [slot], [len(v) // 2])  # rebuilt from the 128-token block holding it
        np.testing.assert_allclose(store.value_block_sums(0, slot).double().numpy(), want, rtol=0, atol=1e-4)


def _tasks(case: Case, slots: list[int], k: int) -> tuple[np.ndarray, list[tuple[int, int]]]:
    rows = [(si, h) for si in range(len(slots)) for h in range(N_KV)]
    ex = excluded_ranges(case.g)
    return np.concatenate([native.make_tasks(slots[si], si, h, case.g, k, exclude=ex[si]) for si, h in rows]), rows


@pytest.mark.parametrize("case", rotated_cases() + [Case(PATHS[-1], 7, 64, 16, torch.bfloat16, N_THREADS)], ids=str)
def test_background_matches_float64_reference(case: Case, settings: None) -> None:
    native.set_simd(case.simd)
    native.set_threads(case.threads)
    rng = np.random.default_rng(hash(("background", str(case))) % 2**32)
    store, slots, keys, values = ragged_store(case.head_dim, case.dtype, rng, value_sums=True)
    view, g, r, d = store.view(0), case.g, case.ratio, case.head_dim
    q = rng.standard_normal((len(slots), N_KV * r, d), dtype=np.float32)
    scale = d**-0.5
    ex = excluded_ranges(g)
    for k in (0, 1, 5, 1000):  # nothing read, a few blocks, everything eligible read
        tasks, rows = _tasks(case, slots, k)
        ids, _, counts = native.group_topk(view, q, tasks)
        if k == 0:
            ids, counts = np.zeros((len(tasks), 1), np.int32), np.zeros(len(tasks), np.int32)
        out, lse = native.background(view, q, tasks, ids, counts, scale)
        assert out.shape == (len(tasks), r, d) and lse.shape == (len(tasks), r)
        for ti, (si, h) in enumerate(rows):
            want_o, want_l = ref.background(q[si, h * r:(h + 1) * r].astype(np.float64), keys[si][:, h],
                                            values[si][:, h], g, ex[si], ids[ti, :counts[ti]], scale)
            if np.isinf(want_l).all():
                assert np.isinf(lse[ti]).all() and (lse[ti] < 0).all() and not out[ti].any()
                continue
            np.testing.assert_allclose(lse[ti], want_l, rtol=0, atol=2e-4 * max(1.0, np.abs(want_l).max()))
            np.testing.assert_allclose(out[ti], want_o, rtol=0, atol=2e-4)


def test_background_completes_a_sparse_read_to_full_attention_where_its_estimate_is_exact() -> None:
    """Keys equal within every 16-token block (the midrange is each token's key) and values equal within every
    128-token block (the block mean is each token's value): the read part merged with the background term by
    log-sum-exp is full attention over every token."""
    rng = np.random.default_rng(3)
    n, d, r, g = 1000, 64, 4, 32
    keys = np.repeat(rng.standard_normal((-(-n // 16), 1, d)), 16, axis=0)[:n]
    values = np.repeat(rng.standard_normal((-(-n // 128), 1, d)), 128, axis=0)[:n]
    kt, vt = torch.from_numpy(keys).to(torch.bfloat16), torch.from_numpy(values).to(torch.bfloat16)
    k64, v64 = kt.double().numpy()[:, 0], vt.double().numpy()[:, 0]
    store = HostKVStore(1, 1, d, dtype=torch.bfloat16, max_seqs=1, page_tokens=256, value_sums=True)
    slot = store.allocate()
    store.append(0, slot, kt, vt)
    q = rng.standard_normal((1, r, d), dtype=np.float32)
    sink, window = 64, 96
    tasks = native.make_tasks(slot, 0, 0, g, 6, exclude=[(0, sink), (n - window, n)])
    ids, _, counts = native.group_topk(store.view(0), q, tasks)
    bg_out, bg_lse = native.background(store.view(0), q, tasks, ids, counts, d**-0.5)
    read = np.zeros(n, bool)
    read[:-(-sink // g) * g] = True  # the excluded ranges widened to whole g-blocks: what a streaming part reads
    read[(n - window) // g * g:] = True
    for b in ids[0, :counts[0]]:
        read[b * g:(b + 1) * g] = True
    o_read, l_read = ref.attention(q[0].astype(np.float64), k64[read], v64[read], d**-0.5)
    m = np.maximum(l_read, bg_lse[0])
    w_r, w_b = np.exp(l_read - m), np.exp(bg_lse[0] - m)
    merged = (o_read * w_r[:, None] + bg_out[0] * w_b[:, None]) / (w_r + w_b)[:, None]
    full, _ = ref.attention(q[0].astype(np.float64), k64, v64, d**-0.5)
    assert not read.all() and read.any()
    np.testing.assert_allclose(merged, full, rtol=0, atol=2e-5)


def test_background_errors_name_the_bad_input() -> None:
    d = 32
    store = HostKVStore(1, 1, d, dtype=torch.float16, max_seqs=1, page_tokens=256)
    slot = store.allocate()
    kv = torch.randn(300, 1, d).half()
    store.append(0, slot, kv, kv)
    q = np.ones((1, 2, d), np.float32)
    tasks = native.make_tasks(slot, 0, 0, 16, 2)
    ids, counts = np.array([[3, 5]], np.int32), np.array([2], np.int32)
    with pytest.raises(ValueError, match="value sums"):
        native.background(store.view(0), q, tasks, ids, counts, 0.2)
    store = HostKVStore(1, 1, d, dtype=torch.float16, max_seqs=1, page_tokens=256, value_sums=True)
    slot = store.allocate()
    store.append(0, slot, kv, kv)
    view = store.view(0)
    native.background(view, q, tasks, ids, counts, 0.2)  # fine
    with pytest.raises(ValueError, match="strictly ascending"):
        native.background(view, q, tasks, np.array([[5, 3]], np.int32), counts, 0.2)
    with pytest.raises(ValueError, match="strictly ascending"):
        native.background(view, q, tasks, np.array([[3, 19]], np.int32), counts, 0.2)  # 19 blocks of 16
    with pytest.raises(ValueError, match=r"counts\[0\]=3"):
        native.background(view, q, tasks, ids, np.array([3], np.int32), 0.2)
    with pytest.raises(ValueError, match="g=24"):
        native.background(view, q, native.make_tasks(slot, 0, 0, 24, 2), ids, counts, 0.2)
    with pytest.raises(ValueError, match="scale"):
        native.background(view, q, tasks, ids, counts, 0.0)
    with pytest.raises(ValueError, match="q_row"):
        native.background(view, q, native.make_tasks(slot, 1, 0, 16, 2), ids, counts, 0.2)


@pytest.mark.parametrize("threads", (1, N_THREADS))
@pytest.mark.parametrize("simd", PATHS)
def test_long_background_splits_into_items_and_strips(simd: str, threads: int, settings: None) -> None:
    """20K tokens: a task's 157 blocks go into several work items (merged by log-sum-exp), each item's into strips
    of 32 blocks (rescaled as their maxima rise); the result is the float64 reference's."""
    native.set_simd(simd)
    native.set_threads(threads)
    rng = np.random.default_rng(threads)
    n, d, r = 20000, 64, 4
    k = torch.from_numpy(rng.standard_normal((n, 1, d), dtype=np.float32) + 0.1).to(torch.bfloat16)
    v = torch.from_numpy(rng.standard_normal((n, 1, d), dtype=np.float32)).to(torch.bfloat16)
    # a rising trend in the keys' first dimension: later strips raise the running maxima
    k[:, 0, 0] = torch.linspace(-3, 3, n).to(torch.bfloat16)
    store = HostKVStore(1, 1, d, dtype=torch.bfloat16, max_seqs=1, page_tokens=256, value_sums=True)
    slot = store.allocate()
    store.append(0, slot, k[:n - 3], v[:n - 3])
    store.append(0, slot, k[n - 3:], v[n - 3:])
    q = rng.standard_normal((1, r, d), dtype=np.float32)
    q[0, :, 0] = 2.0
    ex = [(0, 16), (n - 64, n)]
    tasks = native.make_tasks(slot, 0, 0, 32, 60, exclude=ex)
    ids, _, counts = native.group_topk(store.view(0), q, tasks)
    out, lse = native.background(store.view(0), q, tasks, ids, counts, d**-0.5)
    want_o, want_l = ref.background(q[0].astype(np.float64), k[:, 0].double().numpy(), v[:, 0].double().numpy(),
                                    32, ex, ids[0, :counts[0]], d**-0.5)
    np.testing.assert_allclose(lse[0], want_l, rtol=0, atol=2e-4 * np.abs(want_l).max())
    np.testing.assert_allclose(out[0], want_o, rtol=0, atol=2e-4)
