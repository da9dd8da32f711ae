"""Per decode step bookkeeping of the sparse backend, computed once per step on the host (not once per layer).

Everything a layer needs that depends only on the step (which sequences, their lengths) and on a group's block size:
the streaming coverage per granularity, the additive mask of the on-device sink + ring buffer, and index tensors.
Built with numpy and shipped in two small copies, so the per-layer path has no host<->device syncs of its own.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from fluxion_lite.hostkv import native
from fluxion_lite.plan.sparse_plan import DEFAULT_SHORT_TOKENS, long_factor

GVALS = (1, 16, 32, 64, 128)  # 1 = a streaming group (exact sink / window); else the group's block size
# With a plan's long_exact_stream, long-only groups take rows past GVALS (one per block size, g's row + this): the
# exact sink and window while their context is short (they stream there), their g's rows once they retrieve
LONG_ROW_OFFSET = len(GVALS) - 1


def bias_rows(long_exact: bool) -> int:
    """Rows of a step's per-g arrays (DecodeStep.sink_hi, win_lo, stream_read, bias)."""
    return len(GVALS) + (LONG_ROW_OFFSET if long_exact else 0)


def group_rows(g: np.ndarray, long_only: np.ndarray | None = None, long_exact: bool = False) -> np.ndarray:
    """Row of a step's per-g arrays for each group of block size g (1: streaming; any shape); with long_exact, a
    long-only group's own row past GVALS (build_step(long_exact=True) adds them)."""
    rows = np.searchsorted(np.array(GVALS), g)
    if long_exact and long_only is not None:
        rows = np.where(long_only, rows + LONG_ROW_OFFSET, rows)
    return rows


@dataclass
class DecodeStep:
    key: tuple[tuple[int, int], ...]  # (seq_id, position) per row: identifies the step
    slots: np.ndarray  # int64 [B] host-store slots (also the row of the on-device sink/ring slab)
    n: np.ndarray  # int64 [B] tokens incl. the new one
    sink_hi: np.ndarray  # int64 [G, B] streaming covers [0, sink_hi) ... (G = bias_rows(long_exact))
    win_lo: np.ndarray  # int64 [G, B] ... and [win_lo, n): block-aligned to the group's g
    stream_read: np.ndarray  # float64 [G, B] tokens the streaming part reads
    bias: torch.Tensor  # fp32 [G, B, Ltot] on the device: 0 where a buffer slot is attended, -inf elsewhere
    slots_dev: torch.Tensor  # int64 [B]
    pos_dev: torch.Tensor  # int64 [B] position of the new token
    ring_dev: torch.Tensor  # int64 [B] its slot in the ring (sink_cap + pos % ring_cap)
    idx: np.ndarray  # int64 [3, B] the host copy of slots, positions and ring slots (the three above)
    first_slot: int | None  # slots are first_slot .. first_slot + B - 1: the slab is sliced, not gathered
    sink_rows: list[int]  # rows whose new token also belongs in the sink slots (position < sink_cap)
    # float64 [B]: each row's retrieval budgets x this at its context n (SparsePlan.budget_factor); None = x1
    budget_scale: np.ndarray | None = None
    # float64 [B]: each row's long-only budgets x this (SparsePlan.long_factor; 0 = those groups stream); None = the
    # plan has no long-only groups
    long_scale: np.ndarray | None = None

    @property
    def batch(self) -> int:
        return len(self.slots)


