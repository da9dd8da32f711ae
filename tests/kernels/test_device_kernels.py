"""device_kernels' Triton kernels against float64 torch references, run by Triton's interpreter on the CPU
(TRITON_INTERPRET=1): the summary update, the block scores (pins, eligible range), the per-block partial attention
over a paged store read through a span, and the LSE combine with the streaming part. The same kernels compile for
the GPU on CUDA machines; tests/engine/test_device_graph.py runs them inside the decode step against the torch path."""
from __future__ import annotations

import os

import pytest
import torch

from fluxion_lite.sparse.device.summaries import PINNED_SCORE
from fluxion_lite.hostkv.store import CHUNK_TOKENS
from paged_span import paged_store

pytest.importorskip("triton")
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # compiled kernels on a GPU, else interpreted


def on(*ts: torch.Tensor | None) -> list:  # type: ignore[type-arg]
    return [t.to(DEV) if t is not None else None for t in ts]


@pytest.fixture()
def dk():  # type: ignore[no-untyped-def]
    """device_kernels; without CUDA its kernels run in Triton's interpreter (conftest.py chooses it)."""
    from fluxion_lite.sparse.device import kernels as device_kernels
    if not torch.cuda.is_available():
        assert os.environ.get("TRITON_INTERPRET") == "1"
    return device_kernels


@pytest.mark.parametrize("g,d", [(16, 32), (32, 64)])
def test_append_token(dk, g: int, d: int) -> None:  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(g + d)
    B, hkv, ltot = 2, 2, 40
    s = torch.randn(3, hkv, 8, 2, d, generator=gen)  # [slots, Hkv, blocks, 2, D]
    near = torch.randn(3, 2, hkv, ltot, d, generator=gen).to(torch.bfloat16)
    stage = torch.randn(B, 2, hkv, d, generator=gen).to(torch.float16)  # the store's dtype may differ
    k = torch.randn(B, 3, hkv, d, generator=gen).to(torch.bfloat16)[:, 1]  # a strided view
    v = torch.randn(B, hkv, d, generator=gen).to(torch.bfloat16)  # with other strides than k's
    slots, pos, ring = torch.tensor([2, 0]), torch.tensor([3 * g, 5 * g + 7]), torch.tensor([31, 4])
    want_s, want_near, want_stage = s.clone().double(), near.clone(), stage.clone()
    s_d, near_d, stage_d = on(s, near, stage)
    dk.append_token(*on(k, v), near_d, stage_d, s_d, *on(slots, pos, ring), g)
    for b in range(B):  # pos 3g starts a new block; 5g + 7 lands in a partly filled one
        blk, kk = int(pos[b]) // g, k[b].double()
        if int(pos[b]) % g == 0:
            want_s[slots[b], :, blk, 0], want_s[slots[b], :, blk, 1] = kk, kk
        else:
            want_s[slots[b], :, blk, 0] = torch.minimum(want_s[slots[b], :, blk, 0], kk)
            want_s[slots[b], :, blk, 1] = torch.maximum(want_s[slots[b], :, blk, 1], kk)
        want_near[slots[b], 0, :, ring[b]], want_near[slots[b], 1, :, ring[b]] = k[b], v[b]
        want_stage[b, 0], want_stage[b, 1] = k[b].half(), v[b].half()
    torch.testing.assert_close(s_d.cpu().double(), want_s)
    assert torch.equal(near_d.cpu(), want_near) and torch.equal(stage_d.cpu(), want_stage)


