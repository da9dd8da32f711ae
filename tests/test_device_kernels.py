"""device_kernels' Triton kernels against float64 torch references, run by Triton's interpreter on the CPU
(TRITON_INTERPRET=1): the summary update, the block scores (pins, eligible range), the per-block partial attention
over a paged store read through a span, and the LSE combine with the streaming part. The same kernels compile for
the GPU on CUDA machines; tests/test_device_graph.py runs them inside the decode step against the torch path."""
from __future__ import annotations

import os

import pytest
import torch

from fluxion_lite.device_select import PINNED_SCORE
from fluxion_lite.host_kv import CHUNK_TOKENS

pytest.importorskip("triton")
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # compiled kernels on a GPU, else interpreted


def on(*ts: torch.Tensor | None) -> list:  # type: ignore[type-arg]
    return [t.to(DEV) if t is not None else None for t in ts]


@pytest.fixture()
def dk():  # type: ignore[no-untyped-def]
    """device_kernels; without CUDA its kernels run in Triton's interpreter (conftest.py chooses it)."""
    from fluxion_lite import device_kernels
    if not torch.cuda.is_available():
        assert os.environ.get("TRITON_INTERPRET") == "1"
    return device_kernels


@pytest.mark.parametrize("g,d", [(16, 32), (32, 64)])
def test_update_summaries(dk, g: int, d: int) -> None:  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(g + d)
    s = torch.randn(3, 2, 8, 2, d, generator=gen)  # [slots, Hkv, blocks, 2, D]
    want = s.clone().double()
    k = torch.randn(2, 2, d, generator=gen).to(torch.bfloat16)
    slots, pos = torch.tensor([2, 0]), torch.tensor([3 * g, 5 * g + 7])  # a new block, then one partly filled
    s_dev = on(s)[0]
    dk.update_summaries(s_dev, *on(k, slots, pos), g)
    s = s_dev.cpu()
    for b in range(2):
        blk, kk = int(pos[b]) // g, k[b].double()
        if int(pos[b]) % g == 0:
            want[slots[b], :, blk, 0], want[slots[b], :, blk, 1] = kk, kk
        else:
            want[slots[b], :, blk, 0] = torch.minimum(want[slots[b], :, blk, 0], kk)
            want[slots[b], :, blk, 1] = torch.maximum(want[slots[b], :, blk, 1], kk)
    torch.testing.assert_close(s.double(), want)


@pytest.mark.parametrize("r,d,nb,pins", [(4, 32, 40, False), (7, 64, 70, True), (1, 32, 33, True)])
def test_block_scores(dk, r: int, d: int, nb: int, pins: bool) -> None:  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(r * d + nb)
    B, hkv = 2, 3
    lo_hi = torch.randn(4, hkv, nb + 5, 2, d, generator=gen).sort(dim=3).values  # min <= max
    q = torch.randn(B, hkv, r, d, generator=gen)
    slots = torch.tensor([3, 1])
    bounds = torch.tensor([[1, 0], [nb - 2, nb]])  # [2, B]: eligible blocks [lo, hi)
    pinned = torch.rand(B, hkv, nb, generator=gen) < 0.2 if pins else None
    out = dk.block_scores(*on(q, lo_hi, slots, bounds), nb, *on(pinned, torch.empty(B, hkv, nb))).cpu()
    qd, s = q.double(), lo_hi.double()[slots][:, :, :nb]  # [B, Hkv, NB, 2, D]
    bound = torch.maximum(qd[:, :, :, None, :] * s[:, :, None, :, 0], qd[:, :, :, None, :] * s[:, :, None, :, 1])
    want = bound.sum(-1).sum(2)  # [B, Hkv, NB]: sum over dims and the group's heads
    if pinned is not None:
        want = torch.where(pinned, torch.full_like(want, PINNED_SCORE), want)
    blk = torch.arange(nb)
    eligible = (blk >= bounds[0][:, None, None]) & (blk < bounds[1][:, None, None])
    want = want.masked_fill(~eligible, float("-inf"))
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-4)


def _paged_store(gen: torch.Generator, slots: int, hkv: int, d: int, page_tokens: int, pages: int,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A span of shuffled pages: span [chunks, CHUNK_TOKENS * D]; tables [slots, pages] (each page's first chunk);
    the logical cache kv [slots, 2, Hkv, pages * page_tokens, D] it holds."""
    cph = page_tokens // CHUNK_TOKENS
    per_page = 2 * hkv * cph  # chunks: K of every head, then V
    order = torch.randperm(slots * pages, generator=gen)
    tables = (order.view(slots, pages) * per_page + 1).long()  # + 1: row 0 of the span belongs to no page
    n = pages * page_tokens
    kv = torch.randn(slots, 2, hkv, n, d, generator=gen).to(dtype)
    span = torch.full((slots * pages * per_page + 1, CHUNK_TOKENS * d), float("nan"), dtype=dtype)
    for s in range(slots):
        for p in range(pages):
            for part in range(2):
                for h in range(hkv):
                    for c in range(cph):
                        tok = p * page_tokens + c * CHUNK_TOKENS
                        row = int(tables[s, p]) + part * hkv * cph + h * cph + c
                        span[row] = kv[s, part, h, tok: tok + CHUNK_TOKENS].reshape(-1)
    return span, tables, kv


@pytest.mark.parametrize("r,d,g,dtype", [(4, 32, 16, torch.float32), (7, 64, 32, torch.bfloat16), (4, 32, 32, torch.float32), (4, 32, 16, torch.bfloat16),
                                         (1, 32, 16, torch.bfloat16)])
def test_block_attention_and_combine(dk, r: int, d: int, g: int, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(r + d + g)
    B, hkv, page_tokens, pages, slot_cap = 2, 3, 64, 4, 3
    span, tables, kv = _paged_store(gen, slot_cap, hkv, d, page_tokens, pages, dtype)
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
    dk.block_attention(*on(q, ids, vals, flat_h, flat_j, k_row, slots, tables, span), page_tokens, g, scale,
                       part_o, part_m, part_l)
    out_s = torch.randn(B, hkv, r, d, generator=gen)
    lse_s = torch.randn(B, hkv, r, generator=gen)
    starts = torch.cumsum(caps, 0) - caps
    out = dk.combine(part_o, part_m, part_l, *on(starts, caps, out_s, lse_s, torch.empty(B, hkv, r, d, dtype=dtype)))
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
