"""Runtime behaviour of the native library: GIL released, coexistence with torch's OpenMP, concurrent callers,
settings from the environment, fork; and the HostKVStore's paging."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

import native_reference as ref
from fluxion_lite.hostkv import native
from fluxion_lite.hostkv.store import HostKVStore


def _filled_store(n: int = 2048, heads: int = 2, d: int = 128) -> tuple[HostKVStore, int, torch.Tensor, torch.Tensor]:
    store = HostKVStore(1, heads, d, dtype=torch.bfloat16, max_seqs=2)
    slot = store.allocate()
    k = torch.randn(n, heads, d).bfloat16()
    v = torch.randn(n, heads, d).bfloat16()
    store.append(0, slot, k, v)
    return store, slot, k, v


def test_native_calls_release_the_gil() -> None:
    native.set_threads(1)
    try:
        buf = np.ones(64 << 20, np.uint8)
        entered, done = threading.Event(), threading.Event()
        ticks = 0

        def probe() -> None:
            entered.set()
            native.read_bandwidth_probe(buf, repeats=40)  # one C call reading 2.5 GiB
            done.set()

        worker = threading.Thread(target=probe)
        worker.start()
        entered.wait()
        while not done.is_set():  # if the C call held the GIL this loop could not run until it returned
            ticks += 1
        worker.join()
    finally:
        native.set_threads(native.physical_cores())
    assert ticks > 1000, ticks


def _checked_call(seed: int) -> tuple[HostKVStore, native.KVView, np.ndarray, np.ndarray, np.ndarray, np.ndarray,
                                      np.ndarray, np.ndarray]:
    """A top-k + attention call on a filled store, its KV head 1 checked against the float64 reference: the results
    that the concurrency tests then expect from every repeat. -> store (keeps the view's pages alive), view, q,
    tasks, ids, counts, out, lse."""
    store, slot, k, v = _filled_store()
    view = store.view(0)
    q = np.random.default_rng(seed).standard_normal((1, 8, 128), dtype=np.float32)
    tasks = native.make_tasks(slot, 0, [0, 1], 32, 16)
    ids, _, counts = native.group_topk(view, q, tasks)
    out, lse = native.sparse_attention(view, q, tasks, ids, counts, 0.088)
    tok = ref.block_tokens(ids[1, :counts[1]], 32, 2048)
    exp_out, _ = ref.attention(q[0, 4:8], k.float().numpy()[tok, 1], v.float().numpy()[tok, 1], 0.088)
    np.testing.assert_allclose(out[1], exp_out, rtol=1e-4, atol=2e-5)
    return store, view, q, tasks, ids, counts, out, lse


def test_coexists_with_torch_openmp_and_concurrent_callers() -> None:
    """Two Python threads call the library while torch's OpenMP pool runs matmuls: all results stay correct."""
    store, view, q, tasks, ids, counts, want, want_lse = _checked_call(seed=0)
    a = torch.randn(256, 256)
    torch_ref = a @ a
    errors: list[str] = []

    def attend() -> None:
        for _ in range(30):
            out, lse = native.sparse_attention(view, q, tasks, ids, counts, 0.088)
            if not (np.allclose(out, want, atol=1e-6) and np.allclose(lse, want_lse, atol=1e-6)):
                errors.append("attention result changed under concurrency")

    def matmul() -> None:
        for _ in range(30):
            if not torch.allclose(a @ a, torch_ref):
                errors.append("torch matmul result changed")

    threads = [threading.Thread(target=f) for f in (attend, attend, matmul)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_pool_wake_and_spin_under_concurrent_calls() -> None:
    """wake_threads() from another thread while calls run, with the spin long, short and back at the default: every
    top-k and attention result stays equal to the float64 reference and to the first call's, sleeping workers
    (after an idle gap longer than the spin) still join, and bad spins are refused."""
    store, view, q, tasks, ids0, counts0, out0, lse0 = _checked_call(seed=3)
    stop = threading.Event()

    def waker() -> None:
        while not stop.is_set():
            native.wake_threads()

    native.set_threads(4)  # more participants than cores: wake-ups race with jobs and with each other
    thread = threading.Thread(target=waker)
    thread.start()
    try:
        for spin in (5000.0, 0.0, None):
            assert native.set_spin_us(spin) == (native.DEFAULT_SPIN_US if spin is None else spin)
            for i in range(20):
                if i % 5 == 0:
                    time.sleep(0.002)  # longer than the spin: the workers may sleep before the next call
                ids, _, counts = native.group_topk(view, q, tasks)
                out, lse = native.sparse_attention(view, q, tasks, ids, counts, 0.088)
                np.testing.assert_array_equal(counts, counts0)
                for t in range(len(tasks)):
                    np.testing.assert_array_equal(ids[t, :counts[t]], ids0[t, :counts0[t]])
                np.testing.assert_array_equal(out, out0)
                np.testing.assert_array_equal(lse, lse0)
    finally:
        stop.set()
        thread.join()
        native.set_spin_us(None)
        native.set_threads(native.physical_cores())
    for bad in (-1, float("nan"), "2", True):
        with pytest.raises(ValueError, match="spin must be"):
            native.set_spin_us(bad)  # type: ignore[arg-type]


def test_settings_from_environment() -> None:
    code = ("from fluxion_lite.hostkv import native; print(native.get_simd(), native.get_threads())")
    for simd in native.simd_supported():
        env = dict(os.environ, FLUXION_SIMD=simd, FLUXION_THREADS="3")
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.split() == [simd, "3"]
    env = dict(os.environ, FLUXION_THREADS="lots")
    bad = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert bad.returncode != 0 and "FLUXION_THREADS must be a positive integer" in bad.stderr


def test_pool_survives_fork() -> None:
    store, slot, _, _ = _filled_store(512)
    q = np.ones((1, 2, 128), np.float32)
    tasks = native.make_tasks(slot, 0, 0, 16, 4)
    parent = native.group_topk(store.view(0), q, tasks)[0]
    pid = os.fork()
    if pid == 0:  # child: the parent's worker threads do not exist here
        try:
            child = native.group_topk(store.view(0), q, tasks)[0]
            os._exit(0 if np.array_equal(child, parent) else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0


def test_store_growth_release_and_batched_decode() -> None:
    store = HostKVStore(2, 2, 64, dtype=torch.float16, max_seqs=3, page_tokens=128, initial_pages_per_seq=1)
    a, b = store.allocate(), store.allocate()
    ka, va = torch.randn(300, 2, 64).half(), torch.randn(300, 2, 64).half()
    store.append(1, a, ka[:100], va[:100])
    first_page = int(store.view(1).pages[a, 0])
    store.append(1, a, ka[100:], va[100:])  # grows the page table past its initial width
    assert int(store.view(1).pages[a, 0]) == first_page, "existing pages never move"
    kb = torch.randn(5, 2, 64).half()
    store.append(1, b, kb[:4], kb[:4])
    # one decode step for both sequences in one call
    step_k = torch.stack([ka[0], kb[4]])
    store.append_batch(1, [a, b], step_k, step_k)
    k_read, v_read = store.read(1, a)
    assert k_read.shape == (301, 2, 64)
    assert torch.equal(k_read[:300], ka) and torch.equal(v_read[:300], va) and torch.equal(k_read[300], ka[0])
    assert torch.equal(store.read(1, b)[0], kb)
    assert store.n_tokens(0, a) == 0 and store.n_tokens(1, a) == 301
    used = store.bytes_used
    assert used == store.page_bytes * (3 + 1)
    store.release(a)
    assert store.bytes_used == store.page_bytes * 1
    assert store.n_tokens(1, a) == 0 and int(store.view(1).pages[a, 0]) == 0
    assert store.allocate() == a  # reusable


def test_batched_prefill_chunks_update_summaries() -> None:
    """append_batch with per-slot counts: rows land in the right slots and summaries match the stored keys."""
    store = HostKVStore(1, 1, 32, dtype=torch.bfloat16, max_seqs=2, page_tokens=128, granularities=(16,))
    a, b = store.allocate(), store.allocate()
    k = torch.randn(40 + 150, 1, 32).bfloat16()
    store.append_batch(0, [a, b], k, k, counts=[40, 150])
    assert torch.equal(store.read(0, a)[0], k[:40]) and torch.equal(store.read(0, b)[0], k[40:])
    mins, maxs = ref.block_summaries(k[40:, 0].float().numpy().astype(np.float64), 16)
    got = store.summaries(0, b, 16).double().numpy()  # bf16, exact in float64
    np.testing.assert_array_equal(got[0, :, 0], mins)
    np.testing.assert_array_equal(got[0, :, 1], maxs)
