"""The first per-query-head block scoring, in numpy (it ran on the eager decode path before the native kernel):
kept as an independent reference for the native per-head top-k (native.group_topk(..., scoring="per-head")).

Every query head j of a GQA group gets its own Quest bound, measured as the gap to that head's best block, and a
block scores the best gap over the group's heads:

    bound_j(b) = scale * sum_d max(q_jd * min_bd, q_jd * max_bd)
    score(b)   = max_j (bound_j(b) - max_b' bound_j(b'))

The same tasks in, the same outputs as native.group_topk (ids ascending per task, counts), in float32.
"""
from __future__ import annotations

import numpy as np
import torch

from fluxion_lite.hostkv.store import HostKVStore


def per_head_topk(store: HostKVStore, layer: int, q: torch.Tensor, tasks: np.ndarray, scale: float
                  ) -> tuple[np.ndarray, np.ndarray]:
    """q: fp32 [q_rows, Hq, D]; tasks int32 [T, 9] (native.make_tasks). Returns ids int32 [T, k_cap], counts [T]."""
    hkv = store.n_kv_heads
    r = q.shape[1] // hkv
    qn = q.numpy() if q.device.type == "cpu" else q.cpu().numpy()
    k_cap = max(1, int(tasks[:, 4].max())) if len(tasks) else 1
    ids = np.zeros((len(tasks), k_cap), np.int32)
    counts = np.zeros(len(tasks), np.int32)
    summaries: dict[tuple[int, int], np.ndarray] = {}
    for i, (slot, q_row, h, g, k, lo0, hi0, lo1, hi1) in enumerate(tasks.tolist()):
        key = (slot, g)
        if key not in summaries:
            summaries[key] = store.summaries(layer, slot, g).float().numpy()  # [Hkv, n_blocks, 2, D] (exact)
        s = summaries[key][h]  # [n_blocks, 2, D]
        n_tokens = store.n_tokens(layer, slot)
        n_blocks = s.shape[0]
        start = np.arange(n_blocks) * g
        end = np.minimum(start + g, n_tokens)
        ok = np.ones(n_blocks, bool)
        for lo, hi in ((lo0, hi0), (lo1, hi1)):
            if lo < hi:
                ok &= (end <= lo) | (start >= hi)
        eligible = np.flatnonzero(ok)
        if k <= 0 or len(eligible) == 0:
            continue
        qh = qn[q_row, h * r : (h + 1) * r]  # [r, D]
        mn, mx = s[eligible, 0], s[eligible, 1]  # [E, D]
        bound = scale * (np.maximum(qh, 0) @ mx.T + np.minimum(qh, 0) @ mn.T)  # [r, E]
        score = (bound - bound.max(axis=1, keepdims=True)).max(axis=0)  # [E]
        take = min(k, len(eligible))
        order = np.lexsort((eligible, -score))[:take]  # best score first, ties to the lower block id
        chosen = np.sort(eligible[order])
        ids[i, :take] = chosen
        counts[i] = take
    return ids, counts