def build_step(key: tuple[tuple[int, int], ...], slots: list[int], sink: int, window: int, sink_cap: int,
               ring_cap: int, device: torch.device,
               budget_factor: Callable[[np.ndarray], np.ndarray] | None = None,
               short_tokens: int = DEFAULT_SHORT_TOKENS, long_only: bool = False,
               long_exact: bool = False) -> DecodeStep:
    """budget_factor: the plan's budget multiplier at a context n (SparsePlan.budget_factor; None = x1
    everywhere); short_tokens: where the long-only groups' ramp starts (SparsePlan.long_factor).
    long_only: the plan has long-only groups (their factor, SparsePlan.long_factor, per row); long_exact: they
    stream through the exact sink and window (SparsePlan.long_exact_stream; rows past GVALS, group_rows)."""
    pos = np.array([p for _, p in key], np.int64)  # [B]
    n = pos + 1
    slots_a = np.array(slots, np.int64)
    long_scale = long_factor(n, short_tokens) if long_only else None
    gv = np.array(GVALS, np.int64)[:, None]  # [len(GVALS), 1]
    sink_hi = np.minimum(-(-sink // gv) * gv, n[None, :])  # [len(GVALS), B]
    win_lo = np.maximum((np.maximum(n[None, :] - window, 0) // gv) * gv, sink_hi)  # [len(GVALS), B]
    if long_only and long_exact:  # + one row per block size: the exact (g = 1) bounds in rows still streaming
        streams = (long_scale == 0.0)[None, :]  # [1, B]
        sink_hi = np.concatenate([sink_hi, np.where(streams, sink_hi[:1], sink_hi[1:])])  # [G, B]
        win_lo = np.concatenate([win_lo, np.where(streams, win_lo[:1], win_lo[1:])])
    # buffer slots: sink j holds position j; ring slot j holds the latest position p == j (mod ring_cap)
    j = np.arange(ring_cap)
    ring_pos = pos[:, None] - ((pos[:, None] - j[None, :]) % ring_cap)  # [B, ring_cap]
    sink_pos = np.broadcast_to(np.arange(sink_cap), (len(pos), sink_cap))
    valid = np.concatenate([
        sink_pos[None] < sink_hi[:, :, None],  # [G, B, sink_cap]
        (ring_pos[None] >= win_lo[:, :, None]) & (ring_pos[None] >= 0),  # [G, B, ring_cap]
    ], axis=2)
    bias = np.where(valid, np.float32(0), np.float32("-inf"))  # [G, B, Ltot]
    idx = np.stack([slots_a, pos, sink_cap + pos % ring_cap])  # [3, B]
    pin = device.type == "cuda"
    bias_t, idx_t = torch.from_numpy(bias), torch.from_numpy(idx)
    if pin:
        bias_t, idx_t = bias_t.pin_memory(), idx_t.pin_memory()
    bias_d, idx_d = bias_t.to(device, non_blocking=True), idx_t.to(device, non_blocking=True)
    contiguous = len(slots) > 0 and bool((np.diff(slots_a) == 1).all())
    return DecodeStep(key, slots_a, n, sink_hi, win_lo, valid.sum(-1).astype(np.float64), bias_d, idx_d[0],
                      idx_d[1], idx_d[2], idx, int(slots_a[0]) if contiguous else None,
                      [b for b in range(len(pos)) if pos[b] < sink_cap],
                      None if budget_factor is None else np.asarray(budget_factor(n), np.float64),
                      long_scale)


def active_retrieval(st: DecodeStep, retrieval: np.ndarray, long_only: np.ndarray | None) -> np.ndarray:
    """Which groups retrieve at this step, [L', B, Hkv] bool: the retrieval ones, less the long-only ones of rows whose
    context is still short (st.long_scale 0: they stream there)."""
    if long_only is None or st.long_scale is None:
        return np.broadcast_to(retrieval, retrieval.shape[:1] + (st.batch,) + retrieval.shape[2:])
    return retrieval & ~(long_only & (st.long_scale == 0.0)[None, :, None])


def retrieval_tasks(st: DecodeStep, gi: np.ndarray, g: np.ndarray, retrieval: np.ndarray, budget: np.ndarray,
                    long_only: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
    """The retrieval tasks of a step for plan arrays shaped [L', B or 1, Hkv] (row of GVALS, block size, retrieval
    flag, budget, long-only flag per layer, sequence row and group): one task per group retrieving at this step
    (active_retrieval) whose gap between the sink and the window holds at least one block, layer-major; a task's k is
    ceil(budget x n x st.budget_scale / g), st.long_scale for a long-only group. Returns the native task table int32
    [T, 9] and, per task, the layer index into the L' layers given, sequence row, group, k (blocks), and the gap
    [lo, hi)."""
    rows = np.arange(st.batch)[None, :, None]  # [1, B, 1]
    lo, hi = st.sink_hi[gi, rows], st.win_lo[gi, rows]  # [L', B, Hkv]
    g_all = np.broadcast_to(g, lo.shape)
    wanted = active_retrieval(st, retrieval, long_only) & (hi - lo >= g_all)
    li, bi, h = np.nonzero(wanted)
    gh = g_all[li, bi, h]
    tokens = np.broadcast_to(budget, lo.shape)[li, bi, h] * st.n[bi]
    if st.budget_scale is not None or st.long_scale is not None:
        factor = np.ones(len(bi)) if st.budget_scale is None else st.budget_scale[bi]
        if st.long_scale is not None and long_only is not None:
            factor = np.where(np.broadcast_to(long_only, lo.shape)[li, bi, h], st.long_scale[bi], factor)
        tokens = tokens * factor
    k_blocks = np.ceil(tokens / gh).astype(np.int64)
    lo_t, hi_t = lo[li, bi, h], hi[li, bi, h]
    tasks = native.make_tasks(st.slots[bi], bi, h, gh, k_blocks, exclude=[(0, lo_t), (hi_t, st.n[bi])])
    return tasks, li, bi, h, k_blocks, lo_t, hi_t


BACKGROUND_G = 16  # the unread-background term's tasks without a selection scan the 16-token summaries


def background_tasks(st: DecodeStep, gi: np.ndarray, task_rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The unread-background term's tasks for the groups of one layer that have no retrieval task this step
    (streaming groups, long-only groups still streaming, gaps shorter than a block): one per (sequence row, group)
    whose result row (row * Hkv + group) is not in task_rows, at g = 16 with an empty selection, excluding what that
    group's streaming part reads (its row of sink_hi / win_lo). So the term covers the whole 16-token blocks between
    them: never a token the streaming part reads (an exact sink or window leaves up to 15 tokens at each edge in
    neither part). gi: [1 or B, Hkv] the layer's rows of the per-g arrays (group_rows). Returns the native task table
    int32 [T, 9] and each task's result row (int64 [T])."""
    b, hkv = st.batch, gi.shape[-1]
    rest = np.setdiff1d(np.arange(b * hkv), task_rows)
    bi, h = rest // hkv, rest % hkv
    rows = np.broadcast_to(gi, (b, hkv))[bi, h]
    lo, hi = st.sink_hi[rows, bi], st.win_lo[rows, bi]
    tasks = native.make_tasks(st.slots[bi], bi, h, BACKGROUND_G, 0, exclude=[(0, lo), (hi, st.n[bi])])
    return tasks, rest