def merged_splits(o: torch.Tensor, m: torch.Tensor, l: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Partials o [..., S, r, D] (not divided by l), m, l [..., S, r] merged in float64 -> (out [..., r, D], lse)."""
    o, m, l = o.double(), m.double(), l.double()
    lse = torch.logsumexp(m + l.log(), dim=-2)  # an empty split: m = -inf, l = 0 -> weight 0
    w = torch.exp(m - lse[..., None, :]).nan_to_num(0.0)  # [..., S, r]
    return (w[..., None] * o).sum(-3), lse


@pytest.mark.parametrize("r,d,ltot,splits", [(4, 32, 40, 1), (4, 32, 40, 3), (7, 64, 100, 4), (1, 32, 17, 1),
                                             (4, 32, 208, 7)])
def test_stream_attention(dk, r: int, d: int, ltot: int, splits: int) -> None:  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(r * d + ltot + splits)
    B, hkv, n_g = 2, 3, 4
    near = torch.randn(3, 2, hkv, ltot, d, generator=gen).to(torch.bfloat16)
    near[0, :, :, 3] = float("nan")  # a slot nobody attends may hold any bits
    bias = torch.where(torch.rand(n_g, B, ltot, generator=gen) < 0.6, 0.0, float("-inf"))
    bias[..., 0] = 0.0  # every row attends something
    bias[:, :, 3] = float("-inf")
    bias[1, 0, ltot // 2:] = float("-inf")  # one row's later splits attend nothing: they must weigh 0, not NaN
    gidx = torch.tensor([2, 0, 1])  # each group's block-size index picks its bias row
    q = torch.randn(B, hkv, r, d, generator=gen).to(torch.bfloat16)
    slots, scale = torch.tensor([0, 2]), d ** -0.5
    o, m, l = on(torch.empty(B, hkv, splits, r, d), torch.empty(B, hkv, splits, r), torch.empty(B, hkv, splits, r))
    dk.stream_attention(*on(q, near, bias, gidx, slots), o, m, l, scale)
    out, lse = merged_splits(o.cpu(), m.cpu(), l.cpu())
    assert torch.isfinite(out).all()
    for b in range(B):
        for h in range(hkv):
            keep = bias[int(gidx[h]), b] == 0
            keys = near[slots[b], 0, h][keep].double()
            values = near[slots[b], 1, h][keep].double()
            logits = q[b, h].double() @ keys.T * scale  # [r, T]
            torch.testing.assert_close(lse[b, h], torch.logsumexp(logits, -1), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(out[b, h], torch.softmax(logits, -1) @ values, rtol=1e-5, atol=1e-5)


def test_stream_splits_cover_the_slab_one_tile_each(dk) -> None:  # type: ignore[no-untyped-def]
    assert dk.stream_splits(208) == 7 and dk.stream_splits(32) == 1 and dk.stream_splits(33) == 2
    assert dk.stream_splits(208, tiles_per_split=4) == 2


@pytest.mark.parametrize("r,d,nb,pins", [(4, 32, 40, False), (7, 64, 70, True), (1, 32, 33, True)])
@pytest.mark.parametrize("midrange", [False, True])
def test_block_scores(dk, r: int, d: int, nb: int, pins: bool, midrange: bool) -> None:  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(r * d + nb)
    B, hkv = 2, 3
    lo_hi = torch.randn(4, hkv, nb + 5, 2, d, generator=gen).sort(dim=3).values  # min <= max
    q = torch.randn(B, hkv, r, d, generator=gen)
    slots = torch.tensor([3, 1])
    bounds = torch.tensor([[1, 0], [nb - 2, nb]])  # [2, B]: eligible blocks [lo, hi)
    pinned = torch.rand(B, hkv, nb, generator=gen) < 0.2 if pins else None
    out = dk.block_scores(*on(q, lo_hi, slots, bounds), nb, *on(pinned, torch.empty(B, hkv, nb)), midrange).cpu()
    qd, s = q.double(), lo_hi.double()[slots][:, :, :nb]  # [B, Hkv, NB, 2, D]
    if midrange:  # the summed heads against (min + max) / 2
        want = torch.einsum("bhd,bhnd->bhn", qd.sum(2), (s[..., 0, :] + s[..., 1, :]) / 2)
    else:
        bound = torch.maximum(qd[:, :, :, None, :] * s[:, :, None, :, 0], qd[:, :, :, None, :] * s[:, :, None, :, 1])
        want = bound.sum(-1).sum(2)  # [B, Hkv, NB]: sum over dims and the group's heads
    if pinned is not None:
        want = torch.where(pinned, torch.full_like(want, PINNED_SCORE), want)
    blk = torch.arange(nb)
    eligible = (blk >= bounds[0][:, None, None]) & (blk < bounds[1][:, None, None])
    want = want.masked_fill(~eligible, float("-inf"))
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("r,d,g,dtype", [(4, 32, 16, torch.float32), (7, 64, 32, torch.bfloat16), (4, 32, 32, torch.float32), (4, 32, 16, torch.bfloat16),
                                         (1, 32, 16, torch.bfloat16)])
@pytest.mark.parametrize("pin_cache", [False, True])
@pytest.mark.parametrize("entries", [1, 3])  # flat entries per program (FLUXION_BA_ENTRIES); 8 entries: a ragged tail
def test_block_attention_and_combine(dk, monkeypatch: pytest.MonkeyPatch, r: int, d: int, g: int, dtype: torch.dtype,  # type: ignore[no-untyped-def]
                                     pin_cache: bool, entries: int) -> None:
    gen = torch.Generator().manual_seed(r + d + g)
    B, hkv, page_tokens, pages, slot_cap = 2, 3, 64, 4, 3
    span, tables, kv = paged_store(gen, slot_cap, hkv, d, page_tokens, pages, dtype)
    nb = pages * page_tokens // g
    caps = torch.tensor([3, 0, 5])  # per group: entries in the flat list (group 1 streams)
    flat_h = torch.repeat_interleave(torch.arange(hkv), caps)
    flat_j = torch.cat([torch.arange(int(c)) for c in caps])
    width = int(caps.max())
    ids = torch.stack([torch.randperm(nb, generator=gen)[:width] for _ in range(B * hkv)]).view(B, hkv, width)
    vals = torch.randn(B, hkv, width, generator=gen)
    vals[0, 2, 1] = float("-inf")  # an ineligible block that top-k still returned
    k_row = torch.tensor([[3, 0, 4], [2, 0, 5]])  # rank >= k: masked
    slots = torch.tensor([2, 0])
    q = torch.randn(B, hkv, r, d, generator=gen).to(dtype if dtype != torch.bfloat16 else torch.bfloat16)
    scale = d ** -0.5
    n = flat_h.shape[0]
    cap = n + 3  # the partial buffers are shared by all layers: sized for the widest, rows strided by that size
    part_o, part_m, part_l = torch.empty(B, cap, r, d), torch.empty(B, cap, r), torch.empty(B, cap, r)
    part_o, part_m, part_l = on(part_o, part_m, part_l)
    cache: list[torch.Tensor | None] = [None, None]
    if pin_cache:  # the first two ranks of every (row, group) live in a device pin cache; their host copies are NaN
        n_pin = 2
        pin_slot = torch.full((B, hkv, nb), -1, dtype=torch.int32)
        # one pool for the layer, entries in a shuffled order (a block's entry is whatever pin_slot says), one spare
        order = torch.randperm(B * hkv * n_pin + 1, generator=gen).tolist()
        pin_kv = torch.full((len(order), 2, g, d), float("nan"), dtype=dtype)
        cph, cpb = page_tokens // CHUNK_TOKENS, g // CHUNK_TOKENS
        for b in range(B):
            for h in range(hkv):
                for blk in ids[b, h, :n_pin].tolist():
                    c = order.pop()
                    pin_slot[b, h, blk] = c
                    pin_kv[c, :] = kv[slots[b], :, h, blk * g:(blk + 1) * g]
                    for part in range(2):  # poison the host rows: a read of them would give NaN
                        for t in range(cpb):
                            tok = blk * g + t * CHUNK_TOKENS
                            row = (int(tables[slots[b], tok // page_tokens]) + part * hkv * cph + h * cph
                                   + (tok % page_tokens) // CHUNK_TOKENS)
                            span[row] = float("nan")
        cache = on(pin_slot, pin_kv)
    dk.block_attention(*on(q, ids, vals, flat_h, flat_j, k_row, slots, tables, span), page_tokens, g, scale,
                       part_o, part_m, part_l, *cache, entries=entries)
    # two streaming partials per (row, group), the second empty for row 1 group 0 (m = -inf, l = 0, o = 0)
    s_o = torch.randn(B, hkv, 2, r, d, generator=gen)
    s_m = torch.randn(B, hkv, 2, r, generator=gen)
    s_l = torch.rand(B, hkv, 2, r, generator=gen) + 0.5
    s_o[1, 0, 1], s_m[1, 0, 1], s_l[1, 0, 1] = 0.0, float("-inf"), 0.0
    out_s, lse_s = merged_splits(s_o, s_m, s_l)
    starts = torch.cumsum(caps, 0) - caps
    out = dk.combine(part_o, part_m, part_l, *on(starts, caps, s_o, s_m, s_l, torch.empty(B, hkv, r, d, dtype=dtype)))
    out = out.cpu()
    want = torch.empty(B, hkv, r, d, dtype=torch.float64)
    for b in range(B):
        for h in range(hkv):
            chosen = [int(ids[b, h, j]) for j in range(int(caps[h]))
                      if j < int(k_row[b, h]) and vals[b, h, j] > float("-inf")]
            toks = torch.cat([torch.arange(c * g, (c + 1) * g) for c in chosen]) if chosen else torch.empty(0).long()
            keys = kv[slots[b], 0, h, toks].double()
            values = kv[slots[b], 1, h, toks].double()
            logits = q[b, h].double() @ keys.T * scale  # [r, T]
            lse_r = torch.logsumexp(logits, -1) if chosen else torch.full((r,), float("-inf"), dtype=torch.float64)
            lse = torch.logaddexp(lse_r, lse_s[b, h].double())
            w_s = torch.exp(lse_s[b, h].double() - lse)[:, None]
            o_r = torch.softmax(logits, -1) @ values if chosen else torch.zeros(r, d, dtype=torch.float64)
            want[b, h] = w_s * out_s[b, h].double() + torch.exp(lse_r - lse)[:, None] * o_r
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("r,d,g,dtype", [(4, 32, 16, torch.float32), (7, 64, 32, torch.bfloat16),
                                         (1, 32, 16, torch.bfloat16)])
@pytest.mark.parametrize("entries", [1, 3])
def test_block_attention_fetch_then_attend_equals_one_pass(dk, monkeypatch: pytest.MonkeyPatch, r: int, d: int,  # type: ignore[no-untyped-def]
                                                           g: int, dtype: torch.dtype, entries: int) -> None:
    """With the reuse cache, stage 1 (fetch the kept misses into their entries) then stage 2 (attend, every block
    with an entry read from the cache) gives the one-pass kernel's partials and cache contents, bit for bit; the
    one pass itself against the float64 reference (hits read from the cache, whose host copies are poisoned)."""
    gen = torch.Generator().manual_seed(11 * r + d + g)
    B, hkv, page_tokens, pages, slot_cap, rc = 2, 3, 64, 4, 3, 6
    span, tables, kv = paged_store(gen, slot_cap, hkv, d, page_tokens, pages, dtype)
    nb = pages * page_tokens // g
    caps = torch.tensor([4, 0, 5])
    flat_h = torch.repeat_interleave(torch.arange(hkv), caps)
    flat_j = torch.cat([torch.arange(int(c)) for c in caps])
    width = int(caps.max())
    ids = torch.stack([torch.randperm(nb, generator=gen)[:width] for _ in range(B * hkv)]).view(B, hkv, width)
    vals = torch.randn(B, hkv, width, generator=gen)
    k_row = torch.tensor([[4, 0, 3], [2, 0, 5]])
    slots = torch.tensor([2, 0])
    q = torch.randn(B, hkv, r, d, generator=gen).to(dtype)
    # per (row, group): ranks 0, 1 hit entries 0, 1 (their K/V in the cache); rank 2 a miss kept in entry 3; the
    # rest misses without an entry (read, not kept); the other entries hold NaN, as does every kept miss before
    entry = torch.full((B, hkv, width), -1, dtype=torch.int32)
    hit = torch.zeros(B, hkv, width, dtype=torch.int8)
    entry[:, :, 0], entry[:, :, 1], entry[:, :, 2] = 0, 1, 3
    hit[:, :, :2] = 1
    cache = torch.full((B, hkv, rc, 2, g, d), float("nan"), dtype=dtype)
    for b in range(B):
        for h in range(hkv):
            for j in range(2):
                blk = int(ids[b, h, j])
                cache[b, h, j] = kv[slots[b], :, h, blk * g:(blk + 1) * g]
    scale = d ** -0.5
    n = flat_h.shape[0]
    results = []
    for stages in ((0,), (1, 2)):
        parts = on(torch.zeros(B, n, r, d), torch.zeros(B, n, r), torch.zeros(B, n, r))
        c = on(cache.clone())[0]
        for stage in stages:
            dk.block_attention(*on(q, ids, vals, flat_h, flat_j, k_row, slots, tables, span), page_tokens, g, scale,
                               *parts, None, None, *on(entry, hit), c, stage=stage, entries=entries)
        results.append([t.cpu() for t in parts + [c]])
    for one, two in zip(*results):
        assert torch.equal(one.nan_to_num(7.0), two.nan_to_num(7.0))
    o, m, l_sum, c = results[0]
    for i in range(n):
        h, j = int(flat_h[i]), int(flat_j[i])
        for b in range(B):
            if j >= int(k_row[b, h]):
                assert torch.all(m[b, i] == float("-inf")) and torch.all(l_sum[b, i] == 0)
                continue
            blk = int(ids[b, h, j])
            keys, values = (kv[slots[b], p, h, blk * g:(blk + 1) * g].double() for p in range(2))
            logits = q[b, h].double() @ keys.T * scale  # [r, g]
            want_m = logits.max(-1).values
            p_ = torch.exp(logits - want_m[:, None])
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(m[b, i].double(), want_m, rtol=tol, atol=tol)
            torch.testing.assert_close(l_sum[b, i].double(), p_.sum(-1), rtol=tol, atol=tol)
            torch.testing.assert_close(o[b, i].double(), p_ @ values, rtol=tol, atol=tol)
            if j == 2:  # the kept miss reached its entry
                assert torch.equal(c[b, h, 3], kv[slots[b], :, h, blk * g:(blk + 1) * g])


@pytest.mark.parametrize("d,max_entries", [(32, 300), (64, 40), (128, 17)])
def test_combine_many_entries(dk, d: int, max_entries: int) -> None:  # type: ignore[no-untyped-def]
    """combine over groups of 300, 0 and 17 retrieval entries (several rounds when max_entries is below the widest,
    column slices when D > 32), against a float64 log-sum-exp merge; masked entries (m = -inf) weigh nothing."""
    gen = torch.Generator().manual_seed(d + max_entries)
    B, hkv, r, splits = 2, 3, 3, 2
    caps = torch.tensor([300, 0, 17])
    starts = torch.cumsum(caps, 0) - caps
    n = int(caps.sum()) + 5  # capacity beyond the entries, as the shared buffers have
    part_o = torch.randn(B, n, r, d, generator=gen)
    part_m = torch.randn(B, n, r, generator=gen) * 3
    part_l = torch.rand(B, n, r, generator=gen) + 0.1
    masked = torch.rand(B, n, generator=gen) < 0.2
    part_m[masked], part_l[masked], part_o[masked] = float("-inf"), 0.0, 0.0
    s_o = torch.randn(B, hkv, splits, r, d, generator=gen)
    s_m = torch.randn(B, hkv, splits, r, generator=gen)
    s_l = torch.rand(B, hkv, splits, r, generator=gen) + 0.5
    out = dk.combine(*on(part_o, part_m, part_l, starts, caps, s_o, s_m, s_l, torch.empty(B, hkv, r, d)),
                     max_entries=max_entries).cpu()
    for b in range(B):
        for h in range(hkv):
            rows = list(range(int(starts[h]), int(starts[h] + caps[h])))
            m = torch.cat([s_m[b, h].double(), part_m[b, rows].double()])  # [S + E, r]
            lsum = torch.cat([s_l[b, h].double(), part_l[b, rows].double()])
            o = torch.cat([s_o[b, h].double(), part_o[b, rows].double()])  # [S + E, r, D]
            w = torch.where(torch.isfinite(m), torch.exp(m - m.max(0).values), torch.zeros_like(m))
            want = (w[..., None] * o).sum(0) / (w * lsum).sum(0)[:, None]  # o holds unnormalised sums
            torch.testing.assert_close(out[b, h].double(), want, rtol=1e-5, atol=1e-5)


def test_enabled_follows_the_setting_and_falls_back_when_the_probe_fails(dk, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv("FLUXION_TRITON", raising=False)
    assert not dk.enabled(torch.device("cpu"))  # the CPU device keeps the torch ops unless forced
    monkeypatch.setenv("FLUXION_TRITON", "1")
    assert dk.enabled(torch.device("cpu"))
    monkeypatch.setenv("FLUXION_TRITON", "0")
    assert not dk.enabled(torch.device("cuda"))
    if not torch.cuda.is_available():  # the probe cannot run: a warning, and the torch path
        monkeypatch.delenv("FLUXION_TRITON")
        monkeypatch.setattr(dk, "_probed", {})
        with pytest.warns(RuntimeWarning, match="Triton kernels unusable"):
            assert not dk.enabled(torch.device("cuda"))
        assert not dk.enabled(torch.device("cuda"))  # decided once per device
