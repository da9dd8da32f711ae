"""Top-k block selection for the fused device step (device_graph.py): one Triton program per (row, group).

Why not torch.topk: on the H200 (8B shape, 32K, batch 1) torch.topk plus the sorts it launches took ~1.2 ms of a
~9.4 ms step, ~38 us per layer for rows of ~2K scores (tpot's kernel profile, c282289). The decode step needs no
order among the chosen blocks (block_attention reads each entry on its own; combine merges them by LSE), only
*which* k blocks, so a select without a sort suffices:

  1. each score becomes a uint32 key with the same order (IEEE bits, sign-flipped);
  2. the k-th largest key is found bit by bit from the top (up to 32 counts over the row, which stays in
     registers; it stops once exactly k keys lie at or above the prefix found so far);
  3. keys above it are taken, then equal keys in index order until k are taken; a prefix sum gives each taken
     block its slot, so entries come out in ascending block order.

Ties: equal scores (every pinned block scores PINNED_SCORE) resolve to the lower block index. Rows longer than
MAX_BLOCKS (over 256K tokens at g = 16) would not fit in registers: those fall back to torch.topk, whose best-first
order is a valid answer too.

Contract of select_top: scores fp32 [B, Hkv, NB] contiguous (-inf = not eligible); k_row int64 [B, Hkv] (blocks
wanted per row; clamped to width); ids int64 and vals fp32 [B, Hkv, width] contiguous, width <= NB. Writes, per row,
min(k, width) entries in ids/vals [..., :k] (vals = the block's score: -inf when fewer than k blocks are eligible)
and vals = -inf, ids = 0 in [..., k:].
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from fluxion_lite.sparse.device.kernels import pow2, triton
from fluxion_lite.sparse.device.summaries import PINNED_SCORE

if triton is not None:  # device_kernels imported it (the CPU wheel of torch ships no Triton)
    import triton.language as tl

MAX_BLOCKS = 16384  # longest row kept in registers (fp32 keys: 64 per thread at 8 warps)

if triton is not None:

    @triton.jit
    def _select_top_kernel(scores_ptr, krow_ptr, ids_ptr, vals_ptr, NB, WIDTH,
                           held_ptr, owner_ptr, cursor_ptr, scratch_ptr, entry_ptr, hit_ptr, hits_ptr, C,
                           NB_PAD: tl.constexpr, W_PAD: tl.constexpr, HAS_REUSE: tl.constexpr,
                           C_PAD: tl.constexpr, PINNED: tl.constexpr):
        row = tl.program_id(0)  # = b * Hkv + h
        nn = tl.arange(0, NB_PAD)
        inside = nn < NB
        score = tl.load(scores_ptr + row * NB + nn, mask=inside, other=float("-inf"))  # [NB_PAD]
        k = tl.minimum(tl.load(krow_ptr + row), WIDTH).to(tl.int32)
        bits = tl.where(score == 0.0, 0, score.to(tl.uint32, bitcast=True))  # -0.0 ties with +0.0 as in float order
        # order-preserving key: negatives (sign set) reversed, positives above them; -inf -> 0x007FFFFF
        key = tl.where((bits >> 31) != 0, bits ^ 0xFFFFFFFF, bits | 0x80000000)
        key = tl.where(inside, key, tl.zeros_like(key))  # padding lies below every real score
        # thr = the largest t with count(key >= t) >= k, i.e. the k-th largest key, decided from the top bit down
        # (one count per bit: bench/topk_select.py measured counting 2 or 4 bits per round, all candidate digits in
        # one reduction, 1.2-2.3x slower on the H200 at 2K-8K blocks: the extra compares cost more than the
        # reductions they save)
        # The loop stops as soon as exactly k keys are >= thr: those are the k largest whatever the lower bits
        # (the (k+1)-th key is below thr), and the code after the loop takes exactly them. Decode scores are
        # spread enough that this happens ~10 bits early, and each round is a block-wide reduction
        thr = tl.zeros((), tl.uint32)
        one = tl.full((), 1, tl.uint32)
        n_ge = tl.full((), NB_PAD, tl.int32)  # keys >= thr = 0: all of them, padding included
        i = 0
        while (i < 32) & (n_ge != k):
            cand = thr | (one << (31 - i))
            count = tl.sum((key >= cand).to(tl.int32), axis=0)
            thr = tl.where(count >= k, cand, thr)
            n_ge = tl.where(count >= k, count, n_ge)
            i += 1
        above = key > thr
        n_above = tl.sum(above.to(tl.int32), axis=0)
        equal = (key == thr) & inside
        equal_rank = tl.cumsum(equal.to(tl.int32), axis=0)  # 1-based among equal keys, in block order
        take = above | (equal & (equal_rank <= k - n_above))  # exactly k blocks (none when k = 0)
        slot = tl.cumsum(take.to(tl.int32), axis=0) - 1  # [NB_PAD]: the entry each taken block fills
        out = row * WIDTH + slot
        tl.store(ids_ptr + out, nn.to(tl.int64), mask=take)
        tl.store(vals_ptr + out, score, mask=take)
        ww = tl.arange(0, W_PAD)
        rest = (ww >= k) & (ww < WIDTH)  # entries past k: masked for block_attention
        tl.store(vals_ptr + row * WIDTH + ww, tl.full((W_PAD,), float("-inf"), tl.float32), mask=rest)
        tl.store(ids_ptr + row * WIDTH + ww, tl.zeros((W_PAD,), tl.int64), mask=rest)
        if HAS_REUSE:
            _reuse_entries(row, k, ids_ptr, vals_ptr, held_ptr, owner_ptr, cursor_ptr, scratch_ptr, entry_ptr,
                           hit_ptr, hits_ptr, NB, C, WIDTH, W_PAD, C_PAD, PINNED)

    @triton.jit
    def _reuse_entries(row, k, ids_ptr, vals_ptr, held_ptr, owner_ptr, cursor_ptr, scratch_ptr, entry_ptr, hit_ptr,
                       hits_ptr, NB, C, WIDTH, W_PAD: tl.constexpr, C_PAD: tl.constexpr, PINNED: tl.constexpr):
        """The reuse cache's bookkeeping for one row (reuse_cache.py): which chosen blocks are in device memory
        (hits), and which entries the others fill. An entry keeps its block until a miss needs it, so a block
        that comes back after a few steps still hits; misses take the entries not read this step in turn from a
        rotating cursor (the least recently filled first, as long as they are not hits). Works on the row's
        chosen entries (width ~5-10% of the blocks), not on all of its blocks."""
        ww = tl.arange(0, W_PAD)
        base = row * WIDTH + ww
        chosen = ww < k
        tl.debug_barrier()  # the entries just stored by other threads are read back (one program per row)
        block = tl.load(ids_ptr + base, mask=chosen, other=0).to(tl.int32)  # [W_PAD]
        score = tl.load(vals_ptr + base, mask=chosen, other=float("-inf"))
        # pinned blocks come from the pin pool (or the host), never from this cache; -inf ones are not read
        cacheable = chosen & (score != PINNED) & (score > float("-inf"))
        held = tl.load(held_ptr + row * NB + block, mask=cacheable, other=-1)  # entry holding the block, or -1
        hit = cacheable & (held >= 0)
        miss = cacheable & (held < 0)
        ee = tl.arange(0, C_PAD)
        busy_row = scratch_ptr + row * 2 * C_PAD  # [C_PAD] flags: entry read this step
        free_row = busy_row + C_PAD  # [C_PAD] the free entries in cursor order
        tl.store(busy_row + ee, tl.zeros(ee.shape, tl.int32))
        tl.debug_barrier()  # what one thread stores, others load after a barrier
        tl.store(busy_row + held, tl.full(ww.shape, 1, tl.int32), mask=hit)
        tl.debug_barrier()
        cursor = tl.load(cursor_ptr + row)
        turn = (cursor + ee) % C  # [C_PAD]: entries in the order misses take them
        free = (ee < C) & (tl.load(busy_row + turn, mask=ee < C, other=1) == 0)
        free_rank = tl.cumsum(free.to(tl.int32), axis=0) - 1
        n_free = tl.sum(free.to(tl.int32), axis=0)
        tl.store(free_row + free_rank, turn, mask=free)
        tl.debug_barrier()
        miss_rank = tl.cumsum(miss.to(tl.int32), axis=0) - 1
        fill = miss & (miss_rank < n_free)  # more misses than free entries: the rest is read, not kept
        new_entry = tl.load(free_row + miss_rank, mask=fill, other=-1)
        evicted = tl.load(owner_ptr + row * C + new_entry, mask=fill, other=-1)  # the block the entry held
        # an evicted block is held and not chosen (chosen and held, it would be a hit, its entry busy), a filled
        # block missed: the two stores below never touch the same block
        tl.store(held_ptr + row * NB + evicted, tl.full(ww.shape, -1, tl.int32), mask=fill & (evicted >= 0))
        tl.store(held_ptr + row * NB + block, new_entry, mask=fill)
        tl.store(owner_ptr + row * C + new_entry, block, mask=fill)
        n_fill = tl.minimum(tl.sum(miss.to(tl.int32), axis=0), n_free)
        used = tl.max(tl.where(free & (free_rank < n_fill), ee + 1, 0), axis=0)  # cursor positions consumed
        tl.store(cursor_ptr + row, (cursor + used) % C)
        # per entry of the row: the cache entry to read (hit) or to fill after the PCIe read (kept miss), else -1
        in_row = ww < WIDTH
        tl.store(entry_ptr + base, tl.where(hit, held, new_entry), mask=in_row)
        tl.store(hit_ptr + base, hit.to(tl.int8), mask=in_row)
        tl.atomic_add(hits_ptr, tl.sum(hit.to(tl.int64), axis=0))


class ReuseViews(NamedTuple):
    """One layer's reuse-cache state for select_top (reuse_cache.py owns the tensors)."""
    held: torch.Tensor  # int32 [B, Hkv, NB]: the entry holding each block, -1 when not cached
    owner: torch.Tensor  # int32 [B, Hkv, C]: the block each entry holds, -1 when never used
    cursor: torch.Tensor  # int32 [B, Hkv]: the entry misses try first
    scratch: torch.Tensor  # int32 [>= B * Hkv * 2 * pow2(C)]
    entry: torch.Tensor  # int32 [B, Hkv, width] out: per chosen block, the entry to read or fill, -1 for none
    hit: torch.Tensor  # int8 [B, Hkv, width] out: 1 when the block is read from its entry
    hits: torch.Tensor  # int64 [1]: hits are added here


