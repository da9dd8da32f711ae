"""float64 references for the native kernels, written straight from the definitions (no shared code with C)."""
from __future__ import annotations

import numpy as np


def block_summaries(keys: np.ndarray, g: int) -> tuple[np.ndarray, np.ndarray]:
    """keys [n, D] -> per-block (min, max), each [n_blocks, D]; the last block may be partial."""
    n_blocks = -(-len(keys) // g)
    mins = np.stack([keys[b * g:(b + 1) * g].min(axis=0) for b in range(n_blocks)])
    maxs = np.stack([keys[b * g:(b + 1) * g].max(axis=0) for b in range(n_blocks)])
    return mins, maxs


def block_scores(q_group: np.ndarray, mins: np.ndarray, maxs: np.ndarray) -> np.ndarray:
    """Quest upper bound summed over the group's heads: sum_j sum_d max(q_jd*min_d, q_jd*max_d).  -> [n_blocks]"""
    q = q_group.astype(np.float64)[:, None, :]  # [r, 1, D]
    return np.maximum(q * mins[None], q * maxs[None]).sum(axis=(0, 2))


def head_bounds(q_group: np.ndarray, mins: np.ndarray, maxs: np.ndarray) -> np.ndarray:
    """Every query head's own Quest bound: sum_d max(q_jd*min_d, q_jd*max_d).  -> [r, n_blocks]"""
    q = q_group.astype(np.float64)[:, None, :]  # [r, 1, D]
    return np.maximum(q * mins[None], q * maxs[None]).sum(axis=2)


def per_head_scores(q_group: np.ndarray, mins: np.ndarray, maxs: np.ndarray, eligible: np.ndarray) -> np.ndarray:
    """Per-head scoring over the eligible blocks: max_j (bound_j(b) - max over eligible b' of bound_j(b')).
    -> [n_blocks], -inf where not eligible."""
    bounds = head_bounds(q_group, mins, maxs)  # [r, n_blocks]
    out = np.full(bounds.shape[1], -np.inf)
    if len(eligible):
        e = bounds[:, eligible]
        out[eligible] = (e - e.max(axis=1, keepdims=True)).max(axis=0)
    return out


def eligible_blocks(n_tokens: int, g: int, exclude: list[tuple[int, int]]) -> np.ndarray:
    """Block ids not intersecting any excluded token range [lo, hi)."""
    ids = []
    for b in range(-(-n_tokens // g)):
        lo, hi = b * g, min((b + 1) * g, n_tokens)
        if any(max(lo, a) < min(hi, z) for a, z in exclude):
            continue
        ids.append(b)
    return np.array(ids, dtype=np.int64)


def attention(q_group: np.ndarray, keys: np.ndarray, values: np.ndarray, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """Softmax attention of q_group [r, D] over keys/values [n, D]: (out [r, D], lse [r]) in float64."""
    r, d = q_group.shape
    if len(keys) == 0:
        return np.zeros((r, d)), np.full(r, -np.inf)
    logits = scale * q_group.astype(np.float64) @ keys.astype(np.float64).T  # [r, n]
    m = logits.max(axis=1, keepdims=True)
    w = np.exp(logits - m)
    lse = (m[:, 0] + np.log(w.sum(axis=1)))
    return (w / w.sum(axis=1, keepdims=True)) @ values.astype(np.float64), lse


def block_tokens(ids: np.ndarray, g: int, n_tokens: int) -> np.ndarray:
    """Token indices covered by the given blocks, in order."""
    if len(ids) == 0:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate([np.arange(b * g, min((b + 1) * g, n_tokens)) for b in ids])


def pinned_selection(eligible: np.ndarray, scores: np.ndarray, pins: np.ndarray, k: int) -> np.ndarray:
    """A task's selection with pinned blocks, from its definition: the pins plus the k - len(pins) best eligible
    blocks that are not pinned (higher score first, equal scores: the lower block id), ids ascending.
    eligible: block ids; scores: their scores (same order); pins: pinned block ids."""
    pinned = set(int(b) for b in pins)
    free = sorted((-float(s), int(b)) for b, s in zip(eligible, scores) if int(b) not in pinned)
    chosen = [b for _, b in free[: max(k - len(pinned), 0)]]
    return np.array(sorted(chosen + sorted(pinned)), dtype=np.int64)


def exact_topk(ids: np.ndarray, scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k best of (ids, scores) by (score desc, id asc), returned in ascending id order (-0.0 == +0.0)."""
    order = sorted(range(len(ids)), key=lambda i: (-float(scores[i]), int(ids[i])))
    keep = np.sort(np.array(order[:k], dtype=np.int64))
    return ids[keep], scores[keep]


def midrange_scores(q_group: np.ndarray, mins: np.ndarray, maxs: np.ndarray) -> np.ndarray:
    """Midrange scoring: the summed query heads . (block min + block max) / 2.  -> [n_blocks]"""
    return (mins + maxs) @ q_group.astype(np.float64).sum(axis=0) / 2


def background(q_group: np.ndarray, keys: np.ndarray, values: np.ndarray, g: int, exclude: list[tuple[int, int]],
               selected: np.ndarray, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """The unread-background term (fluxion.h, "unread background") in float64, token by token from the keys and
    values themselves: q_group [r, D], keys/values [n, D] of one KV head, the selection's block ids at g.
    Returns out [r, D] and lse [r] (0 and -inf when nothing is in the background)."""
    n = len(keys)
    eligible = set(eligible_blocks(n, g, exclude).tolist()) - set(np.asarray(selected).tolist())
    r, d = q_group.shape
    logits, vbars = [], []
    for b in range(-(-n // 128)):
        lo, hi = 128 * b, min(n, 128 * (b + 1))
        terms = []  # log(n_s) + scale q . mid_s per background 16-token block, [r] each
        for s0 in range(lo, hi, 16):
            if s0 // g not in eligible:
                continue
            sub = keys[s0:min(hi, s0 + 16)]
            mid = (sub.min(axis=0) + sub.max(axis=0)) / 2
            terms.append(np.log(len(sub)) + scale * (q_group @ mid))
        if terms:
            t = np.stack(terms)  # [subs, r]
            top = t.max(axis=0)
            logits.append(top + np.log(np.exp(t - top).sum(axis=0)))
            vbars.append(values[lo:hi].mean(axis=0))
    if not logits:
        return np.zeros((r, d)), np.full(r, -np.inf)
    m = np.stack(logits, axis=1)  # [r, blocks]
    top = m.max(axis=1, keepdims=True)
    w = np.exp(m - top)
    lse = top[:, 0] + np.log(w.sum(axis=1))
    return (w / w.sum(axis=1, keepdims=True)) @ np.stack(vbars), lse
