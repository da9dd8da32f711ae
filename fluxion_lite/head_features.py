"""Per-(layer, KV group) features for the head-property predictor, from what a finished prefill already holds.

Inputs are the queries of the last few prompt positions (the backend keeps a copy while prefilling) and the layer's
full K/V (the dense prefill scratch). The same function runs offline (calibration, on captured tensors) and online
(SparseAttention at the end of a sequence's prefill), so the predictor sees identical features in both places.

Why these features: a group's label is e = c * d (contribution x output deviation). Streaming deviation d_s is driven
by the attention mass outside sink + window and by how different the values there are; retrieval deviation by how
much of that outside mass the Quest-bound top-k actually finds at each block size. So the features measure exactly
those quantities on a handful of queries (mass split, entropy, d_s, recall of Quest top-k at two budgets per g),
plus the group's contribution share, a value-norm ratio (sinks get large scores but carry small values), the layer
position and the context length. Cost is one [Q*r, N] score matrix per group plus block min/max reductions: O(N)
per group for a fixed Q.
"""
from __future__ import annotations

import math

import torch

from .sparse_plan import GRANULARITIES

FEATURE_QUERIES = 8  # last prompt positions whose attention is measured (Q)
RECALL_BUDGETS = (0.02, 0.10)  # budgets at which the Quest top-k recall of outside mass is measured
ORACLE_TOP = 0.05  # share of g=16 blocks (by true mass) for the concentration feature
MAX_LOG_CONTEXT = math.log(32768.0)
_TINY = 1e-6

FEATURE_NAMES: tuple[str, ...] = (
    "mass_sink", "mass_window", "log_mass_rest", "entropy_norm", "log_dev_stream", "contribution",
    "log_err_stream", *(f"recall_g{g}_b{b:g}" for g in GRANULARITIES for b in RECALL_BUDGETS),
    "oracle_top5_g16", "log_vnorm_sink_ratio", "layer_frac", "log_context",
)
N_FEATURES = len(FEATURE_NAMES)


