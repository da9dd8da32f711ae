"""The sparse backend's decode step in CUDA-graph form: device work captured, host work between replays.

Eager, one hybrid decode layer costs ~60 kernel launches and ~100 torch calls on the host, ~2-3 ms on the H200 host
for ~0.3 ms of device work. Here a layer's device work is split into two pieces with static shapes and addresses,
which decode_graphs.py captures next to the dense layer parts:

  prologue(layer)   write the new K/V into the device sink/ring slab; stage q, k, v side by side in one device
                    buffer; streaming attention over sink + window -> (out_s, lse_s)
  host(layer)       (eager, between replays) one D2H of the staged q, k, v (pinned); append the previous layer's
                    new K/V to the host store while the device runs this layer; wait for the D2H; native top-k;
                    the scheduler splits the tasks; CPU tasks run native sparse attention and their results go into
                    a pinned full-size buffer (lse = -inf for rows without a CPU task); GPU tasks run through the
                    zero-copy feeder (eager device work) into full-size device buffers; one H2D of the CPU results.
                    At batch 1 the device waits for all of this, so its fixed cost is kept down: the native calls'
                    arguments are checked once per step (native.PreparedSelection / PreparedAppend), pages for the
                    step's appends are reserved in begin(), and an all-CPU split (the usual case at small batches)
                    skips the scheduler's queue and writes the results in place.
  epilogue(layer)   three-way LSE merge (streaming, CPU, GPU) -> o [B, Hq, D]; reset
                    the GPU buffers' lse to -inf for the next layer

Replays and host work alternate on one stream, so each buffer is written only after its previous reader finished:
host(layer) starts by waiting for an event recorded after the replay holding prologue(layer), which comes after
epilogue(layer - 1) read the CPU results; the feeder's eager kernels are queued after that replay too.

Used for pure decode steps of the static plan with CPU selection, once every sequence is past the sink (then no
token goes to a sink slot). Anything else (prefill chunks, per-request plans, device selection) runs eagerly.
"""
from __future__ import annotations

import logging
import time
import weakref
from typing import TYPE_CHECKING

import numpy as np
import torch

from fluxion_lite.hostkv import native
from fluxion_lite.model.attention import CapturedDecode, SeqChunk
from fluxion_lite.sparse.attend import biased_attention
from fluxion_lite.sparse.cost_model import Placement
from fluxion_lite.sparse.hybrid import ResultRows
from fluxion_lite.sparse.step import DecodeStep

if TYPE_CHECKING:
    from fluxion_lite.sparse.backend import SparseAttention

LOG = logging.getLogger("fluxion_lite.sparse.host_capture")
# Idle spin of the native pool's workers during a GPU step: longer than a device layer (0.2-1 ms) between two host
# calls, so that no call finds them asleep (bench/pool_wake.py); restored to the default at the step's end.
GPU_STEP_SPIN_US = 2000.0


def expected_sizes(selected: np.ndarray, ends: list[int]) -> list[tuple[int, int]]:
    """Per layer (selected tokens of all its tasks, of its smallest non-empty task; 0, 0 without tasks) from each
    task's selected tokens [T] and the layer boundaries (SparseState.plan_tasks)."""
    starts, stops = np.array(ends[:-1]), np.array(ends[1:])
    busy = stops > starts  # layers with tasks: reduceat over their starts covers exactly their rows
    totals, smallest = np.zeros(len(starts), np.int64), np.zeros(len(starts), np.int64)
    if len(selected):
        totals[busy] = np.add.reduceat(selected, starts[busy])
        smallest[busy] = np.minimum.reduceat(selected, starts[busy])
    sizes = list(zip(totals.tolist(), smallest.tolist()))
    for layer in np.flatnonzero(busy & (smallest == 0)).tolist():  # an empty task (k = 0): the smallest non-empty
        part = selected[ends[layer] : ends[layer + 1]]
        positive = part[part > 0]
        sizes[layer] = (sizes[layer][0], int(positive.min()) if len(positive) else 0)
    return sizes