def select_top(scores: torch.Tensor, k_row: torch.Tensor, ids: torch.Tensor, vals: torch.Tensor,
               reuse: ReuseViews | None = None) -> None:
    """The k_row[b, h] best blocks of each row of scores into ids/vals (see the module docstring); with reuse, also
    the reuse cache's entries of the chosen blocks (reuse_cache.py)."""
    B, hkv, nb = scores.shape
    width = ids.shape[2]
    assert scores.dtype == torch.float32 and scores.is_contiguous() and k_row.is_contiguous()
    assert ids.dtype == torch.int64 and vals.dtype == torch.float32 and ids.is_contiguous() and vals.is_contiguous()
    assert ids.shape == (B, hkv, width) and vals.shape == ids.shape and k_row.shape == (B, hkv) and width <= nb
    if triton is None or nb > MAX_BLOCKS:
        top = scores.topk(width, dim=-1)  # best first: the first k of each row are its k best
        rest = torch.arange(width, device=scores.device) >= k_row[..., None]  # [B, Hkv, width]
        vals.copy_(top.values.masked_fill(rest, float("-inf")))
        ids.copy_(top.indices.masked_fill(rest, 0))
        if reuse is not None:  # no reuse: every block is read over PCIe
            reuse.entry.fill_(-1)
            reuse.hit.zero_()
        return
    nb_pad = pow2(nb)
    c = 1
    if reuse is not None:
        c = reuse.owner.shape[2]
        assert reuse.held.shape == scores.shape and reuse.held.dtype == torch.int32 and reuse.held.is_contiguous()
        assert reuse.owner.shape[:2] == (B, hkv) and reuse.owner.is_contiguous()
        assert reuse.entry.shape == ids.shape and reuse.hit.shape == ids.shape and reuse.entry.is_contiguous()
        assert reuse.scratch.numel() >= B * hkv * 2 * pow2(c) and reuse.cursor.shape == (B, hkv)
    r = reuse if reuse is not None else ReuseViews(*([k_row] * 7))  # any pointers when there is no cache
    _select_top_kernel[(B * hkv,)](scores, k_row, ids, vals, nb, width, r.held, r.owner, r.cursor, r.scratch,
                                   r.entry, r.hit, r.hits, c, NB_PAD=nb_pad, W_PAD=pow2(width),
                                   HAS_REUSE=reuse is not None, C_PAD=pow2(c), PINNED=PINNED_SCORE,
                                   num_warps=8 if nb_pad >= 4096 else 4)