def layer_features(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, wo: torch.Tensor, layer: int,
                   n_layers: int, sink: int, window: int) -> torch.Tensor:
    """Features of every KV group of one layer.

    q: [Q, Hkv, r, D] queries of the last Q prompt positions (N-Q .. N-1); keys, values: [Hkv, N, D] (the prompt);
    wo: [d_model, Hq*D] the layer's output projection. Returns [Hkv, N_FEATURES] float32, all finite.
    """
    q, keys, values = q.float(), keys.float(), values.float()
    n_q, hkv, r, d = q.shape
    n = keys.shape[1]
    dev = keys.device
    pos = torch.arange(n, device=dev)
    q_pos = torch.arange(n - n_q, n, device=dev)  # [Q]
    causal = pos[None, :] <= q_pos[:, None]  # [Q, N]
    near = (pos[None, :] < sink) | ((pos[None, :] > q_pos[:, None] - window) & causal)  # streaming coverage, g = 1
    scores = torch.einsum("qhrd,hnd->hqrn", q, keys) * d**-0.5  # [Hkv, Q, r, N]
    tail = slice(n - n_q, n)  # only the last Q keys can lie in a query's future
    scores[..., tail].masked_fill_(~causal[None, :, None, tail], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    mass_sink = probs[..., :sink].sum(-1)  # [Hkv, Q, r]
    mass_near = (probs * near[None, :, None, :]).sum(-1)
    mass_window = mass_near - mass_sink
    mass_rest = (1.0 - mass_near).clamp(min=0.0)
    n_ctx = (q_pos + 1).float()  # [Q]
    entropy = -(probs * torch.log(probs.clamp(min=1e-30))).sum(-1) / torch.log(n_ctx)[None, :, None]

    # Streaming deviation on these queries, the feature closest to the streaming label.
    # [Hkv, Q*r, N] @ [Hkv, N, D]: a broadcast matmul over Q would copy V Q times
    o_full = torch.bmm(probs.reshape(hkv, n_q * r, n), values).view(hkv, n_q, r, d)  # [Hkv, Q, r, D]
    # streaming output over the union of the queries' sink + window keys only (a few hundred, not N)
    idx = near.any(0).nonzero().squeeze(1)
    p_near = torch.softmax(scores[..., idx].masked_fill(~near[None, :, None, idx], float("-inf")), dim=-1)
    o_near = torch.bmm(p_near.reshape(hkv, n_q * r, len(idx)), values[:, idx]).view(hkv, n_q, r, d)
    ref = o_full.flatten(2).norm(dim=-1).clamp(min=1e-12)  # [Hkv, Q]
    dev_stream = (o_near - o_full).flatten(2).norm(dim=-1) / ref

    # Contribution share of each group in ||W_o o|| (as the calibration label defines it).
    wo_g = wo.float().view(wo.shape[0], hkv, r * d)  # [d_model, Hkv, r*D]
    proj = torch.einsum("mhk,hqk->hqm", wo_g, o_full.flatten(2)).norm(dim=-1)  # [Hkv, Q]
    contrib = proj / proj.sum(0, keepdim=True).clamp(min=1e-12)

    # Recall of outside-window mass by Quest-bound top-k blocks (the selection the backend runs), per g and budget.
    # Block summaries at g = 16 once, coarser ones by merging them (keys padded to a multiple of the largest g; a
    # block touching the padding also touches the window, so it is never eligible).
    g0, top_g = GRANULARITIES[0], GRANULARITIES[-1]
    pad_all = -(-n // top_g) * top_g - n
    kb = torch.nn.functional.pad(keys, (0, 0, 0, pad_all)).view(hkv, -1, g0, d)
    kmin_g, kmax_g = kb.amin(2), kb.amax(2)  # [Hkv, nb16, D]
    mass_g = torch.nn.functional.pad(probs.sum(2), (0, pad_all)).view(hkv, n_q, -1, g0).sum(-1)  # [Hkv, Q, nb16]
    # Quest bound sum_d max(q_d kmin_d, q_d kmax_d) summed over the group's heads = sum_d (sum_r q+) kmax_d +
    # (sum_r q-) kmin_d: two small matmuls per g ([Hkv, Q, nb])
    q_pos, q_neg = q.clamp(min=0).sum(2).transpose(0, 1), q.clamp(max=0).sum(2).transpose(0, 1)  # [Hkv, Q, D]
    recalls = []
    prev_g = g0
    for g in GRANULARITIES:
        if g != prev_g:  # merge f consecutive blocks of the previous granularity
            f, prev_g = g // prev_g, g
            kmin_g = kmin_g.view(hkv, -1, f, d).amin(2)
            kmax_g = kmax_g.view(hkv, -1, f, d).amax(2)
            mass_g = mass_g.view(hkv, n_q, -1, f).sum(-1)
        n_blocks = kmin_g.shape[1]
        kmin, kmax, block_mass = kmin_g, kmax_g, mass_g
        bound = torch.bmm(q_pos, kmax.transpose(1, 2)) + torch.bmm(q_neg, kmin.transpose(1, 2))
        sink_hi = min(-(-sink // g) * g, n)
        win_lo = max((max(n - window, 0) // g) * g, sink_hi)
        b_lo = torch.arange(n_blocks, device=dev) * g
        eligible = (b_lo >= sink_hi) & (b_lo + g <= win_lo)  # [nb]
        outside = (block_mass * eligible).sum(-1).clamp(min=_TINY)  # [Hkv, Q] (summed over r heads)
        ranked = bound.masked_fill(~eligible, float("-inf")).argsort(dim=-1, descending=True, stable=True)
        for b in RECALL_BUDGETS:
            k = min(int(eligible.sum()), math.ceil(b * n / g))
            top = ranked[..., :k]
            got = block_mass.gather(-1, top).sum(-1) if k else torch.zeros_like(outside)
            recalls.append((got / outside).clamp(max=1.0).mean(1))  # [Hkv]
        if g == 16:
            k_or = max(1, math.ceil(ORACLE_TOP * int(eligible.sum())))
            best = (block_mass * eligible).topk(min(k_or, n_blocks), dim=-1).values.sum(-1)
            oracle = (best / outside).clamp(max=1.0).mean(1)

    vnorm = values.norm(dim=-1)  # [Hkv, N]
    vratio = vnorm[:, :sink].mean(-1) / vnorm.mean(-1).clamp(min=1e-12)

    def m(x: torch.Tensor) -> torch.Tensor:  # mean over queries (and heads) -> [Hkv]
        return x.reshape(hkv, -1).mean(-1)

    dev_m, c_m = m(dev_stream), m(contrib)
    cols = [
        m(mass_sink), m(mass_window), torch.log(m(mass_rest) + _TINY), m(entropy), torch.log(dev_m + _TINY), c_m,
        torch.log(m(contrib * dev_stream) + _TINY), *recalls, oracle, torch.log(vratio + _TINY),
        torch.full((hkv,), layer / max(1, n_layers - 1), device=dev),
        torch.full((hkv,), math.log(max(n, 2)) / MAX_LOG_CONTEXT, device=dev),
    ]
    out = torch.stack(cols, dim=1).cpu()
    return torch.nan_to_num(out, nan=0.0, posinf=0.0, neginf=math.log(_TINY))
