"""Block summaries live in the KV's own 16-bit dtype (native/fluxion.h).  Min and max of 16-bit keys are 16-bit
values, so the summaries must be the exact per-block min/max of the stored keys, and the Quest bound (widened to
fp32 in the kernel) and the top-k selection must equal a float64 reference computed from the keys themselves:
for group and per-head scoring, fp16 and bf16, across incremental decode appends that leave blocks partly filled, on every SIMD path this CPU
runs, with one and several threads."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

import native_reference as ref
from fluxion_lite.hostkv import native
from fluxion_lite.hostkv.store import HostKVStore

PATHS = native.simd_supported()
N_THREADS = max(2, native.physical_cores())
GRANS = (16, 32, 64, 128)
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
HKV, R = 2, 4  # KV heads, query heads per KV head


def _grid(rng: np.random.Generator, shape: tuple[int, ...], levels: int, step: float) -> np.ndarray:
    """Multiples of step in [-levels*step, levels*step] (float32)."""
    return (rng.integers(-levels, levels + 1, size=shape) * step).astype(np.float32)


def _check_summaries(store: HostKVStore, slot: int, keys64: np.ndarray) -> None:
    """keys64 [n, Hkv, D]: the slot's keys so far, as float64."""
    for g in GRANS:
        got = store.summaries(0, slot, g)  # [Hkv, n_blocks, 2, D]
        assert got.dtype == store.dtype
        got = got.double().numpy()
        for h in range(HKV):
            mins, maxs = ref.block_summaries(keys64[:, h], g)
            np.testing.assert_array_equal(got[h, :, 0], mins)
            np.testing.assert_array_equal(got[h, :, 1], maxs)


