"""The unread-background term on the compute device, for the captured device-selection step (device_graph.py).

The same term as the native one (fluxion.h, "unread background"; native.background), from the device mirrors of
the host store's metadata (device_select.DeviceSummaries with value_sums): for each (row, group), every 16-token
block of its gap between sink and window that its selection did not take is background. Per 128-token block B and
query head j:

    m_j(B)  = log sum over B's background 16-token blocks b of 16 exp(scale q_j . (min_b + max_b) / 2)
    vbar(B) = B's value sum / B's tokens (all of them, read ones included)
    out_j   = sum_B exp(m_j(B) - lse_j) vbar(B),   lse_j = log sum_B exp(m_j(B))

and (out, lse) merge with the read part by log-sum-exp. Every op is a fixed-shape torch op with no host sync, so it
is captured with the rest of the step. A gap block is always whole (the window's tokens lie after it), so each
background block counts 16 tokens, as the native term counts them there.

Where the device and the native term differ: the device's value sums include the step's newest token, while the
host store trails it by a step or two; only a 128-token block that holds both background blocks and those newest
tokens sees it (its mean value over one or two tokens more).
"""
from __future__ import annotations

import math

import torch

from fluxion_lite.sparse.device.summaries import VALUE_SUM_TOKENS

BACKGROUND_G = 16  # the term's sub-block: its summaries are the g = 16 ones
SUBS = VALUE_SUM_TOKENS // BACKGROUND_G  # 16-token blocks per 128-token block
LOG_SUB = math.log(BACKGROUND_G)  # a whole sub-block's token count, as a log-weight


def background_term(q: torch.Tensor, summaries: torch.Tensor, value_sums: torch.Tensor, slots: torch.Tensor,
                    n: torch.Tensor, bounds: torch.Tensor, selected: torch.Tensor | None, n_blocks: int,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, Hkv, r, D]; summaries [slots, Hkv, >= NB, 2, D] (g = 16 min / max); value_sums [slots, Hkv,
    >= NB / 8, D] fp32; slots, n [B] int64 (store slots, tokens including the new one); bounds int64 [2, B, Hkv]:
    each group's background candidates are the 16-token blocks [lo, hi) (empty for a group without a term);
    selected bool [B, Hkv, NB] (blocks the step reads) or None; n_blocks = NB, a multiple of 8.
    Returns out fp32 [B, Hkv, r, D] and lse fp32 [B, Hkv, r]: out 0 and lse -inf where a group has no
    background block."""
    B, hkv, r, d = q.shape
    if n_blocks % SUBS:
        raise ValueError(f"background_term: n_blocks={n_blocks} must be a multiple of {SUBS}")
    nbig = n_blocks // SUBS
    s = summaries[:, :, :n_blocks].index_select(0, slots).float()  # [B, Hkv, NB, 2, D]
    mid = s.sum(3)  # [B, Hkv, NB, D]: min + max (the 1/2 goes with q)
    logits = torch.einsum("bhrd,bhnd->bhrn", q.float() * (0.5 * scale), mid) + LOG_SUB  # [B, Hkv, r, NB]
    blk = torch.arange(n_blocks, device=q.device)
    background = (blk >= bounds[0][..., None]) & (blk < bounds[1][..., None])  # [B, Hkv, NB]
    if selected is not None:
        background &= ~selected
    logits = logits.masked_fill(~background[:, :, None, :], float("-inf"))
    mass = torch.logsumexp(logits.view(B, hkv, r, nbig, SUBS), dim=-1)  # [B, Hkv, r, NB / 8]: m_j(B)
    lse = torch.logsumexp(mass, dim=-1)  # [B, Hkv, r]
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    w = torch.exp(mass - safe[..., None])  # [B, Hkv, r, NB / 8]; 0 where B has no background block
    big = torch.arange(nbig, device=q.device) * VALUE_SUM_TOKENS
    tokens = (n[:, None] - big[None, :]).clamp(1, VALUE_SUM_TOKENS).float()  # [B, NB / 8]
    vbar = value_sums[:, :, :nbig].index_select(0, slots) / tokens[:, None, :, None]  # [B, Hkv, NB / 8, D]
    out = torch.einsum("bhrn,bhnd->bhrd", w, vbar)  # 0 for a group without a term (all weights 0)
    return out, lse


def selected_blocks(ids: torch.Tensor, valid: torch.Tensor, n_blocks: int) -> torch.Tensor:
    """Which blocks a selection reads: ids int64 [B, Hkv, W] (any order, invalid entries anywhere), valid bool
    [B, Hkv, W] -> bool [B, Hkv, NB]. Duplicate ids (invalid entries often share one) add, never overwrite."""
    hits = torch.zeros(ids.shape[0], ids.shape[1], n_blocks, dtype=torch.float32, device=ids.device)
    return hits.scatter_add_(2, ids.clamp(0, n_blocks - 1), valid.float()) > 0


def merge_into_partial(o: torch.Tensor, m: torch.Tensor, l: torch.Tensor, term_o: torch.Tensor,
                       term_lse: torch.Tensor) -> None:
    """Fold a normalised term (term_o [..., D], term_lse [...]) into an unnormalised partial in place (o [..., D]
    not divided by l, running max m and sum l [...], as device_kernels' streaming partials): afterwards the partial
    stands for both. Either side may be empty (m or term_lse -inf, l 0)."""
    new_m = torch.maximum(m, term_lse)
    safe = torch.where(torch.isfinite(new_m), new_m, torch.zeros_like(new_m))
    a, b = torch.exp(m - safe), torch.exp(term_lse - safe)  # 0 for an empty side
    o.mul_(a[..., None]).add_(term_o * b[..., None])
    l.mul_(a).add_(b)
    m.copy_(new_m)


def merge_normalised(o: torch.Tensor, lse: torch.Tensor, term_o: torch.Tensor, term_lse: torch.Tensor) -> None:
    """Fold a normalised term into a normalised partial in place (o [..., D], lse [...]); either may be empty
    (lse -inf: o is then ignored and replaced)."""
    new = torch.logaddexp(lse, term_lse)
    safe = torch.where(torch.isfinite(new), new, torch.zeros_like(new))
    a, b = torch.exp(lse - safe), torch.exp(term_lse - safe)
    o.mul_(a[..., None]).add_(term_o * b[..., None])
    lse.copy_(new)
