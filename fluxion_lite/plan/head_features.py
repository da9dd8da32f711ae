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

How it runs: online this sits on the request path once per layer, on the device that holds the prefill's K/V, so
it is written for few tensor ops and no host sync: every size and index follows from Python ints (N, Q, sink,
window, g), the four granularities share one sort, and the device ships one small packed tensor to the host, where
numpy turns the per-query sums into the feature vector (means, ratios, logs: O(Hkv * Q) scalars).
"""
from __future__ import annotations

import functools
import math

import numpy as np
import torch
import torch.nn.functional as F

from fluxion_lite.plan.pins import eligible_blocks
from fluxion_lite.plan.sparse_plan import GRANULARITIES

FEATURE_QUERIES = 8  # last prompt positions whose attention is measured (Q)
RECALL_BUDGETS = (0.02, 0.10)  # budgets at which the Quest top-k recall of outside mass is measured
ORACLE_TOP = 0.05  # share of g=16 blocks (by true mass) for the concentration feature
MAX_LOG_CONTEXT = math.log(32768.0)
_TINY = 1e-6
BATCH_BYTES = 256 << 20  # prompt_features: fp32 scores per batch of layers

FEATURE_NAMES: tuple[str, ...] = (
    "mass_sink", "mass_window", "log_mass_rest", "entropy_norm", "log_dev_stream", "contribution",
    "log_err_stream", *(f"recall_g{g}_b{b:g}" for g in GRANULARITIES for b in RECALL_BUDGETS),
    "oracle_top5_g16", "log_vnorm_sink_ratio", "layer_frac", "log_context",
)
N_FEATURES = len(FEATURE_NAMES)

_G0 = GRANULARITIES[0]  # the finest block; every coarser granularity is a dyadic merge of these
_LEVELS = len(GRANULARITIES)
assert GRANULARITIES == tuple(_G0 << level for level in range(_LEVELS)), "block levels must double"
_TOP_G = GRANULARITIES[-1]
_ROWS = _LEVELS + 1  # rows of the shared sort: one per granularity, then the oracle (g=16 blocks by true mass)
_TAKES = len(RECALL_BUDGETS) + 1  # per row: the top-k mass at each budget, then the whole eligible mass


def layer_features(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, wo: torch.Tensor, layer: int,
                   n_layers: int, sink: int, window: int) -> torch.Tensor:
    """Features of every KV group of one layer.

    q: [Q, Hkv, r, D] queries of the last Q prompt positions (N-Q .. N-1); keys, values: [Hkv, N, D] (the prompt);
    wo: [d_model, Hq*D] the layer's output projection. Needs N >= sink + window + Q - 1 (the queries' windows lie
    after the sink; the planner only asks from sink + window + 128 on). Returns [Hkv, N_FEATURES] float32 on the
    CPU, all finite.
    """
    return prompt_features([q], [keys], [values], [wo], [layer], n_layers, sink, window)[0]


@torch.no_grad()
def prompt_features(qs: list[torch.Tensor], keys: list[torch.Tensor], values: list[torch.Tensor],
                    wos: list[torch.Tensor], layers: list[int], n_layers: int, sink: int, window: int,
                    batch_bytes: int | None = None) -> list[torch.Tensor]:
    """layer_features of several layers of one prompt (same Q, Hkv, r, D, N), computed together: the layers' groups
    are stacked on one group axis, so the ~60 tensor ops run once per batch of layers instead of once per layer (on
    a GPU each op costs a launch whatever its size: one layer at a time took 1.75-2.37 ms per layer on the H200,
    nearly all of it launches). Layers go together up to ~batch_bytes of fp32 scores [groups, Q, r, N], which
    bounds the memory (a few tensors of that size are live at once). batch_bytes None: BATCH_BYTES on a GPU, one
    layer at a time on the CPU, where the ops are not launch-bound and batches measured slower (bigger tensors
    than the caches: bench/predictor_cost.py on the VM, 4K, 0.5b shape: 7.3 ms per layer alone, 13.3 batched).
    Returns one [Hkv, N_FEATURES] per layer."""
    n_q, hkv, r, d = qs[0].shape
    n = keys[0].shape[1]
    w_lo = n - n_q - window + 1  # query i's window: keys w_lo + i .. w_lo + i + window - 1 (ending at itself)
    if n_q < 1 or sink < 0 or window < 0 or w_lo < sink:
        raise ValueError(f"layer_features needs 1 <= Q and N >= sink + window + Q - 1 (got Q={n_q}, N={n}, "
                         f"sink={sink}, window={window})")
    if not len(qs) == len(keys) == len(values) == len(wos) == len(layers) > 0:
        raise ValueError("prompt_features: one q, keys, values, wo and layer index per layer, at least one layer")
    n_pad = -(-n // _TOP_G) * _TOP_G
    if batch_bytes is None:
        batch_bytes = BATCH_BYTES if keys[0].device.type == "cuda" else 0
    step = max(1, batch_bytes // (hkv * n_q * r * n_pad * 4))  # layers per batch
    out: list[torch.Tensor] = []
    for lo in range(0, len(qs), step):
        hi = min(len(qs), lo + step)

        def joined(ts: list[torch.Tensor], dim: int) -> torch.Tensor:
            t = ts[lo] if hi - lo == 1 else torch.cat(ts[lo:hi], dim=dim)
            return t if t.dtype == torch.float32 else t.float()

        packed = _packed_sums(joined(qs, 1), joined(keys, 0), joined(values, 0), wos[lo:hi], sink, window)
        for i, layer in enumerate(layers[lo:hi]):
            out.append(_finish(packed[i * hkv:(i + 1) * hkv], n_q, r, n, sink, layer, n_layers))
    return out


def _packed_sums(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, wos: list[torch.Tensor], sink: int,
                 window: int) -> np.ndarray:
    """The per-query sums _finish turns into features, for G groups at once: q [Q, G, r, D]; keys, values [G, N, D]
    fp32, the G groups being len(wos) layers' groups in layer order (wos: each layer's [d_model, Hq*D] output
    projection). Returns [G, ...] float64 on the host."""
    n_q, hkv, r, d = q.shape  # hkv: all the stacked groups
    n = keys.shape[1]
    w_lo = n - n_q - window + 1
    dev = keys.device
    n_pad = -(-n // _TOP_G) * _TOP_G  # keys padded to whole blocks of every granularity
    nb = n_pad // _G0  # g=16 blocks
    dyadic = (n_pad // _TOP_G,) + (2,) * (_LEVELS - 1)  # g=16 block j as (top block, then one bit per level)

    # Attention of the Q queries over the prompt, [Hkv, Q, r, n_pad]: the padding and each query's future masked.
    keys_p = keys if n_pad == n else F.pad(keys, (0, 0, 0, n_pad - n))  # [Hkv, n_pad, D]
    scores = torch.einsum("qhrd,hnd->hqrn", q * d**-0.5, keys_p)
    # masked with a finite -1e30: exp still gives exactly 0, and 0 * log p stays 0 in the entropy (-inf gives NaN)
    scores[..., n - n_q:].masked_fill_(_future_mask(n_q, n_pad - n + n_q, dev), -1e30)
    log_probs = torch.log_softmax(scores, dim=-1)
    probs = log_probs.exp()  # [Hkv, Q, r, n_pad]
    mass_sink = probs[..., :sink].sum(-1)  # [Hkv, Q, r]
    mass_window = _query_windows(probs, w_lo, window).sum(-1)  # [Hkv, Q, r]
    # sum p log p = -entropy (negated and divided by log(context) on the host); cheaper than a log per probability
    p_log_p = torch.linalg.vecdot(probs, log_probs)  # [Hkv, Q, r]

    # Streaming deviation on these queries: full output vs the output of a softmax over sink + own window only.
    o_full = torch.einsum("hqrn,hnd->hqrd", probs[..., :n], values)  # [Hkv, Q, r, D]
    s_near = torch.cat([scores[..., :sink], _query_windows(scores, w_lo, window)], dim=-1)  # [Hkv, Q, r, S]
    v_near = torch.cat([_key_windows(values, n_q, 0, sink, step=0), _key_windows(values, n_q, w_lo, window)], dim=2)
    o_near = torch.softmax(s_near, dim=-1) @ v_near  # [Hkv, Q, r, D]; v_near: [Hkv, Q, S, D] (strided views)
    dev_norm = torch.linalg.vector_norm(o_near - o_full, dim=(2, 3))  # [Hkv, Q]
    out_norm = torch.linalg.vector_norm(o_full, dim=(2, 3))  # [Hkv, Q]
    # ||W_o o|| of each group's slice of the output (the contribution share, as the calibration label defines it);
    # a bmm against W_o's column blocks read in place (einsum copies W_o here)
    # (one bmm per layer: W_o differs by layer; a model-dtype W_o is cast per call, not kept in fp32)
    per = hkv // len(wos)  # each layer's groups
    proj_norm = torch.cat([torch.linalg.vector_norm(torch.bmm(
        o_full[i * per:(i + 1) * per].view(per, n_q, r * d),
        (wo if wo.dtype == torch.float32 else wo.float()).view(-1, per, r * d).permute(1, 2, 0)), dim=-1)
        for i, wo in enumerate(wos)])  # [G, Q]

    # Recall of outside-window mass by the Quest-bound top-k blocks (the selection the backend runs), per g and budget.
    # Quest bound of a block, summed over the group's heads: sum_d max(q_d kmin_d, q_d kmax_d)
    #   = [sum_r relu(q), sum_r relu(-q)] . [kmax, -kmin], so one dot per block against kext = [kmax, -kmin], and a
    # coarser block's kext is the max over the g=16 blocks it holds (kept at g=16 resolution by keepdim).
    qext = torch.cat([q, -q], dim=-1).clamp_(min=0).sum(2)  # [Q, Hkv, 2D]
    k_blocks = keys_p.view(hkv, *dyadic, _G0, d)  # amax + amin: aminmax is 10x slower on the CPU
    kext = torch.cat([k_blocks.amax(-2), k_blocks.amin(-2).neg_()], dim=-1)  # [Hkv, *dyadic, 2D]
    bits = tuple(range(2, 1 + _LEVELS))  # the dims of kext holding the per-level bits of a g=16 block's index
    # level lv (g = 16 * 2^lv) merges the last lv bits: [Hkv, top, ..., 1 x lv, 2D]
    levels = [kext] + [kext.amax(dim=bits[len(bits) - lv:], keepdim=True) for lv in range(1, _LEVELS)]
    # Every row is laid out over the g=16 blocks: a g-block's bound repeats over its g/16 blocks (exact copies, so
    # a stable sort keeps them adjacent and in block order), and each row ranks the g=16 masses. Row _LEVELS ranks
    # the blocks by their true mass itself (the oracle).
    mass16 = probs.view(hkv, n_q, r, *dyadic, _G0).sum(dim=(2, -1))  # [Hkv, Q, *dyadic]
    rows = [torch.einsum("qhe,h...e->hq...", qext, k) for k in levels] + [mass16]
    sort_keys = torch.stack(torch.broadcast_tensors(*rows), dim=2).view(hkv, n_q, _ROWS, nb)
    # Which blocks each row may pick (bias: -inf keys for the rest) and which ranked blocks each sum takes follow
    # from Python ints alone: built on the host, shared by all layers of a prompt.
    bias, takes = _selection_plan(n, sink, window, dev)  # [1, _ROWS, nb], [_TAKES, _ROWS, nb]
    order = sort_keys.add_(bias).sort(dim=-1, descending=True, stable=True).indices  # [Hkv, Q, _ROWS, nb]
    ranked_mass = torch.take_along_dim(mass16.view(hkv, n_q, 1, nb), order, dim=-1)  # [Hkv, Q, _ROWS, nb]
    picked = torch.einsum("hqlj,tlj->hqlt", ranked_mass, takes)  # [Hkv, Q, _ROWS, _TAKES]

    vnorm = torch.linalg.vector_norm(values, dim=-1)  # [Hkv, N]
    packed = torch.cat([torch.stack([mass_sink, mass_window, p_log_p], dim=2).flatten(1), dev_norm, out_norm,
                        proj_norm, picked.flatten(1), vnorm[:, :sink], vnorm.sum(-1, keepdim=True)], dim=1)
    # .cpu() is the one point where the host waits for the device; dlpack hands the buffer to numpy without the
    # four dispatcher ops of .numpy()
    return np.from_dlpack(packed.cpu()).astype(np.float64)


def _finish(packed: np.ndarray, n_q: int, r: int, n: int, sink: int, layer: int, n_layers: int) -> torch.Tensor:
    """The feature matrix from layer_features' packed per-query sums ([Hkv, ...] float64, layout as packed there)."""
    hkv = packed.shape[0]
    sizes = [n_q * 3 * r, n_q, n_q, n_q, n_q * _ROWS * _TAKES, sink, 1]
    masses, dev_norm, out_norm, proj_norm, picked, vnorm_sink, vnorm_sum = np.split(packed, np.cumsum(sizes)[:-1], 1)
    masses = masses.reshape(hkv, n_q, 3, r)
    mass_sink, mass_window = masses[:, :, 0], masses[:, :, 1]  # [Hkv, Q, r]
    mass_rest = np.clip(1.0 - mass_sink - mass_window, 0.0, None)
    log_ctx = np.log(np.arange(n - n_q + 1, n + 1, dtype=np.float64))  # [Q]: log of each query's context length
    entropy = -masses[:, :, 2] / log_ctx[None, :, None]  # normalised: 1 for uniform attention
    dev_stream = dev_norm / np.maximum(out_norm, 1e-12)  # [Hkv, Q]
    contrib = proj_norm / np.maximum(proj_norm.sum(0, keepdims=True), 1e-12)  # share among the groups
    picked = picked.reshape(hkv, n_q, _ROWS, _TAKES)
    outside = np.maximum(picked[..., -1:], _TINY)  # every eligible block's mass
    recall = np.minimum(picked[..., :-1] / outside, 1.0).mean(1)  # [Hkv, _ROWS, budgets]
    with np.errstate(invalid="ignore", divide="ignore"):  # sink = 0: no sink values (a NaN, zeroed below)
        vratio = vnorm_sink.sum(1) / sink / np.maximum(vnorm_sum[:, 0] / n, 1e-12)

    def m(x: np.ndarray) -> np.ndarray:  # mean over queries (and heads) -> [Hkv]
        return x.reshape(hkv, -1).mean(-1)

    dev_m = m(dev_stream)
    cols = [
        m(mass_sink), m(mass_window), np.log(m(mass_rest) + _TINY), m(entropy), np.log(dev_m + _TINY), m(contrib),
        np.log(m(contrib * dev_stream) + _TINY), *recall[:, :_LEVELS].reshape(hkv, -1).T, recall[:, _LEVELS, 0],
        np.log(vratio + _TINY), np.full(hkv, layer / max(1, n_layers - 1)),
        np.full(hkv, math.log(max(n, 2)) / MAX_LOG_CONTEXT),
    ]
    out = np.nan_to_num(np.stack(cols, axis=1), nan=0.0, posinf=0.0, neginf=math.log(_TINY))
    return torch.from_dlpack(out.astype(np.float32))  # shares the fresh array