def _check_selection(store: HostKVStore, slots: list[int], keys64: list[np.ndarray], q: np.ndarray,
                     exact: list[bool]) -> None:
    """Top-k of every (slot, KV head) at every g and a few k, group and per-head scoring, against the float64 bound
    of the exact min/max.  exact[si]: the slot's scores are exact in fp32 (grid keys and queries), so ids and scores
    must be equal; otherwise the chosen blocks must be the best up to float32 rounding."""
    view = store.view(0)
    for g, scoring in itertools.product(GRANS, ("group", "per-head")):
        n_blocks = [-(-len(k) // g) for k in keys64]
        for k in sorted({1, 3, max(n_blocks) // 2 + 1, max(n_blocks)}):
            excl = [[(0, g), (len(kk) - g, len(kk))] for kk in keys64]  # a sink block and the recent block
            rows = [(si, h) for si in range(len(slots)) for h in range(HKV)]
            tasks = np.concatenate([native.make_tasks(slots[si], si, h, g, k, exclude=excl[si]) for si, h in rows])
            ids, scores, counts = native.group_topk(view, q, tasks, scoring=scoring)
            for ti, (si, h) in enumerate(rows):
                n = len(keys64[si])
                mins, maxs = ref.block_summaries(keys64[si][:, h], g)
                eligible = ref.eligible_blocks(n, g, excl[si])
                qg = q[si, h * R:(h + 1) * R]
                want = (ref.block_scores(qg, mins, maxs) if scoring == "group"  # float64 [n_blocks]
                        else ref.per_head_scores(qg, mins, maxs, eligible))
                chosen = ids[ti, :counts[ti]]
                assert counts[ti] == min(k, len(eligible))
                if exact[si]:
                    assert np.array_equal(want[eligible], want[eligible].astype(np.float32)), "premise: exact in fp32"
                    best = sorted(eligible.tolist(), key=lambda b: (-want[b], b))[:k]  # ties -> lower id
                    assert chosen.tolist() == sorted(best), (g, scoring, k, si, h)
                    assert np.array_equal(scores[ti, :counts[ti]], want[chosen].astype(np.float32))
                else:
                    assert np.all(np.diff(chosen) > 0) and np.isin(chosen, eligible).all()
                    # fp32 rounding scales with the bounds (per-head scores are differences of them)
                    tol = 1e-5 * np.abs(ref.head_bounds(qg, mins, maxs)).sum(axis=0).max()
                    np.testing.assert_allclose(scores[ti, :counts[ti]], want[chosen], rtol=0, atol=tol)
                    rest = np.setdiff1d(eligible, chosen)
                    if len(rest) and len(chosen):
                        assert want[chosen].min() >= want[rest].max() - tol


@pytest.mark.parametrize("threads", (1, N_THREADS))
@pytest.mark.parametrize("dtype", DTYPES.keys())
@pytest.mark.parametrize("simd", PATHS)
@pytest.mark.parametrize("head_dim", (48, 128))
def test_selection_with_16bit_summaries_equals_float64_reference(simd: str, dtype: str, threads: int,
                                                                  head_dim: int, settings: None) -> None:
    native.set_simd(simd)
    native.set_threads(threads)
    dt, d = DTYPES[dtype], head_dim
    rng = np.random.default_rng([PATHS.index(simd), threads, head_dim, dtype == "bf16"])
    store = HostKVStore(1, HKV, d, dtype=dt, max_seqs=2, page_tokens=128, initial_pages_per_seq=1)
    slots = [store.allocate(), store.allocate()]
    # slot 0: keys on a grid of 1/8 in [-4, 4] and queries on a grid of 1/2: exact in both dtypes, and every bound
    # (sums of products, multiples of 1/16 far below 2^24/16) is exact in fp32, so the selection must match the
    # float64 ranking exactly, ties included.  Slot 1: normal keys (every dtype rounding, subnormals unlikely).
    final = (300, 160)  # slot 1 finishes first: the last steps append to slot 0 alone
    prefill = (237, 100)  # both mid-block for every g
    keys = [torch.from_numpy(_grid(rng, (final[0], HKV, d), 32, 1 / 8)).to(dt),
            torch.from_numpy(rng.standard_normal((final[1], HKV, d), dtype=np.float32) * 2 - 0.5).to(dt)]
    values = [torch.randn(n, HKV, d).to(dt) for n in final]
    keys64 = [k.double().numpy() for k in keys]
    for si, slot in enumerate(slots):
        store.append(0, slot, keys[si][:prefill[si]], values[si][:prefill[si]])
    q = np.stack([_grid(rng, (HKV * R, d), 4, 1 / 2), rng.standard_normal((HKV * R, d), dtype=np.float32)])
    exact = [True, False]
    # decode: one token per slot per step through the hot-path append, across block and page boundaries
    slots_a = np.array(slots, np.int64)
    for step in range(final[0] - prefill[0] + 1):
        n = [min(prefill[si] + step, final[si]) for si in range(2)]
        if step % 9 == 0 or step in (3, 11, 19) or n[0] == final[0]:  # partial blocks at 240, 243, 251, 256+
            for si, slot in enumerate(slots):
                _check_summaries(store, slot, keys64[si][:n[si]])
            _check_selection(store, slots, [keys64[si][:n[si]] for si in range(2)], q, exact)
        live = [si for si in range(2) if n[si] < final[si]]
        if not live:
            break
        store.append_batch(0, slots_a[live].tolist(), torch.stack([keys[si][n[si]] for si in live]),
                           torch.stack([values[si][n[si]] for si in live]))  # one token per slot: a decode step
    assert [store.n_tokens(0, s) for s in slots] == list(final)


@pytest.mark.parametrize("dtype", DTYPES.keys())
@pytest.mark.parametrize("simd", PATHS)
def test_every_16bit_value_round_trips_through_a_summary(simd: str, dtype: str, settings: None) -> None:
    """Blocks of 16 identical rows hold every non-NaN bit pattern of the dtype (subnormals, both zeros, infinities):
    each block's min and max are the row itself, so the stored summary must hold the same bits."""
    native.set_simd(simd)
    dt, d = DTYPES[dtype], 128
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    as_float = torch.from_numpy(bits.view(np.int16)).view(dt).float()
    bits = bits[~torch.isnan(as_float).numpy()]
    bits = np.concatenate([bits, np.zeros((-len(bits)) % d, np.uint16)]).reshape(-1, d)  # [rows, D]
    keys = torch.from_numpy(np.repeat(bits, 16, axis=0).view(np.int16)).view(dt)[:, None, :]  # [16*rows, 1, D]
    store = HostKVStore(1, 1, d, dtype=dt, max_seqs=1, page_tokens=256, granularities=(16,))
    slot = store.allocate()
    store.append(0, slot, keys[:1000], keys[:1000])  # a prefill ending mid-block, then the rest appended to it
    store.append(0, slot, keys[1000:], keys[1000:])
    got = store.summaries(0, slot, 16)[0].view(torch.int16).numpy().view(np.uint16)  # [rows, 2, D]
    np.testing.assert_array_equal(got[:, 0], bits)
    np.testing.assert_array_equal(got[:, 1], bits)
