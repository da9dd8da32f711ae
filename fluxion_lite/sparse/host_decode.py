"""The sparse backend's decode layer on a machine without a GPU: every read from the host store, three native calls.

With no GPU the hybrid step's "device" is this same CPU: its streaming part ran torch attention over a second copy of
each sink and window, its scheduler split tasks between two paths that both ran here, and the ~30 torch and numpy
calls of a layer cost more than the attention (qwen2.5-coder-0.5b at 8K on 2 cores: ~0.75 ms of Python a layer
against ~0.15 ms of native work). Here a decode layer is:

  1. the new tokens' K/V into the host store (one native append; the reads below see them),
  2. select + attend (native.PreparedSelection.select_attend): every (sequence, KV group) is a row of one task
     table; a retrieval group selects its top-k blocks between its sink and window and attends them, a streaming
     group (k = 0) selects nothing,
  3. attend_spans: each row's sink and window (the ranges its selection excluded) merged into the same softmax,

and the task table of every layer is built once per step with numpy. Results are those of the hybrid step: the same
tokens are read (sink and window rounded to the group's block size for retrieval groups, exact for streaming
ones), except that the sink and window come from the host store's bf16 copy instead of the compute dtype.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from fluxion_lite.hostkv import native
from fluxion_lite.hostkv.layer import NativeDecoder, SparseDecodeStep
from fluxion_lite.sparse.attend import lse_merge
from fluxion_lite.sparse.step import DecodeStep, active_retrieval, retrieval_tasks

if TYPE_CHECKING:
    from fluxion_lite.plan.request_plan import RowPlan
    from fluxion_lite.sparse.backend import SparseAttention

STREAM_G = 16  # a streaming row's task granularity: a kept one (the native calls check it), never used to select


class HostDecode:
    """Decode layers of one SparseAttention on a CPU device (module docstring)."""

    def __init__(self, owner: SparseAttention) -> None:
        self.a = owner
        self._st: DecodeStep | None = None
        self._rp: RowPlan | None = None

    def layer(self, layer: int, q: torch.Tensor, st: DecodeStep, rp: RowPlan | None,
              k: torch.Tensor | None = None, v: torch.Tensor | None = None) -> torch.Tensor:
        """One decode layer's attention: q [B, Hq, D]; k, v [B, Hkv, D] the rows' new tokens, appended to the host
        store first (None: already there, as after a mixed step's append). Returns out [B, Hq, D] in q's dtype."""
        a = self.a
        if st is not self._st or rp is not self._rp:
            self._begin(st, rp)
        if k is not None and v is not None:
            self._k.copy_(k)
            self._v.copy_(v)
            self._append.run(a.store.view(layer))  # pages reserved in _begin: the page table does not change
        np.copyto(self._q, q.detach().numpy() if q.dtype == torch.float32 else q.float().numpy())
        view = a.store.view(layer)
        lo, hi = self._ends[layer], self._ends[layer + 1]
        pins = pin_counts = None
        if a.pins is not None and rp is None and a.pins.any(layer):
            pins, pin_counts = a.pins.table(layer, self._prep.tasks[lo:hi])
        selected, t_select, t_attend = self._prep.select_attend(view, lo, hi, scoring=a.topk_scoring, pins=pins,
                                                                pin_counts=pin_counts)
        t0 = time.perf_counter()
        streamed = self._prep.attend_spans(view, lo, hi)
        stats = a.state.stats
        stats.cpu_topk_s += t_select
        stats.cpu_attn_s += t_attend + time.perf_counter() - t0
        a.state.read_tokens += float(selected)
        if rp is not None:  # the static plan's streaming reads and groups were counted for the whole step
            a.state.read_tokens += float(streamed)
            self._count_row_plan_layer(layer, st, rp)
        out = torch.from_numpy(self._out)  # [B Hkv, r, D]
        if a.plan.background != "off":
            out = self._add_background(layer, st, rp, lo, hi, out)
        B = st.batch
        return out.view(B, -1, a.cfg.head_dim).to(q.dtype, copy=True)  # a copy: the buffer is the next layer's

    def native_step(self, decoder: NativeDecoder, x: torch.Tensor, rope_rows: torch.Tensor, rope_stride: int,
                    st: DecodeStep) -> None:
        """Every layer of a static-plan step in one native call (hostkv.layer.SparseDecodeStep): x fp32 [B, d] is
        the embedded tokens on entry and the last layer's output on return. The same calls as layer() and the
        model's per-layer calls, made from C (a layer's five round trips from Python were most of a step at 16
        threads); the counters as layer() keeps them."""
        a = self.a
        if st is not self._st or self._rp is not None:
            self._begin(st, None)
        prep = self._prep
        step = SparseDecodeStep(decoder, st.slots, prep.tasks, self._ends, prep.rows, prep.ids, prep.scores,
                                prep.counts, native.scoring_code(a.topk_scoring), a.scale)
        if a.pins is not None and any(a.pins.any(layer) for layer in range(a.cfg.n_layers)):
            layer_of_task = np.repeat(np.arange(a.cfg.n_layers), np.diff(self._ends))
            step.set_pins(*a.pins.table(layer_of_task, prep.tasks))
        views = [a.store.view(layer) for layer in range(a.cfg.n_layers)]
        selected, _, t_select, t_attend = step.run(x, rope_rows, rope_stride, views)
        stats = a.state.stats
        stats.cpu_topk_s += t_select
        stats.cpu_attn_s += t_attend
        a.state.read_tokens += float(selected)  # the streaming reads were counted for the whole step (_begin)

    def _begin(self, st: DecodeStep, rp: RowPlan | None) -> None:
        """The step's task table for every layer: row (layer, sequence, group), layer-major; retrieval groups with
        their k and g, the others k = 0; every row's excluded ranges are its streaming part."""
        a = self.a
        cfg, B = a.cfg, st.batch
        L, hkv, r, d = cfg.n_layers, cfg.n_kv_heads, a.r, cfg.head_dim
        if rp is None:
            gi, g, ret, bud = (x[:, None, :] for x in (a.state.gidx, a.state.g, a.state.retrieval, a.state.budget))
            long_only = a.state.long_rows()
        else:
            gi, g, ret, bud, long_only = rp.gidx, rp.g, rp.retrieval, rp.budget, rp.long_only
        _, li, bi, h, k_blocks, _, _ = retrieval_tasks(st, gi, g, ret, bud, long_only)
        shape = (L, B, hkv)
        gi_all = np.broadcast_to(gi, shape)
        rows_b = np.arange(B)[None, :, None]
        lo, hi = st.sink_hi[gi_all, rows_b], st.win_lo[gi_all, rows_b]  # [L, B, Hkv] each group's streaming part
        k_all, g_all = np.zeros(shape, np.int64), np.full(shape, STREAM_G, np.int64)
        k_all[li, bi, h] = k_blocks
        g_all[li, bi, h] = np.broadcast_to(g, shape)[li, bi, h]
        n = np.broadcast_to(st.n[None, :, None], shape)
        tasks = native.make_tasks(np.broadcast_to(st.slots[None, :, None], shape), rows_b, np.arange(hkv), g_all,
                                  k_all, exclude=[(0, lo), (hi, n)])  # [L B Hkv, 9]
        rows = np.tile(np.arange(B * hkv, dtype=np.int64), L)
        self._ends = [i * B * hkv for i in range(L + 1)]
        self._q = np.empty((B, cfg.n_heads, d), np.float32)
        self._out = np.empty((B * hkv, r, d), np.float32)
        self._lse = np.empty((B * hkv, r), np.float32)
        self._prep = native.PreparedSelection(a.store.view(0), self._q, tasks, a.scale, rows=rows, out=self._out,
                                              lse=self._lse)
        self._k = torch.empty(B, hkv, d, dtype=torch.bfloat16)  # the new tokens' K/V in the store's dtype
        self._v = torch.empty(B, hkv, d, dtype=torch.bfloat16)
        a.store.reserve_decode(st.slots)  # pages for this step's appends: views stay valid within the step
        self._append = native.PreparedAppend(a.store.view(0), st.slots.astype(np.int32), np.arange(B), self._k,
                                             self._v)
        if rp is None:
            a.state.count_step(st)  # streaming reads, context and groups of the whole step at once
        self._st, self._rp = st, rp

    def _count_row_plan_layer(self, layer: int, st: DecodeStep, rp: RowPlan) -> None:
        """Context and group counters for one layer of per-request plans (the static plan counts a step at once)."""
        a = self.a
        B, hkv = st.batch, a.cfg.n_kv_heads
        long_only = None if rp.long_only is None else rp.long_only[layer][None]
        active = active_retrieval(st, rp.retrieval[layer][None], long_only)
        a.state.context_tokens += float(st.n.sum()) * hkv
        a.state.stream_groups += float(B * hkv - active.sum())
        a.state.all_groups += float(B * hkv)

    def _add_background(self, layer: int, st: DecodeStep, rp: RowPlan | None, lo: int, hi: int,
                        out: torch.Tensor) -> torch.Tensor:
        """The unread-background term merged into the layer's result (plan.background): for retrieval rows over
        what their selection left unread, with "all" also for the streaming rows over their gap."""
        a, prep = self.a, self._prep
        tasks = prep.tasks[lo:hi]
        retrieving = np.flatnonzero(tasks[:, 4] > 0)
        gi = a.state.gidx[layer][None, :] if rp is None else rp.gidx[layer]
        got = a.background_rows(layer, st, torch.from_numpy(self._q), np.ascontiguousarray(tasks[retrieving]),
                                np.ascontiguousarray(prep.ids[lo:hi][retrieving]), prep.counts[lo:hi][retrieving],
                                retrieving.astype(np.int64), gi)
        if got is None:
            return out
        rows, o_b, lse_b = got
        result = out.clone()
        # the rows' own part is never empty (the window holds at least the new token): its lse is finite
        result[rows] = lse_merge(result[rows], torch.from_numpy(self._lse[rows]), torch.from_numpy(o_b),
                                 torch.from_numpy(lse_b))
        return result
