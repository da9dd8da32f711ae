"""The AVX512-BF16 path (FLUXION_SIMD=avx512bf16 / set_simd("avx512bf16")): q.k by bf16 dot products when every
element of a task's q is exactly a bf16 value, checked against float64 references; any other q (and fp16 KV)
must run the plain AVX-512 kernels, which these tests check bit for bit."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import native_reference as ref
from native_cases import LENGTHS, N_KV, PATHS, ragged_store
from fluxion_lite.hostkv import native

needs_bf16 = pytest.mark.skipif("avx512bf16" not in PATHS, reason="this CPU has no AVX512-BF16")


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


@pytest.mark.skipif(not os.path.exists("/proc/cpuinfo"), reason="needs Linux /proc/cpuinfo")
def test_detection_agrees_with_the_kernel(settings: None) -> None:
    """The library's CPUID/XGETBV check says what Linux says (the kernel lists avx512_bf16 only where the OS
    enables AVX-512 state), and auto picks the bf16 path exactly where it is supported."""
    flags = _cpu_flags()
    want = "avx512" in PATHS and "avx512_bf16" in flags
    assert ("avx512bf16" in PATHS) == want
    assert (native.set_simd("auto") == "avx512bf16") == want
    if not want:
        with pytest.raises(ValueError, match="not supported"):
            native.set_simd("avx512bf16")


# (GQA ratio r, head_dim, granularity, threads): r 1, 3, 4, 7, 8 at head_dim 64 and 128 on 1 and 2 threads
# (granularity rotating), plus head_dims that end in a 16-wide chunk (d % 32 == 16: the zero-extended last chunk).
_GRANS = (16, 32, 64, 128)
DOT_CASES = [(r, d, _GRANS[i % 4], t)
             for i, (r, d, t) in enumerate((r, d, t) for r in (1, 3, 4, 7, 8) for d in (64, 128) for t in (1, 2))]
DOT_CASES += [(4, 80, 32, 1), (7, 48, 64, 2), (1, 112, 16, 2), (8, 80, 128, 1)]


def _bf16_values(x: np.ndarray) -> np.ndarray:
    """x rounded to the nearest bf16 values, as fp32 (what a bf16 model's q holds)."""
    return torch.from_numpy(x).bfloat16().float().numpy()


def _selection(rng: np.random.Generator, g: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Tasks (one per sequence and KV head of ragged_store) with a random two thirds of each sequence's blocks, in
    random order, always including the partial last block. -> tasks, ids [T, k_cap], counts [T]"""
    rows = [(si, h) for si in range(len(LENGTHS)) for h in range(N_KV)]
    n_blocks = [-(-n // g) for n in LENGTHS]
    k_cap = max(n_blocks)
    ids = np.zeros((len(rows), k_cap), np.int32)
    counts = np.zeros(len(rows), np.int32)
    for ti, (si, _) in enumerate(rows):
        nb = n_blocks[si]
        chosen = rng.permutation(nb - 1)[: max(0, 2 * nb // 3 - 1)]
        chosen = rng.permutation(np.append(chosen, nb - 1))  # the partial last block somewhere in the list
        ids[ti, :len(chosen)] = chosen
        counts[ti] = len(chosen)
    tasks = np.concatenate([native.make_tasks(si, si, h, g) for si, h in rows])
    return tasks, ids, counts


def _attend(simd: str, view: native.KVView, q: np.ndarray, tasks: np.ndarray, ids: np.ndarray,
            counts: np.ndarray, scale: float) -> tuple[np.ndarray, np.ndarray]:
    native.set_simd(simd)
    return native.sparse_attention(view, q, tasks, ids, counts, scale)


@needs_bf16
@pytest.mark.parametrize("r,d,g,threads", DOT_CASES, ids=lambda v: str(v))
def test_bf16_dot_matches_float64_reference(r: int, d: int, g: int, threads: int, settings: None) -> None:
    native.set_threads(threads)
    rng = np.random.default_rng(1000 * r + 10 * d + g + threads)
    store, slots, keys, values = ragged_store(d, torch.bfloat16, rng)  # random K/V offset from zero, never zeros
    assert slots == list(range(len(LENGTHS)))
    view = store.view(0)
    q = _bf16_values(rng.standard_normal((len(LENGTHS), N_KV * r, d), dtype=np.float32) + 0.05)
    assert (q != 0).all()
    tasks, ids, counts = _selection(rng, g)
    scale = 1.0 / np.sqrt(d)

    out, lse = _attend("avx512bf16", view, q, tasks, ids, counts, scale)
    for ti, (si, h) in enumerate((si, h) for si in range(len(LENGTHS)) for h in range(N_KV)):
        tok = ref.block_tokens(ids[ti, :counts[ti]], g, LENGTHS[si])
        want_out, want_lse = ref.attention(q[si, h * r:(h + 1) * r], keys[si][tok, h], values[si][tok, h], scale)
        # the tolerances of every other path (test_native_kernels.py)
        np.testing.assert_allclose(out[ti], want_out, rtol=1e-4, atol=2e-5)
        np.testing.assert_allclose(lse[ti], want_lse, rtol=1e-5, atol=1e-4)

    # the dot products did run: their summation order differs from the fp32 FMAs', so some result bits differ
    out_fma, lse_fma = _attend("avx512", view, q, tasks, ids, counts, scale)
    assert not (np.array_equal(out, out_fma) and np.array_equal(lse, lse_fma))


def _one_ulp_up(x: np.float32) -> np.float32:
    return np.nextafter(x, np.float32(np.inf), dtype=np.float32)


@needs_bf16
@pytest.mark.parametrize("threads", (1, 2))
@pytest.mark.parametrize("r,d", ((4, 128), (7, 64)))
def test_q_not_exactly_bf16_takes_the_fp32_path(r: int, d: int, threads: int, settings: None) -> None:
    """q that is not all bf16 values (plain fp32; bf16 values but one element per group one fp32 ulp off, in the
    group's last head and last lane; bf16 values but one denormal per group) and bf16 q on an fp16 store: bit for bit
    the plain AVX-512 result."""
    native.set_threads(threads)
    rng = np.random.default_rng(r * d + threads)
    store, _, _, _ = ragged_store(d, torch.bfloat16, rng)
    q_fp32 = rng.standard_normal((len(LENGTHS), N_KV * r, d), dtype=np.float32)
    # the check is per task, i.e. per GQA group of query heads: spoil one element of every group
    last_heads = [h * r + r - 1 for h in range(N_KV)]
    q_off_by_one = _bf16_values(q_fp32)
    q_off_by_one[:, last_heads, -1] = _one_ulp_up(q_off_by_one[0, -1, -1])
    q_denormal = _bf16_values(q_fp32)
    q_denormal[:, last_heads, 3] = np.float32(2.0 ** -130)  # a bf16 value, but vdpbf16ps would read it as 0
    assert (torch.from_numpy(q_denormal).bfloat16().float().numpy() == q_denormal).all()
    g = 32
    tasks, ids, counts = _selection(rng, g)
    scale = 1.0 / np.sqrt(d)
    for q in (q_fp32, q_off_by_one, q_denormal):
        want = _attend("avx512", store.view(0), q, tasks, ids, counts, scale)
        got = _attend("avx512bf16", store.view(0), q, tasks, ids, counts, scale)
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])

    # fp16 KV: bf16 dot products do not apply whatever q holds
    store16, _, _, _ = ragged_store(d, torch.float16, rng)
    q = _bf16_values(q_fp32)
    want = _attend("avx512", store16.view(0), q, tasks, ids, counts, scale)
    got = _attend("avx512bf16", store16.view(0), q, tasks, ids, counts, scale)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


@needs_bf16
def test_select_attend_uses_the_same_attention(settings: None) -> None:
    """The decode hot path (PreparedSelection.select_attend, C fx_select_attend) on the bf16 path with bf16 q: the
    same results as top-k then sparse_attention on that path, and within the reference tolerances."""
    native.set_simd("avx512bf16")
    native.set_threads(2)
    rng = np.random.default_rng(5)
    r, d, g = 4, 128, 64
    store, _, keys, values = ragged_store(d, torch.bfloat16, rng)
    view = store.view(0)
    q = _bf16_values(rng.standard_normal((len(LENGTHS), N_KV * r, d), dtype=np.float32))
    rows = [(si, h) for si in range(len(LENGTHS)) for h in range(N_KV)]
    tasks = np.concatenate([native.make_tasks(si, si, h, g, 5) for si, h in rows])
    scale = 1.0 / np.sqrt(d)
    out_sa = np.empty((len(tasks), r, d), np.float32)
    lse_sa = np.empty((len(tasks), r), np.float32)
    prep = native.PreparedSelection(view, q, tasks, scale, rows=np.arange(len(tasks)), out=out_sa, lse=lse_sa)
    prep.select_attend(view, 0, len(tasks))
    ids, _, counts = native.group_topk(view, q, tasks)
    out, lse = native.sparse_attention(view, q, tasks, ids, counts, scale)
    np.testing.assert_array_equal(out_sa, out)
    np.testing.assert_array_equal(lse_sa, lse)
    for ti, (si, h) in enumerate(rows):
        tok = ref.block_tokens(ids[ti, :counts[ti]], g, LENGTHS[si])
        want_out, want_lse = ref.attention(q[si, h * r:(h + 1) * r], keys[si][tok, h], values[si][tok, h], scale)
        np.testing.assert_allclose(out[ti], want_out, rtol=1e-4, atol=2e-5)
        np.testing.assert_allclose(lse[ti], want_lse, rtol=1e-5, atol=1e-4)
