"""head_features.layer_features against a float64 copy of its original (per-granularity loop) definition, plus the
properties that make it cheap online: no host sync inside, shape checks."""
from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from fluxion_lite.plan import head_features
from fluxion_lite.plan.head_features import (FEATURE_NAMES, FEATURE_QUERIES, MAX_LOG_CONTEXT, ORACLE_TOP, RECALL_BUDGETS,
                                        layer_features)
from fluxion_lite.plan.sparse_plan import GRANULARITIES

_TINY = 1e-6
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def reference_features(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, wo: torch.Tensor, layer: int,
                       n_layers: int, sink: int, window: int) -> np.ndarray:
    """The definition the shipped predictor weights were trained on (layer_features before it was batched),
    computed in float64. Same shapes as layer_features; returns [Hkv, F] float64."""
    q, keys, values = q.double(), keys.double(), values.double()
    n_q, hkv, r, d = q.shape
    n = keys.shape[1]
    dev = keys.device
    pos = torch.arange(n, device=dev)
    q_pos = torch.arange(n - n_q, n, device=dev)
    causal = pos[None, :] <= q_pos[:, None]
    near = (pos[None, :] < sink) | ((pos[None, :] > q_pos[:, None] - window) & causal)
    scores = torch.einsum("qhrd,hnd->hqrn", q, keys) * d**-0.5
    tail = slice(n - n_q, n)
    scores[..., tail].masked_fill_(~causal[None, :, None, tail], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    mass_sink = probs[..., :sink].sum(-1)
    mass_near = (probs * near[None, :, None, :]).sum(-1)
    mass_window = mass_near - mass_sink
    mass_rest = (1.0 - mass_near).clamp(min=0.0)
    n_ctx = (q_pos + 1).double()
    entropy = -(probs * torch.log(probs.clamp(min=1e-30))).sum(-1) / torch.log(n_ctx)[None, :, None]

    o_full = torch.bmm(probs.reshape(hkv, n_q * r, n), values).view(hkv, n_q, r, d)
    idx = near.any(0).nonzero().squeeze(1)
    p_near = torch.softmax(scores[..., idx].masked_fill(~near[None, :, None, idx], float("-inf")), dim=-1)
    o_near = torch.bmm(p_near.reshape(hkv, n_q * r, len(idx)), values[:, idx]).view(hkv, n_q, r, d)
    ref = o_full.flatten(2).norm(dim=-1).clamp(min=1e-12)
    dev_stream = (o_near - o_full).flatten(2).norm(dim=-1) / ref

    wo_g = wo.double().view(wo.shape[0], hkv, r * d)
    proj = torch.einsum("mhk,hqk->hqm", wo_g, o_full.flatten(2)).norm(dim=-1)
    contrib = proj / proj.sum(0, keepdim=True).clamp(min=1e-12)

    g0, top_g = GRANULARITIES[0], GRANULARITIES[-1]
    pad_all = -(-n // top_g) * top_g - n
    kb = torch.nn.functional.pad(keys, (0, 0, 0, pad_all)).view(hkv, -1, g0, d)
    kmin_g, kmax_g = kb.amin(2), kb.amax(2)
    mass_g = torch.nn.functional.pad(probs.sum(2), (0, pad_all)).view(hkv, n_q, -1, g0).sum(-1)
    q_pos, q_neg = q.clamp(min=0).sum(2).transpose(0, 1), q.clamp(max=0).sum(2).transpose(0, 1)
    recalls = []
    prev_g = g0
    for g in GRANULARITIES:
        if g != prev_g:
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
        eligible = (b_lo >= sink_hi) & (b_lo + g <= win_lo)
        outside = (block_mass * eligible).sum(-1).clamp(min=_TINY)
        ranked = bound.masked_fill(~eligible, float("-inf")).argsort(dim=-1, descending=True, stable=True)
        for b in RECALL_BUDGETS:
            k = min(int(eligible.sum()), math.ceil(b * n / g))
            top = ranked[..., :k]
            got = block_mass.gather(-1, top).sum(-1) if k else torch.zeros_like(outside)
            recalls.append((got / outside).clamp(max=1.0).mean(1))
        if g == 16:
            k_or = max(1, math.ceil(ORACLE_TOP * int(eligible.sum())))
            best = (block_mass * eligible).topk(min(k_or, n_blocks), dim=-1).values.sum(-1)
            oracle = (best / outside).clamp(max=1.0).mean(1)

    vnorm = values.norm(dim=-1)
    vratio = vnorm[:, :sink].mean(-1) / vnorm.mean(-1).clamp(min=1e-12)

    def m(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(hkv, -1).mean(-1)

    dev_m, c_m = m(dev_stream), m(contrib)
    cols = [
        m(mass_sink), m(mass_window), torch.log(m(mass_rest) + _TINY), m(entropy), torch.log(dev_m + _TINY), c_m,
        torch.log(m(contrib * dev_stream) + _TINY), *recalls, oracle, torch.log(vratio + _TINY),
        torch.full((hkv,), layer / max(1, n_layers - 1), device=dev, dtype=torch.float64),
        torch.full((hkv,), math.log(max(n, 2)) / MAX_LOG_CONTEXT, device=dev, dtype=torch.float64),
    ]
    out = torch.stack(cols, dim=1).cpu()
    return torch.nan_to_num(out, nan=0.0, posinf=0.0, neginf=math.log(_TINY)).numpy()


def binary_fraction_case(hkv: int, r: int, d: int, n: int, seed: int) -> tuple[torch.Tensor, ...]:
    """q in {-1, 0, 1}, keys multiples of 1/4 (small) scaled per g=16 block by 1..3: every Quest bound is a short sum
    of exact binary fractions, so float32 and float64 compute it exactly and rank blocks identically, including the
    many exact ties (a tie must resolve as the reference's stable argsort does). Values and W_o are Gaussian."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-1, 2, (FEATURE_QUERIES, hkv, r, d), generator=gen).float()
    amp = torch.randint(1, 4, (hkv, -(-n // 16), 1), generator=gen).repeat_interleave(16, dim=1)[:, :n]
    keys = torch.randint(-3, 4, (hkv, n, d), generator=gen).float() * 0.25 * amp
    values = torch.randn(hkv, n, d, generator=gen)
    wo = torch.randn(40, hkv * r * d, generator=gen)
    return q, keys, values, wo


# (hkv, r, d, n, sink, window): n from just above sink + window + 128 to a few thousand, mostly not a multiple of 128
SHAPES = [
    (1, 1, 32, 209, 16, 64),
    (2, 7, 64, 1000, 16, 64),
    (3, 3, 64, 2049, 16, 64),
    (3, 1, 32, 4001, 16, 64),
    (2, 4, 64, 1024, 16, 64),
    (2, 2, 32, 777, 20, 100),
    (1, 5, 64, 3000, 4, 256),
    (2, 3, 32, 500, 0, 32),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "hkv{}-r{}-d{}-n{}-s{}-w{}".format(*s))
def test_matches_float64_reference_with_exact_rankings(shape: tuple[int, ...], device: str) -> None:
    hkv, r, d, n, sink, window = shape
    q, keys, values, wo = binary_fraction_case(hkv, r, d, n, seed=n + 7 * r)
    want = reference_features(q, keys, values, wo, 5, 24, sink, window)
    with exact_fp32_matmul():
        got = layer_features(*(t.to(device) for t in (q, keys, values, wo)), 5, 24, sink, window)
    assert got.dtype == torch.float32 and got.shape == want.shape and torch.isfinite(got).all()
    # float32 sums over up to a few thousand keys against float64: ~1e-6 relative; the logs of small masses amplify
    # absolute errors by 1 / (x + 1e-6), still far below 1e-4 for these inputs
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-4, atol=2e-5, err_msg=str(FEATURE_NAMES))


@pytest.mark.parametrize("device", DEVICES)
def test_matches_float64_reference_on_gaussian_data(device: str) -> None:
    """Real-valued bounds, with planted needles (keys along the queries' direction) so that the Quest top-k finds
    much of the outside mass. float32 and float64 may order two blocks differently only where their bounds agree to
    ~1e-6 relative (ordinary blocks, not the needles' far higher bounds); such a swap at a budget's cut trades one
    block's mass for another's, moving one query's recall by at most an ordinary block's share of its outside mass
    (< 1/20 even at g=128, the coarsest level), the mean over the Q queries by an eighth of that. 0.02 admits a few
    such swaps and still fails on a wrong selection. The other features must agree to float32 precision."""
    hkv, r, d, n = 2, 6, 128, 3100
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(FEATURE_QUERIES, hkv, r, d, generator=gen)
    keys = torch.randn(hkv, n, d, generator=gen)
    keys[:, :4] += 2.0  # sink-like keys: large scores at the start
    direction = q.sum((0, 2)) / q.sum((0, 2)).norm(dim=-1, keepdim=True)  # [Hkv, D]
    for pos in (400, 1333, 2050, 2051, 2900):
        keys[:, pos] += (20 + 5 * (pos % 7)) * direction  # scores raised by ~3 to ~6
    values = torch.randn(hkv, n, d, generator=gen)
    wo = torch.randn(64, hkv * r * d, generator=gen)
    want = reference_features(q, keys, values, wo, 0, 28, 16, 64)
    with exact_fp32_matmul():
        got = layer_features(*(t.to(device) for t in (q, keys, values, wo)), 0, 28, 16, 64).numpy()
    recall = np.array([name.startswith(("recall", "oracle")) for name in FEATURE_NAMES])
    assert want[:, recall].max() > 0.4  # the needles make the recall features informative
    np.testing.assert_allclose(got[:, ~recall], want[:, ~recall], rtol=1e-4, atol=2e-5)
    np.testing.assert_allclose(got[:, recall], want[:, recall], atol=0.02)


def test_strided_and_half_inputs_give_the_same_features() -> None:
    """Keys/values as slices of a longer buffer (the calibration passes the prefix of a captured prompt), q as a
    non-contiguous view, fp16 inputs: the strided views inside must follow the inputs' strides."""
    hkv, r, d, n = 2, 3, 64, 1500
    q, keys, values, wo = binary_fraction_case(hkv, r, d, n + 300, seed=3)
    dense = layer_features(q.contiguous(), keys[:, :n].contiguous(), values[:, :n].contiguous(), wo, 1, 4, 16, 64)
    q_view = q.transpose(0, 1).contiguous().transpose(0, 1)  # same values, Q not the outermost stride
    strided = layer_features(q_view, keys[:, :n], values[:, :n], wo, 1, 4, 16, 64)
    assert not q_view.is_contiguous() and not keys[:, :n].is_contiguous()
    torch.testing.assert_close(strided, dense, rtol=1e-6, atol=1e-6)
    half = layer_features(q.half(), keys[:, :n].half(), values[:, :n].half(), wo.half(), 1, 4, 16, 64)
    want = reference_features(q.half(), keys[:, :n].half(), values[:, :n].half(), wo.half(), 1, 4, 16, 64)
    np.testing.assert_allclose(half.numpy(), want, rtol=1e-4, atol=2e-5)


def test_no_host_sync_inside() -> None:
    """Only the final copy to the host may wait for the device: no .item(), nonzero() or data-dependent shapes."""
    q, keys, values, wo = binary_fraction_case(2, 3, 32, 1100, seed=5)
    layer_features(q, keys, values, wo, 0, 2, 16, 64)  # warm the shape caches
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        layer_features(q, keys, values, wo, 0, 2, 16, 64)
    names = {e.name for e in prof.events()}
    syncing = {"aten::item", "aten::_local_scalar_dense", "aten::nonzero", "aten::is_nonzero", "aten::equal"}
    assert names.isdisjoint(syncing), names & syncing
    assert "aten::sort" in names  # the profile did see the function's ops


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layers_per_batch", [1, 2, 5])
def test_prompt_features_equal_each_layers_reference(layers_per_batch: int, device: str) -> None:
    """Several layers stacked on one group axis (the per-request planner's call) give each layer's own float64
    reference features: layer index, contribution share among that layer's groups only, its own W_o. batch_bytes
    set so that 1, 2 or all 5 layers go together (a last, shorter batch included)."""
    hkv, r, d, n, n_layers = 2, 3, 32, 1300, 5
    cases = [binary_fraction_case(hkv, r, d, n, seed=40 + i) for i in range(n_layers)]
    qs, keys, values, wos = (list(t) for t in zip(*cases))
    wos[1] = wos[1] * 3.0  # layers differ in W_o scale: a share taken across layers would show
    per_layer = hkv * FEATURE_QUERIES * r * (-(-n // 128) * 128) * 4
    with exact_fp32_matmul():
        got = head_features.prompt_features([t.to(device) for t in qs], [t.to(device) for t in keys],
                                            [t.to(device) for t in values], [t.to(device) for t in wos],
                                            list(range(n_layers)), n_layers, 16, 64,
                                            batch_bytes=layers_per_batch * per_layer)
    assert len(got) == n_layers
    for layer in range(n_layers):
        want = reference_features(qs[layer], keys[layer], values[layer], wos[layer], layer, n_layers, 16, 64)
        np.testing.assert_allclose(got[layer].numpy(), want, rtol=1e-4, atol=2e-5, err_msg=f"layer {layer}")


def test_prompt_features_reject_mismatched_lists() -> None:
    q, keys, values, wo = binary_fraction_case(1, 2, 32, 500, seed=2)
    with pytest.raises(ValueError, match="one q, keys, values, wo and layer index per layer"):
        head_features.prompt_features([q, q], [keys], [values], [wo], [0], 2, 16, 64)


@pytest.mark.parametrize("n, sink, window", [(16 + 64 + FEATURE_QUERIES - 2, 16, 64), (100, 90, 4), (5, 0, 0)])
def test_rejects_prompts_shorter_than_sink_window_and_queries(n: int, sink: int, window: int) -> None:
    q, keys, values, wo = binary_fraction_case(1, 1, 32, max(n, 1), seed=1)
    with pytest.raises(ValueError, match=f"N={n}, sink={sink}, window={window}"):
        layer_features(q, keys[:, :n], values[:, :n], wo, 0, 2, sink, window)


def test_shortest_accepted_prompt_matches_reference() -> None:
    n = 16 + 64 + FEATURE_QUERIES - 1  # the first query's window ends right after the sink
    q, keys, values, wo = binary_fraction_case(2, 2, 32, n, seed=9)
    want = reference_features(q, keys, values, wo, 0, 2, 16, 64)
    np.testing.assert_allclose(layer_features(q, keys, values, wo, 0, 2, 16, 64).numpy(), want, rtol=1e-4,
                               atol=2e-5)


@contextlib.contextmanager
def exact_fp32_matmul() -> Iterator[None]:
    """Keep CUDA float32 matmuls in full precision (TF32 would round probabilities to 10 bits) for the comparison."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
