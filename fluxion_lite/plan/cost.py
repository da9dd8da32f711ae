"""What a plan costs: bytes touched per decode step and KV group (K/V of the sink, the window and the selected blocks,
plus the block summaries that top-k scans), and a plan's predicted KV read at a context length. Small blocks select
precisely but scan more summaries; large blocks scan little but read more KV."""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from fluxion_lite.plan.space import Config, budget_tokens

if TYPE_CHECKING:
    from fluxion_lite.plan.sparse_plan import SparsePlan


def summary_bytes(n: int, g: int, head_dim: int) -> float:
    """Bytes of one KV head's block summaries at context n: min and max [n/g, 2, D], 16-bit like K (native/fluxion.h).
    Plans in models/ were selected when summaries were fp32 (twice this); a re-selection sees cheaper small blocks."""
    return (n / g) * 2 * head_dim * 2

def bytes_per_step(cfg: Config, n: int, sink: int, window: int, head_dim: int, summary_weight: float = 1.0) -> float:
    """summary_weight: what a byte of block summaries costs next to a byte of K/V. 1 counts bytes touched; below 1
    favours small blocks: summaries are scanned sequentially, selected blocks are random reads, and the issue's
    "KV read" metric counts K/V only."""
    kv_per_token = 2 * head_dim * 2  # K and V in bf16
    near = near_tokens(cfg, n, sink, window)
    if cfg.streaming:
        return near * kv_per_token
    summaries = summary_bytes(n, cfg.g, head_dim)
    read = min(float(n), near + budget_tokens(cfg.budget, n, cfg.g))
    return read * kv_per_token + summary_weight * summaries

def near_tokens(cfg: Config, n: int, sink: int, window: int) -> float:
    """Tokens the streaming part of a group reads at context n. A streaming group reads the exact sink and window;
    a retrieval group's are block-aligned to its g (sparse_step.build_step: the sink rounded up to a block, the
    window reaching back to a block start), so that no block is half streamed. The window's extra is
    (n - window) mod g, (g - 1) / 2 on average over the steps of a decode: counted as that mean, so the cost does
    not jump with n. Without it, a 128-token-block plan at 4K predicted 9.5% read and measured 11.9%."""
    if cfg.streaming:
        return float(min(n, sink + window))
    sink_hi = min(n, -(-sink // cfg.g) * cfg.g)
    return sink_hi + max(0.0, min(n - sink_hi, window + (cfg.g - 1) / 2))

def plan_bytes_fraction(plan: SparsePlan, n: int, head_dim: int) -> tuple[float, float]:
    """(KV read fraction, bytes-touched fraction incl. summaries) of a plan at context n, averaged over groups; the
    budgets as scaled at n by the plan's short-context factor (SparsePlan.budget_factor; long_factor for long-only
    groups), at most the whole context."""
    full = n * 2 * head_dim * 2
    kv, touched = 0.0, 0.0
    flat = [gp for row in plan.groups for gp in row]
    factor, long_factor = float(plan.budget_factor(n)), float(plan.long_factor(n))
    for gp in flat:
        # a long-only group streams while its factor is 0 (short contexts): through its own g's block-aligned sink
        # and window (its g's mask row, SparseAttention._gidx), a retrieval configuration with no blocks and no
        # summaries scanned; with the plan's long_exact_stream, through the exact ones, as a streaming group
        long_streams = gp.long_only and long_factor == 0.0
        scans = not gp.streaming and not long_streams
        streams_exactly = gp.streaming or (long_streams and plan.long_exact_stream)
        c = Config(streams_exactly, gp.g, min(1.0, gp.budget * (long_factor if gp.long_only else factor)))
        b = bytes_per_step(c, n, plan.sink, plan.window, head_dim, summary_weight=float(scans))
        meta = summary_bytes(n, gp.g, head_dim) if scans else 0.0
        kv += (b - meta) / full
        touched += (b + background_bytes(plan.background, scans, gp.g, n, head_dim)) / full
    return kv / len(flat), touched / len(flat)

def background_bytes(background: str, scans: bool, g: int, n: int, head_dim: int) -> float:
    """Bytes per step and KV head that the unread-background term (SparsePlan.background) adds to a group at context
    n: the value sums (D fp32 per 128 tokens) and, unless its top-k scans them already (g = 16), the 16-token
    summaries; for retrieval groups that scan (scans) with "retrieval", for every group with "all"."""
    if background == "off" or (background == "retrieval" and not scans):
        return 0.0
    return n / 128 * head_dim * 4 + (0.0 if scans and g == 16 else summary_bytes(n, 16, head_dim))

def scale_for_read(plan: SparsePlan, n: int, target: float) -> float:
    """The largest budget factor at context n under which the plan's predicted KV read there (plan_bytes_fraction,
    sink and window included) stays within `target`: a knot (n, scale) for its budget_curve. The read moves in
    whole blocks, so it can end below the target by up to a block per group. ValueError when no factor reaches it
    (the sink and window alone read more, or every budget at 1 reads less)."""
    def read(scale: float) -> float:
        return plan_bytes_fraction(replace(plan, short_scale=1.0, budget_curve=((n, scale),)), n, head_dim=64)[0]

    lo, hi = 1e-4, 1e4  # the read is non-decreasing in the scale (budgets capped at the whole context)
    if not read(lo) <= target <= read(hi):
        raise ValueError(f"no budget factor gives a read of {target:.2%} at {n} tokens "
                         f"(the plan reads {read(lo):.2%} to {read(hi):.2%} there)")
    for _ in range(60):  # bisection in log space: ~1e-13 relative at the end
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if read(mid) <= target else (lo, mid)
    return lo
