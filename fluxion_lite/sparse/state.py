"""The state that every form of the sparse decode step shares: eager (SparseAttention.attend), host-captured
(host_capture.GraphedDecode) and device-captured (device/capture.DeviceGraphedDecode).

One object, owned by the backend and read by the captured forms through `backend.state`: the static plan as arrays,
the device slab of sink + recent window, where each sequence lives and how long it is, the host appends still
queued per layer, the counters behind stats(), and the step's bookkeeping (DecodeStep, built once per step).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from fluxion_lite.model.attention import SeqChunk
from fluxion_lite.model.config import ModelConfig
from fluxion_lite.plan.space import GRANULARITIES
from fluxion_lite.plan.sparse_plan import SparsePlan
from fluxion_lite.sparse.hybrid import StepStats
from fluxion_lite.sparse.step import (DecodeStep, active_retrieval, bias_rows, build_step, group_rows,
                                      retrieval_tasks)

MAX_G = max(GRANULARITIES)


def _align_up(x: int, a: int) -> int:
    return -(-x // a) * a


class SparseState:
    """Shared decode state of one sparse backend (see the module docstring). Attributes are public on purpose: the
    three step forms read and update them; nothing else should."""

    def __init__(self, cfg: ModelConfig, plan: SparsePlan, dtype: torch.dtype, device: torch.device):
        self.cfg, self.plan, self.device = cfg, plan, device
        self.sink_cap = _align_up(max(plan.sink, 1), MAX_G)  # sink slots (rounded up to the largest block)
        self.ring_cap = plan.window + MAX_G  # ring slots (the window plus a block's spare)
        # [L, slot_cap, 2 (k, v), Hkv, sink_cap + ring_cap, D]: sink tokens at 0..sink_cap-1, then a ring where slot j
        # holds the latest position p == j (mod ring_cap). One slab, so a step reads a slice or one gather per layer.
        self.near = torch.zeros(cfg.n_layers, 0, 2, cfg.n_kv_heads, self.sink_cap + self.ring_cap, cfg.head_dim,
                                dtype=dtype, device=device)
        # the static plan as arrays [L, Hkv]
        self.retrieval, self.g, self.budget, long_only = plan.arrays()
        self.long_only = long_only if long_only.any() else None  # None: no long-only groups (the usual plan)
        # long-only groups stream through the exact sink and window (rows of their own) if the plan says so
        self.long_exact = plan.exact_long_rows
        self.bias_rows = bias_rows(self.long_exact)  # rows of a step's mask (DecodeStep.bias)
        self.gidx = group_rows(self.g, self.long_only, self.long_exact)  # [L, Hkv] row of DecodeStep's per-g arrays
        self.gidx_dev = torch.from_numpy(self.gidx).to(device)
        self.slot: dict[int, int] = {}  # sequence -> host-store slot (also its row of the device slab)
        self.length: dict[int, int] = {}  # sequence -> tokens whose K/V are stored
        self.prefilling: set[int] = set()  # sequences still in prefill (their dense scratch KV is alive)
        self.prompt_tokens: dict[int, int] = {}  # seq -> its prompt's length where allocate() was told it
        # per layer: a decode step's new K/V queued for the host store, (slots, rows, event) or None
        self.pending: list[tuple[list[int], int, torch.cuda.Event | None] | None] = [None] * cfg.n_layers
        self.step: DecodeStep | None = None  # the last step's bookkeeping, reused while its rows are the same
        self.stats = StepStats()  # the executor holds this same object
        # sums over decode (step, layer, sequence, group): tokens read, context tokens, streaming and all groups
        self.read_tokens = self.context_tokens = 0.0
        self.stream_groups = self.all_groups = 0.0

    # ---- the device slab -----------------------------------------------------------------------------------------
    def grow_near(self, n: int) -> None:
        """Room for slot n - 1 in the device slab (doubling; rows kept)."""
        old = self.near
        shape = list(old.shape)
        shape[1] = max(n, 2 * shape[1])
        self.near = torch.zeros(shape, dtype=old.dtype, device=old.device)
        self.near[:, : old.shape[1]] = old

    # ---- the step ------------------------------------------------------------------------------------------------
    def step_for(self, chunks: Sequence[SeqChunk]) -> DecodeStep:
        """The step's bookkeeping for these rows (one new token each), built once per step."""
        key = tuple((c.seq_id, c.start) for c in chunks)
        if self.step is None or self.step.key != key:
            plan = self.plan
            self.step = build_step(key, [self.slot[c.seq_id] for c in chunks], plan.sink, plan.window,
                                   self.sink_cap, self.ring_cap, self.device,
                                   plan.budget_factor if plan.scales_budgets else None,
                                   plan.short_tokens, self.long_only is not None, self.long_exact)
        return self.step

    def long_rows(self) -> np.ndarray | None:
        """The static plan's long-only flags as [L, 1, Hkv], or None when it has none."""
        return None if self.long_only is None else self.long_only[:, None, :]

    def plan_tasks(self, st: DecodeStep) -> tuple[np.ndarray, np.ndarray, list[int], np.ndarray]:
        """Every layer's retrieval tasks of a step in one pass over [L, B, Hkv] (step.retrieval_tasks on the static
        plan's arrays); no side effects, so a step may be planned ahead (the device step's look-ahead).
        Returns the task table int32 [T, 9] (layer-major), each task's result row (sequence row * Hkv + group,
        int64 [T], ascending within a layer), the layer boundaries (layer l's tasks are rows ends[l] .. ends[l + 1])
        and each task's selected tokens as top-k will select them (int64 [T]): min(k, eligible blocks) blocks of g
        tokens, the eligible blocks being those wholly inside the g-aligned gap [lo, hi) between sink and window
        (at host(l) the store holds n - 1 >= hi tokens of the layer, so no block past hi exists to be excluded)."""
        n_layers, hkv = self.cfg.n_layers, self.cfg.n_kv_heads
        gi = self.gidx[:, None, :]  # [L, 1, Hkv]
        tasks, li, bi, h, k_blocks, lo, hi = retrieval_tasks(st, gi, self.g[:, None, :], self.retrieval[:, None, :],
                                                             self.budget[:, None, :], self.long_rows())
        ends = np.searchsorted(li, np.arange(n_layers + 1))  # li is layer-major
        g = tasks[:, 3].astype(np.int64)
        selected = np.minimum(k_blocks, (hi - lo) // g) * g
        return tasks, bi * hkv + h, ends.tolist(), selected

    def step_counts(self, st: DecodeStep) -> tuple[float, float, float, float]:
        """The step's streaming reads and context (tokens), streaming and all groups: what count_step adds."""
        n_layers, hkv, B = self.cfg.n_layers, self.cfg.n_kv_heads, st.batch
        gi = self.gidx[:, None, :]  # [L, 1, Hkv]
        retrieving = float(active_retrieval(st, self.retrieval[:, None, :], self.long_rows()).sum())
        return (float(st.stream_read[gi, np.arange(B)[None, :, None]].sum()), float(st.n.sum()) * hkv * n_layers,
                float(n_layers * B * hkv) - retrieving, float(n_layers * B * hkv))

    def add_counts(self, counts: tuple[float, float, float, float]) -> None:
        """step_counts' values into the counters behind stats()."""
        self.read_tokens += counts[0]
        self.context_tokens += counts[1]
        self.stream_groups += counts[2]
        self.all_groups += counts[3]

    def count_step(self, st: DecodeStep) -> None:
        """A whole step's streaming reads and context, streaming and all groups into the counters (the eager path
        adds the same layer by layer)."""
        self.add_counts(self.step_counts(st))

    def reset_counts(self) -> None:
        self.read_tokens = self.context_tokens = 0.0
        self.stream_groups = self.all_groups = 0.0
        self.stats.__init__()  # type: ignore[misc]  # in place: the executor holds the same object
