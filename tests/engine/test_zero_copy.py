"""Zero-copy GPU feeder on a CPU-only machine (the "alias" is the host memory itself, the "GPU" torch on the CPU):
the same index math and ops as on CUDA. Outputs equal all-CPU and dense; slab allocation of the host store."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from fluxion_lite.hostkv import native
from fluxion_lite.errors import CapacityError
from fluxion_lite.hostkv.store import CHUNK_TOKENS, HostKVStore
from fluxion_lite.sparse.attend import block_attention
from fluxion_lite.sparse.backend import SparseAttention
from fluxion_lite.plan.sparse_plan import SparsePlan
from fluxion_lite.sparse.zero_copy import ZeroCopyFeeder, check, raw_view
from test_hybrid import SPLIT_COSTS, config, dense_reference, mixed_plan, run

CPU = torch.device("cpu")


@pytest.mark.parametrize("placement", ["gpu", "auto"])
@pytest.mark.parametrize("heads", [(4, 2), (8, 2), (3, 3), (16, 2)])
def test_zero_copy_full_budget_equals_dense_and_all_cpu(placement: str, heads: tuple[int, int]) -> None:
    cfg = config(*heads)
    lengths, n_dec = [700, 333], 3
    attn = SparseAttention(cfg, mixed_plan(cfg, 1.0), torch.float32, CPU, max_seqs=4, host_decode=False, placement=placement,  # type: ignore[arg-type]
                           costs=SPLIT_COSTS, zero_copy=True)
    assert attn.zero_copy and attn.executor.feeder is not None and attn.costs.costs.zero_copy
    out, data = run(attn, cfg, lengths, n_dec)
    ref = dense_reference(cfg, lengths, n_dec, data)
    assert torch.allclose(out[:, 1], ref[:, 1], atol=1e-4, rtol=1e-4)
    retrieval_heads = slice(cfg.gqa_ratio, None) if cfg.n_kv_heads > 1 else slice(None)
    assert torch.allclose(out[:, 0, :, retrieval_heads], ref[:, 0, :, retrieval_heads], atol=1e-4, rtol=1e-4)
    cpu = SparseAttention(cfg, mixed_plan(cfg, 1.0), torch.float32, CPU, max_seqs=4, host_decode=False, placement="cpu",
                          costs=SPLIT_COSTS)
    out_cpu, _ = run(cpu, cfg, lengths, n_dec)
    assert torch.allclose(out, out_cpu, atol=1e-4)
    s = attn.stats()
    assert s["zero_copy"] == 1.0 and s["gather_ms"] == 0.0  # no CPU gather on the zero-copy path
    if placement == "gpu":
        assert s["gpu_byte_fraction"] == 1.0 and s["zero_copy_mb"] > 0
    else:
        assert 0.0 < s["gpu_byte_fraction"] < 1.0  # the zero-copy model split the tasks


@pytest.mark.parametrize("g", [16, 32, 64, 128])
def test_zero_copy_sparse_budget_matches_all_cpu_per_g(g: int) -> None:
    cfg = config(8, 2, 64, n_layers=2)
    plan = SparsePlan.uniform(cfg.n_layers, cfg.n_kv_heads, g=g, budget=0.1, sink=16, window=128)
    lengths, n_dec = [900, 1300, 500], 3
    outs = {}
    for name, kw in (("cpu", dict(placement="cpu")), ("zc", dict(placement="gpu", zero_copy=True)),
                     ("staging", dict(placement="gpu", zero_copy=False))):
        attn = SparseAttention(cfg, plan, torch.float32, CPU, max_seqs=4, host_decode=False, costs=SPLIT_COSTS, **kw)  # type: ignore[arg-type]
        outs[name], _ = run(attn, cfg, lengths, n_dec, seed=g)
        assert attn.stats()["kv_read_fraction"] < 0.7  # sink and window rounded to g
    assert torch.allclose(outs["zc"], outs["cpu"], atol=1e-4)
    assert torch.allclose(outs["zc"], outs["staging"], atol=1e-4)


def test_zero_copy_with_device_selection_matches_native_selection() -> None:
    cfg = config(4, 2, 32)
    plan = SparsePlan.uniform(cfg.n_layers, cfg.n_kv_heads, g=16, budget=0.1, sink=16, window=64)
    lengths, n_dec = [1000, 600], 3
    native_sel = SparseAttention(cfg, plan, torch.float32, CPU, 4, host_decode=False, placement="gpu", costs=SPLIT_COSTS)
    device_sel = SparseAttention(cfg, plan, torch.float32, CPU, 4, host_decode=False, placement="gpu", selection="gpu", zero_copy=True)
    a, _ = run(native_sel, cfg, lengths, n_dec, seed=2)
    b, _ = run(device_sel, cfg, lengths, n_dec, seed=2)
    assert torch.allclose(a, b, atol=1e-4)  # ids in score order (not ascending) are fine for the feeder
    assert device_sel.stats()["zero_copy_mb"] > 0


def test_feeder_ignores_ids_past_counts_and_handles_empty_tasks() -> None:
    store = HostKVStore(1, 2, 32, dtype=torch.bfloat16, max_seqs=2, pin_memory=False)
    gen = torch.Generator().manual_seed(0)
    slots = [store.allocate(), store.allocate()]
    lens = [600, 300]
    kv = {}
    for s, n in zip(slots, lens):
        k = torch.randn(n, 2, 32, generator=gen).to(torch.bfloat16)
        v = torch.randn(n, 2, 32, generator=gen).to(torch.bfloat16)
        store.append(0, s, k, v)
        kv[s] = (k, v)
    tasks = native.make_tasks([slots[0], slots[1], slots[1]], [0, 1, 1], [1, 0, 1], [32, 16, 64])
    ids = np.array([[17, 3, 9, 999_999], [5, 2, -7, 12345], [0, 0, 0, 0]], np.int32)  # garbage past counts
    counts = np.array([3, 2, 0], np.int32)
    q = torch.randn(2, 2 * 4, 32, generator=gen)  # [B, Hq, D], r = 4
    qg = q.view(4, 4, 32)  # [B * Hkv, r, D]
    bh = np.array([0 * 2 + 1, 1 * 2 + 0, 1 * 2 + 1])
    feeder = ZeroCopyFeeder(store, CPU)
    meta = torch.zeros(feeder.meta_size(3, counts), dtype=torch.int32)
    out, lse, _, nbytes = feeder.attend(0, store.view(0).n_tokens, qg, tasks, ids, counts, bh, 0.2, meta, meta)
    for t in range(3):
        s, h, g = int(tasks[t, 0]), int(tasks[t, 2]), int(tasks[t, 3])
        rows = np.concatenate([np.arange(b * g, (b + 1) * g) for b in ids[t, : counts[t]]] or [np.zeros(0, int)])
        k, v = (x[rows, h].float()[None] for x in kv[s])
        o_ref, l_ref = block_attention(qg[bh[t]][None], k, v, torch.tensor([len(rows)]), 0.2)
        assert torch.allclose(out[t], o_ref[0], atol=1e-5) and torch.allclose(lse[t], l_ref[0], atol=1e-5)
    assert torch.isinf(lse[2]).all() and (out[2] == 0).all()
    assert nbytes == (3 * 32 + 2 * 16) * 32 * 2 * 2


def test_cpu_alias_is_the_host_memory() -> None:
    assert check(CPU)[0]
    host = torch.arange(64, dtype=torch.int64)
    view = raw_view(host.data_ptr() + 8 * 8, (7, 8), torch.int64, CPU, host)
    assert torch.equal(view.reshape(-1), host[8:64])
    host[8] = -1  # the same bytes, not a copy
    assert int(view[0, 0]) == -1


# ---- slabs ----------------------------------------------------------------------------------------------------


def _check_layout(store: HostKVStore) -> None:
    slabs = [(s.data_ptr(), s.data_ptr() + s.numel()) for s in store.slabs]
    seen = set()
    for layer in range(store.n_layers):
        table = store.page_table(layer)
        for addr in table[table != 0].tolist():
            assert addr not in seen  # a page belongs to one (layer, slot, index)
            seen.add(addr)
            assert addr % store.chunk_bytes == 0  # chunk-aligned: the GPU gather's row unit
            assert any(lo <= addr and addr + store.page_bytes <= hi for lo, hi in slabs)  # inside one slab


def test_slabs_many_sequences_free_and_reuse() -> None:
    store = HostKVStore(2, 2, 64, dtype=torch.bfloat16, max_seqs=6, pin_memory=False, slab_bytes=1 << 20,
                        initial_pages_per_seq=1)
    assert store.page_stride % store.chunk_bytes == 0 and store.page_stride >= store.page_bytes
    gen = torch.Generator().manual_seed(1)
    data = {}
    slots = [store.allocate() for _ in range(6)]
    for i, s in enumerate(slots):
        n = 200 + 377 * i  # up to 8 pages of 256 tokens
        for layer in range(2):
            k = torch.randn(n, 2, 64, generator=gen).to(torch.bfloat16)
            v = torch.randn(n, 2, 64, generator=gen).to(torch.bfloat16)
            for a in range(0, n, 150):  # several appends: pages added one at a time
                store.append(layer, s, k[a : a + 150], v[a : a + 150])
            data[(layer, s)] = (k, v)
    assert len(store.slabs) > 2 and all(t.numel() <= 1 << 20 for t in store.slabs)
    _check_layout(store)
    reserved = store.bytes_reserved
    for s in slots[::2]:
        store.release(s)
    again = [store.allocate() for _ in range(3)]
    for s in again:  # reuse: the freed pages come back before any new slab
        for layer in range(2):
            k = torch.randn(500, 2, 64, generator=gen).to(torch.bfloat16)
            store.append(layer, s, k, k)
            data[(layer, s)] = (k, k)
    assert store.bytes_reserved == reserved
    _check_layout(store)
    for (layer, s), (k, v) in data.items():
        rk, rv = store.read(layer, s)
        assert torch.equal(rk, k) and torch.equal(rv, v)
        if k.shape[0] % 16 == 0:  # summaries live in the same pages: intact too
            blocks = k.float().view(-1, 16, 2, 64)
            ref = torch.stack([blocks.amin(1), blocks.amax(1)], 2).transpose(0, 1)  # [Hkv, n_blocks, 2, D]
            assert torch.equal(store.summaries(layer, s, 16).float(), ref)  # bf16 summaries, exact in fp32
    live = {key: v for key, v in data.items() if key[1] in set(slots[1::2]) | set(again)}
    assert store.bytes_used == store.page_bytes * sum(-(-k.shape[0] // 256) for k, _ in live.values())


def test_slab_memory_bound_raises_a_clear_error() -> None:
    store = HostKVStore(1, 2, 64, dtype=torch.bfloat16, max_seqs=2, pin_memory=False, slab_bytes=1 << 20,
                        max_bytes=3 << 20)
    s = store.allocate()
    k = torch.zeros(256, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(CapacityError, match="bound"):
        for _ in range(200):
            store.append(0, s, k, k)
    assert store.bytes_reserved <= 3 << 20
    n = store.n_tokens(0, s)
    assert n > 0 and store.read(0, s)[0].shape[0] == n  # what fit is intact
    store.release(s)
    s2 = store.allocate()
    store.append(0, s2, k, k)  # freed pages are usable again under the bound


def test_page_rounding_is_gone_for_the_llama_shape() -> None:
    from fluxion_lite.hostkv.store import page_stride

    pb = native.page_bytes(8, 128, 256, (16, 32, 64, 128))
    assert page_stride(pb, 128) == pb  # 1.12 MiB pages, no padding (pinned torch tensors rounded them to 2 MiB)
    assert (256 << 20) // pb >= 200
    assert CHUNK_TOKENS == 16
