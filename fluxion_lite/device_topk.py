"""Top-k block selection for the fused device step (device_graph.py): one Triton program per (row, group).

Why not torch.topk: on the H200 (8B shape, 32K, batch 1) torch.topk plus the sorts it launches took ~1.2 ms of a
~9.4 ms step, ~38 us per layer for rows of ~2K scores (tpot's kernel profile, c282289). The decode step needs no
order among the chosen blocks (block_attention reads each entry on its own; combine merges them by LSE), only
*which* k blocks, so a select without a sort suffices:

  1. each score becomes a uint32 key with the same order (IEEE bits, sign-flipped);
  2. the k-th largest key is found bit by bit from the top (32 counts over the row, which stays in registers);
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

import torch

try:  # as in device_kernels: the CPU wheel of torch ships no Triton
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None  # type: ignore[assignment]

MAX_BLOCKS = 16384  # longest row kept in registers (fp32 keys: 64 per thread at 8 warps)

if triton is not None:

    @triton.jit
    def _select_top_kernel(scores_ptr, krow_ptr, ids_ptr, vals_ptr, NB, WIDTH,
                           NB_PAD: tl.constexpr, W_PAD: tl.constexpr):
        row = tl.program_id(0)  # = b * Hkv + h
        nn = tl.arange(0, NB_PAD)
        inside = nn < NB
        score = tl.load(scores_ptr + row * NB + nn, mask=inside, other=float("-inf"))  # [NB_PAD]
        k = tl.minimum(tl.load(krow_ptr + row), WIDTH).to(tl.int32)
        bits = tl.where(score == 0.0, 0, score.to(tl.uint32, bitcast=True))  # -0.0 ties with +0.0 as in float order
        # order-preserving key: negatives (sign set) reversed, positives above them; -inf -> 0x007FFFFF
        key = tl.where((bits >> 31) != 0, ~bits, bits | 0x80000000)
        key = tl.where(inside, key, tl.zeros_like(key))  # padding lies below every real score
        # thr = the largest t with count(key >= t) >= k, i.e. the k-th largest key, decided from the top bit down
        thr = tl.zeros((), tl.uint32)
        one = tl.full((), 1, tl.uint32)
        for i in tl.static_range(32):
            cand = thr | (one << (31 - i))
            count = tl.sum((key >= cand).to(tl.int32), axis=0)
            thr = tl.where(count >= k, cand, thr)
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


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def select_top(scores: torch.Tensor, k_row: torch.Tensor, ids: torch.Tensor, vals: torch.Tensor) -> None:
    """The k_row[b, h] best blocks of each row of scores into ids/vals (see the module docstring)."""
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
        return
    nb_pad = _pow2(nb)
    _select_top_kernel[(B * hkv,)](scores, k_row, ids, vals, nb, width, NB_PAD=nb_pad, W_PAD=_pow2(width),
                                   num_warps=8 if nb_pad >= 4096 else 4)