@functools.lru_cache(maxsize=8)
def _selection_plan(n: int, sink: int, window: int, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Over each sort row's ranked g=16 blocks: bias [1, _ROWS, nb], added to the sort keys (0 where a block is
    eligible, -inf where not, so eligible blocks rank first), and takes [_TAKES, _ROWS, nb], 1 on the ranked blocks
    that sum t takes: the top-k at each budget, then all eligible blocks (the outside mass). Cached: every layer of a
    prompt asks for the same N.

    Eligible at granularity g: pinned.eligible_blocks, a g-block wholly after the sink's g-blocks and before the
    window's (one touching the padding also touches the window). k = min(eligible, ceil(budget * N / g)) g-blocks,
    g/16 rows each."""
    nb = -(-n // _TOP_G) * (_TOP_G // _G0)
    plan = np.zeros((1 + _TAKES, _ROWS, nb), np.float32)
    bias, takes = plan[0], plan[1:]
    bias[:] = -np.inf
    for level, g in enumerate(GRANULARITIES):
        per = g // _G0  # g=16 blocks per g-block
        first, last = eligible_blocks(g, n, sink, window)
        count = last - first  # eligible g-blocks: first .. last - 1
        bias[level, first * per:(first + count) * per] = 0.0
        for t, budget in enumerate(RECALL_BUDGETS):
            takes[t, level, :min(count, math.ceil(budget * n / g)) * per] = 1.0
        takes[-1, level, :count * per] = 1.0
        if level == 0:  # the oracle row: the same blocks, ranked by mass; its first sum takes the top ORACLE_TOP
            bias[_LEVELS] = bias[0]
            takes[0, _LEVELS, :min(count, max(1, math.ceil(ORACLE_TOP * count)))] = 1.0
            takes[-1, _LEVELS, :count] = 1.0
    on_dev = torch.from_numpy(plan)
    if dev.type == "cuda":  # from pinned memory: an asynchronous copy, no host sync
        on_dev = on_dev.pin_memory().to(dev, non_blocking=True)
    elif dev.type != "cpu":
        on_dev = on_dev.to(dev)
    return on_dev[:1], on_dev[1:]


@functools.lru_cache(maxsize=512)
def _future_mask(n_q: int, width: int, dev: torch.device) -> torch.Tensor:
    """[Q, 1, width] bool over the last `width` key slots (the last Q keys, then padding): True where key slot j
    lies after query i. Depends on shapes only, so it is built once per (Q, padding)."""
    return torch.ones(n_q, width, dtype=torch.bool, device=dev).triu_(1).unsqueeze(1)


def _query_windows(x: torch.Tensor, start: int, width: int) -> torch.Tensor:
    """x: [Hkv, Q, r, N] -> strided view [Hkv, Q, r, width] whose query-i rows hold keys start + i .. + width - 1."""
    s = x.stride()
    return x.as_strided((*x.shape[:3], width), (s[0], s[1] + s[3], s[2], s[3]), x.storage_offset() + start * s[3])


def _key_windows(x: torch.Tensor, n_q: int, start: int, width: int, step: int = 1) -> torch.Tensor:
    """x: [Hkv, N, D] -> strided view [Hkv, Q, width, D]: keys start + i*step .. + width - 1 for query i (step 0:
    the same keys for every query, without a copy)."""
    s = x.stride()
    return x.as_strided((x.shape[0], n_q, width, x.shape[2]), (s[0], step * s[1], s[1], s[2]),
                        x.storage_offset() + start * s[1])