def stream_layer(a: SparseAttention, layer: int, slots: torch.Tensor, ring: torch.Tensor, bias: torch.Tensor,
                 q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The captured streaming part of a graphed step's layer (this module's and device_graph.py's): the new token's
    K/V into the device sink/ring slab, attention over sink + window. q [B, Hq, D], k, v [B, Hkv, D]; slots, ring
    [B] (device slab rows, the token's ring slot); bias fp32 [G, B, Ltot] (DecodeStep.bias). Returns
    qg [B, Hkv, r, D] (a view of q), out_s [B, Hkv, r, D] and lse_s [B, Hkv, r]."""
    B, hkv, r, d = q.shape[0], a.cfg.n_kv_heads, a.r, a.cfg.head_dim
    near = a.state.near[layer]  # [slots, 2, Hkv, Ltot, D]
    near[slots, :, :, ring] = torch.stack([k, v], dim=1).to(a.dtype)  # [B, 2, Hkv, D]
    kv = near[slots]  # [B, 2, Hkv, Ltot, D]
    qg = q.view(B, hkv, r, d)
    group_bias = bias[a.state.gidx_dev[layer]].transpose(0, 1)[:, :, None, :]  # [Hkv, B, Ltot] -> [B, Hkv, 1, Ltot]
    out_s, lse_s = biased_attention(qg, kv[:, 0], kv[:, 1], group_bias, a.scale)
    return qg, out_s, lse_s


class StaticStep:
    """Per batch size: the step's index tensors and the result buffers the graphs read and write at fixed addresses."""

    def __init__(self, owner: SparseAttention, batch: int):
        cfg, dev = owner.cfg, owner.device
        cuda = dev.type == "cuda"
        hkv, r, d = cfg.n_kv_heads, owner.r, cfg.head_dim
        n_bh = batch * hkv
        ltot = owner.state.sink_cap + owner.state.ring_cap
        self.batch = batch
        self.slots = torch.zeros(batch, dtype=torch.long, device=dev)  # [B] rows of the device slab
        self.ring = torch.zeros(batch, dtype=torch.long, device=dev)  # [B] the new token's ring slot
        self.bias = torch.zeros(owner.state.bias_rows, batch, ltot, dtype=torch.float32, device=dev)  # [G, B, Ltot]
        # CPU results in one flat buffer (pinned) and its device twin: out [B Hkv, r, D], then lse [B Hkv, r]. Laid
        # out as the native attention writes them, so a layer whose tasks cover every row writes them in place.
        n_o = n_bh * r * d
        self.res_host = torch.zeros(n_o + n_bh * r, dtype=torch.float32, pin_memory=cuda)
        self.res_dev = torch.zeros(n_o + n_bh * r, dtype=torch.float32, device=dev) if cuda else self.res_host
        self.o_dev, self.lse_dev = self.res_dev[:n_o].view(n_bh, r, d), self.res_dev[n_o:].view(n_bh, r)
        res_np = self.res_host.numpy()  # the host writes through numpy: a fraction of a torch call's cost
        self.o_np, self.lse_np = res_np[:n_o].reshape(n_bh, r, d), res_np[n_o:].reshape(n_bh, r)
        self.o_gpu = torch.zeros(n_bh, r, d, dtype=torch.float32, device=dev)  # zero-copy GPU tasks' results
        self.lse_gpu = torch.full((n_bh, r), float("-inf"), dtype=torch.float32, device=dev)
        self.rows = ResultRows(self.o_np, self.lse_np, self.o_gpu, self.lse_gpu)  # where the executor writes
        self.out_s: list[torch.Tensor | None] = [None] * cfg.n_layers  # streaming part per layer (graph outputs)
        self.lse_s: list[torch.Tensor | None] = [None] * cfg.n_layers
        self.q: list[torch.Tensor | None] = [None] * cfg.n_layers  # the layer's q [B Hkv, r, D] (graph buffer)
        # q, k, v of the current layer side by side, [B, Hq + 2 Hkv, D] in the model dtype: filled inside the graph,
        # copied to the host by one eager D2H after the replay (memcpy nodes to host memory made each graph launch
        # cost ~190 us of host time on the H200 host, against ~30 us without them)
        hq = cfg.n_heads
        self.stage = torch.zeros(batch, hq + 2 * hkv, d, dtype=owner.dtype, device=dev)
        # two host copies, by layer parity: layer i's K/V are appended to the host store while the device runs
        # layer i + 1's graph, after layer i + 1's D2H went into the other copy
        self.stage_host = [torch.zeros(batch, hq + 2 * hkv, d, dtype=owner.dtype, pin_memory=cuda) for _ in range(2)]
        self.q32 = torch.zeros(batch, hq, d)  # [B, Hq, D] fp32: the native kernels' queries, refilled per layer
        # The host append reads k and v straight from a staging copy: viewed as rows of [Hkv, D], batch row b's k is
        # row b * w + r and its v row b * w + r + 1 (w = (Hq + 2 Hkv) / Hkv). A model dtype other than the store's
        # goes through one converted copy [B, 2 Hkv, D] first (w = 2).
        store = owner.store
        self.slots32 = np.zeros(batch, np.int32)  # the step's slots, refilled in place by begin()
        self.kv16: torch.Tensor | None = None
        if owner.dtype == store.dtype:
            sources, first = self.stage_host, hq // hkv
        else:
            self.kv16 = torch.zeros(batch, 2 * hkv, d, dtype=store.dtype)
            sources, first = [self.kv16], 0
        self.appenders: list[native.PreparedAppend] = []
        for src in sources:
            w = src.shape[1] // hkv
            rows = src.view(batch * w, hkv, d)
            n_rows = batch * w - first - 1
            k, v = rows[first : first + n_rows], rows[first + 1 : first + 1 + n_rows]
            self.appenders.append(native.PreparedAppend(store.view(0), self.slots32, np.arange(batch) * w, k, v))

    def load(self, st: DecodeStep) -> None:
        """This step's indices into the static tensors (device-to-device copies, no sync)."""
        self.slots.copy_(st.slots_dev)
        self.ring.copy_(st.ring_dev)
        self.bias.copy_(st.bias)


class GraphedDecode(CapturedDecode):
    """The captured form of a SparseAttention decode step with CPU selection (see the module docstring)."""

    def __init__(self, owner: SparseAttention):
        # a weak reference: graph sets hold this object, and must not keep a dropped backend (and its pinned host
        # store) alive
        self.a = weakref.proxy(owner)
        self.serial = owner.serial
        self.static: dict[int, StaticStep] = {}
        self.ss: StaticStep | None = None
        self.st: DecodeStep | None = None
        self.chunks: list[SeqChunk] = []
        # the step's tasks (SparseState.plan_tasks): table, result row, layer boundaries; their prepared native calls; the
        # layers' store views (valid for the step: see begin)
        self.tasks = np.zeros((0, native.TASK_FIELDS), np.int32)
        self.bh = np.zeros(0, np.int64)
        self.ends: list[int] = []
        self.sel: native.PreparedSelection | None = None
        self.expect: list[tuple[int, int]] = []  # per layer: (selected tokens, smallest task's) top-k will give
        self.mispredicted = 0  # layers whose top-k selected other than expected (tests check this stays 0)
        self.views: list[native.KVView] = []
        self._t0 = self._wait0 = 0.0
        # the step's pin table (PinnedBlocks.table of self.tasks) and the task table it was gathered for
        self._pin_table: tuple[np.ndarray, np.ndarray] | None = None
        self._pin_src: np.ndarray | None = None

    # ---- per step ------------------------------------------------------------------------------------------------
    def owner_id(self) -> int:
        return self.serial

    def key(self, batch: int) -> tuple[int, ...]:
        """Changes whenever a buffer a captured graph addresses was reallocated: then the graphs are captured anew."""
        a = self.a
        ss = self.static.get(batch)
        if ss is None:
            ss = self.static[batch] = StaticStep(a, batch)
        return (a.serial, batch, a.state.near.data_ptr(), id(ss))

    def begin(self, chunks: list[SeqChunk]) -> None:
        a = self.a
        self.chunks = chunks
        for layer in range(a.cfg.n_layers):  # K/V queued by an eager step (the first decode step) go in first
            a.flush_layer(layer)
        self.st = st = a.state.step_for(chunks)
        self.ss = ss = self.static[len(chunks)]
        ss.load(st)
        a.store.reserve_decode(st.slots)  # before the views are fetched: the step's appends add no pages
        ss.slots32[:] = st.slots
        self.views = [a.store.view(layer) for layer in range(a.cfg.n_layers)]
        a.state.count_step(st)  # the counters the eager path adds layer by layer
        self.tasks, self.bh, self.ends, selected = a.state.plan_tasks(st)
        # what top-k will select, per layer: all the scheduler needs to see that a layer goes all-CPU (auto only)
        self.expect = expected_sizes(selected, self.ends) if a.placement == "auto" else [(0, 0)] * a.cfg.n_layers
        self.sel = None
        if len(self.tasks):
            self.sel = native.PreparedSelection(self.views[0], ss.q32, self.tasks, a.scale, rows=self.bh,
                                                out=ss.o_np, lse=ss.lse_np)
        if a.device.type == "cuda":  # the host calls come a device layer apart: keep the pool's workers spinning
            native.set_spin_us(GPU_STEP_SPIN_US)
            native.wake_threads()
        self._wait0 = a.state.stats.gpu_wait_s
        self._t0 = time.perf_counter()

    def end(self, defer_sync: bool = False) -> None:
        a = self.a
        self._append(a.cfg.n_layers - 1)  # while the device runs the last layer's tail and the logits
        for c in self.chunks:
            a.state.length[c.seq_id] = c.start + c.length
        if a.device.type == "cuda":
            torch.cuda.current_stream(a.device).synchronize()  # the step's end on the device (logits are read next)
            native.set_spin_us(None)  # idle workers sleep soon again between steps and requests
        a.state.stats.steps += 1
        step = time.perf_counter() - self._t0
        a.state.stats.step_s += step
        a.state.stats.gpu_compute_s += max(0.0, step - (a.state.stats.gpu_wait_s - self._wait0))  # the device was busy otherwise

    # ---- captured pieces -----------------------------------------------------------------------------------------
    def prologue(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """q [B, Hq, D], k, v [B, Hkv, D] (graph buffers): device slab write, D2H of k, v, q, streaming part."""
        a, ss = self.a, self.ss
        assert ss is not None
        B, hkv, r, d = ss.batch, a.cfg.n_kv_heads, a.r, a.cfg.head_dim
        qg, ss.out_s[layer], ss.lse_s[layer] = stream_layer(a, layer, ss.slots, ss.ring, ss.bias, q, k, v)
        hq = a.cfg.n_heads
        ss.stage[:, :hq] = q
        ss.stage[:, hq : hq + hkv] = k
        ss.stage[:, hq + hkv :] = v
        ss.q[layer] = qg.reshape(B * hkv, r, d)  # the GPU tasks' queries (a copy inside the graph if q is strided)

    def epilogue(self, layer: int) -> torch.Tensor:
        """Merge streaming, CPU and GPU parts by LSE -> o [B, Hq, D] in the model dtype."""
        a, ss = self.a, self.ss
        assert ss is not None
        B, hkv, r, d = ss.batch, a.cfg.n_kv_heads, a.r, a.cfg.head_dim
        out_s, lse_s = ss.out_s[layer], ss.lse_s[layer]
        assert out_s is not None and lse_s is not None
        o_c, lse_c = ss.o_dev.view(B, hkv, r, d), ss.lse_dev.view(B, hkv, r)
        o_g, lse_g = ss.o_gpu.view(B, hkv, r, d), ss.lse_gpu.view(B, hkv, r)
        m = torch.maximum(torch.maximum(lse_s, lse_c), lse_g)  # finite: the streaming part always has tokens
        w_s, w_c, w_g = torch.exp(lse_s - m), torch.exp(lse_c - m), torch.exp(lse_g - m)
        out = (out_s * w_s[..., None] + o_c * w_c[..., None] + o_g * w_g[..., None]) / (w_s + w_c + w_g)[..., None]
        ss.lse_gpu.fill_(float("-inf"))  # the next layer's GPU part starts empty
        return out.view(B, hkv * r, d).to(a.dtype)

    # ---- host work between replays -------------------------------------------------------------------------------
    def host(self, layer: int) -> None:
        a, ss, st = self.a, self.ss, self.st
        assert ss is not None and st is not None
        cuda = a.device.type == "cuda"
        ev = None
        staged = ss.stage_host[layer % 2]
        if cuda:
            native.wake_threads()  # a no-op while they spin; else they wake during the D2H wait, not in the call
            staged.copy_(ss.stage, non_blocking=True)  # q, k, v of this layer (the replay just queued)
            ev = torch.cuda.Event()
            ev.record()
        else:
            staged.copy_(ss.stage)
        if layer > 0:
            self._append(layer - 1)  # overlaps with this layer's graph on the device
        if ev is not None:
            ev.synchronize()
        t_idle = time.perf_counter()  # from here until the next replay the device waits for the host
        lo, hi = self.ends[layer], self.ends[layer + 1]
        if hi > lo:
            assert self.sel is not None
            ss.q32.copy_(staged[:, : a.cfg.n_heads])  # [B, Hq, D] fp32 for the native kernels
            view = self.views[layer]
            ex = a.executor
            per_token = a.cfg.head_dim * 2 * ex.elem  # K+V bytes of one selected token (scheduler.task_bytes)
            placement: Placement = a.placement if ex.feeder is not None else "cpu"
            pins = self._pins(lo, hi)  # they take part of each task's k: the native top-k adds them to its selection
            total, smallest = self.expect[layer]
            if ex.all_cpu(placement, float(total * per_token), float(smallest * per_token)):  # one native call
                self._select_attend(layer, view, lo, hi, per_token, *pins)
            else:
                sel = self.sel
                t0 = time.perf_counter()
                sel.topk(view, lo, hi, a.topk_scoring, *pins)  # prepared: arguments checked once per step
                a.state.stats.cpu_topk_s += time.perf_counter() - t0
                ids, counts, tasks = sel.ids[lo:hi], sel.counts[lo:hi], self.tasks[lo:hi]
                a.state.read_tokens += float((counts.astype(np.float64) * tasks[:, 3]).sum())
                q_dev = ss.q[layer]
                assert q_dev is not None
                ex.run(view, ss.q32, q_dev, tasks, ids, counts, self.bh[lo:hi], ss.batch * a.cfg.n_kv_heads,
                       a.scale, placement, layer, into=ss.rows)
        else:
            ss.lse_np.fill(-np.inf)  # no CPU task in this layer
        if a.plan.background != "off":
            self._background(layer, lo, hi)
        if ss.res_dev is not ss.res_host:
            ss.res_dev.copy_(ss.res_host, non_blocking=True)  # read by the next replay's epilogue
        a.state.stats.gpu_wait_s += time.perf_counter() - t_idle

    def _background(self, layer: int, lo: int, hi: int) -> None:
        """The layer's unread-background term (SparseAttention.background_rows) merged by log-sum-exp into the CPU
        result buffer, whichever side ran a row's retrieval: a row of a GPU task holds lse -inf there, and the
        epilogue's merge of the three parts is the same sum either way."""
        a, ss, st = self.a, self.ss, self.st
        assert ss is not None and st is not None
        ids = counts = None
        if hi > lo:
            assert self.sel is not None
            ids, counts = self.sel.ids[lo:hi], self.sel.counts[lo:hi]
        got = a.background_rows(layer, st, ss.q32, self.tasks[lo:hi], ids, counts, self.bh[lo:hi],
                                a.state.gidx[layer][None, :])
        if got is None:
            return
        rows, o_b, lse_b = got
        lse_c = ss.lse_np[rows]  # [T, r]
        m = np.maximum(lse_c, lse_b)
        m = np.where(m == -np.inf, 0.0, m)  # both parts empty: weights exp(-inf) = 0, no -inf - -inf
        w_c, w_b = np.exp(lse_c - m), np.exp(lse_b - m)  # [T, r]
        o_c = np.where((w_c > 0)[..., None], ss.o_np[rows], 0.0)  # a row without a CPU part may hold a stale out
        den = np.where(w_c + w_b > 0, w_c + w_b, 1.0)
        ss.o_np[rows] = (o_c * w_c[..., None] + o_b * w_b[..., None]) / den[..., None]
        ss.lse_np[rows] = np.where(w_c + w_b > 0, m + np.log(den), -np.inf)

    def _pins(self, lo: int, hi: int) -> tuple[np.ndarray | None, np.ndarray | None]:
        """Pins of the step's task rows lo .. hi (int32 [hi - lo, P], counts [hi - lo]; (None, None) without pins).
        Gathered for every layer's tasks in one go at the step's first use (begin() makes a new task table per
        step), then sliced per layer: the per-layer cost is two views."""
        pins = self.a.pins
        if pins is None:
            return None, None
        if self._pin_src is not self.tasks or self._pin_table is None:
            layers = np.repeat(np.arange(len(self.ends) - 1), np.diff(self.ends))  # each row's layer [T]
            self._pin_table, self._pin_src = pins.table(layers, self.tasks), self.tasks
        ids, counts = self._pin_table
        return ids[lo:hi], counts[lo:hi]

    def _append(self, layer: int) -> None:
        """The layer's new K/V into the host store (one layer late: top-k never selects a block touching the
        window, which covers the newest token on the device meanwhile). Pages were reserved by begin()."""
        ss = self.ss
        assert ss is not None
        if ss.kv16 is not None:  # a model dtype other than the store's: convert first
            ss.kv16.copy_(ss.stage_host[layer % 2][:, self.a.cfg.n_heads :])
            ss.appenders[0].run(self.views[layer])
        else:
            ss.appenders[layer % 2].run(self.views[layer])

    def _select_attend(self, layer: int, view: native.KVView, lo: int, hi: int, per_token: int,
                       pins: np.ndarray | None, pin_counts: np.ndarray | None) -> None:
        """Every task of the layer on the CPU: top-k (with the layer's pins, if any) and attention in one native call,
        the results written straight into the pinned result buffer (lse -inf for rows without a task)."""
        a, sel = self.a, self.sel
        assert sel is not None
        tokens, t_select, t_attend = sel.select_attend(view, lo, hi, a.topk_scoring, pins, pin_counts)
        if a.placement == "auto" and tokens != self.expect[layer][0]:  # never seen; the results are right, only
            # the split was decided before the selection
            if not self.mispredicted:
                LOG.warning("graphed decode: top-k selected %d tokens in layer %d, %d expected", tokens, layer,
                            self.expect[layer][0])
            self.mispredicted += 1
        nbytes = float(tokens * per_token)
        a.state.read_tokens += float(tokens)
        st = a.state.stats
        st.cpu_topk_s += t_select
        st.cpu_attn_s += t_attend
        st.cpu_bytes += nbytes
        a.executor.cost_model.observe_cpu(nbytes, t_attend)
