"""The experimental per-head block scoring (topk_experimental.py): with one query head per KV head it must select
what the native group top-k selects (same eligibility, ties and output order); with several heads, a block that
one head ranks first is kept even when the summed query ranks it last."""
from __future__ import annotations

import numpy as np
import torch

from fluxion_lite import native
from fluxion_lite.host_kv import HostKVStore
from fluxion_lite.topk_experimental import per_head_topk


def filled_store(n_tokens: int, hkv: int, d: int, seed: int) -> HostKVStore:
    store = HostKVStore(1, hkv, d, dtype=torch.bfloat16, max_seqs=2, page_tokens=256, granularities=(16, 32, 64, 128))
    slot = store.allocate()
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(n_tokens, hkv, d, generator=g).to(torch.bfloat16)
    store.append(0, slot, k, k.clone())
    return store


def test_one_head_per_group_matches_native() -> None:
    hkv, d, n = 2, 32, 700
    store = filled_store(n, hkv, d, seed=1)
    q = torch.randn(1, hkv, d, generator=torch.Generator().manual_seed(2))
    for g, k in ((16, 5), (64, 3), (32, 40)):
        tasks = native.make_tasks(0, 0, np.arange(hkv), g, k, exclude=[(0, 32), (n - 64, n)])
        ids_n, _, counts_n = native.group_topk(store.view(0), q, tasks)
        ids_p, counts_p = per_head_topk(store, 0, q, tasks, d**-0.5)
        assert counts_p.tolist() == counts_n.tolist()
        for i in range(len(tasks)):
            assert ids_p[i, : counts_p[i]].tolist() == ids_n[i, : counts_n[i]].tolist()


def test_a_block_one_head_prefers_is_kept() -> None:
    hkv, d, n, r = 1, 16, 256, 4
    store = filled_store(n, hkv, d, seed=3)
    s = store.summaries(0, 0, 16)[0].float().numpy()  # [16 blocks, 2, D]: min, max
    q = np.zeros((1, r, d), np.float32)
    q[0, 0] = np.where(s[5, 1] > 0, 1.0, 0.0)  # head 0 looks for block 5's largest dims
    other = np.zeros(d, np.float32)
    other[np.argsort(s[12, 1])[-4:]] = 3.0  # the other heads, together stronger, look for block 12's top dims
    q[0, 1:] = other

    def bound(qh: np.ndarray) -> np.ndarray:
        return np.maximum(qh, 0) @ s[:, 1].T + np.minimum(qh, 0) @ s[:, 0].T  # [16]

    head0_best = int(np.argmax(bound(q[0, 0])))
    tasks = native.make_tasks(0, 0, 0, 16, 2)
    ids_n, _, _ = native.group_topk(store.view(0), torch.from_numpy(q), tasks)
    ids_p, counts_p = per_head_topk(store, 0, torch.from_numpy(q), tasks, 1.0)
    assert head0_best not in ids_n[0, :2].tolist()  # the summed query ranks it low
    assert counts_p[0] == 2 and head0_best in ids_p[0, :2].tolist()
