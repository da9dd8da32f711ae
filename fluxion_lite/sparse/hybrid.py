"""Hybrid execution of one decode layer's retrieval tasks: CPU worker and GPU feeder, merged by log-sum-exp.

Given the layer's tasks (sequence x KV group) with their selected blocks, the scheduler (fluxion_lite/sparse/cost_model.py)
splits them; then, in this order:
  1. GPU tasks: with the zero-copy feeder (zero_copy.py) the device reads the selected blocks from the pinned host
     pages itself and nothing runs on the CPU; otherwise a native gather of the selected blocks into a pinned staging
     buffer (on the native pool; allocated once, grown rarely) and one non_blocking H2D of K and V together on a side
     CUDA stream. Then batched attention on the device over the blocks (padded per task, masked) -> (o, lse) per task.
  2. CPU tasks: native sparse attention in place over host KV, in a worker thread (the call releases the GIL), so the
     main thread enqueues step 1's device work while the CPU computes.
  3. The CPU results go to the device (pinned, non_blocking) and both parts are scattered into full-size
     [B * Hkv, r, D] / [B * Hkv, r] tensors (lse = -inf where a (seq, group) has no task), ready to merge with the
     streaming part by LSE.
On a machine without CUDA the "device" is the CPU and the same code runs with plain tensors (how CI covers it).

Buffers are reused from layer to layer without per-layer synchronisation because every layer first waits on the host
for an event recorded on the main stream after the previous layer's merge (the q copy, or the ids of GPU selection);
`_reuse_guard` re-checks that before a buffer is overwritten and waits if it ever does not hold.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fluxion_lite.hostkv import native
from fluxion_lite.sparse.attend import block_attention
from fluxion_lite.sparse.cost_model import CostModel, Placement, Split, all_cpu_suffices, split_tasks, task_bytes
from fluxion_lite.sparse.zero_copy import ZeroCopyFeeder




@dataclass
class StepStats:
    """Seconds (and bytes) summed over decode steps; stats() divides by steps."""

    steps: int = 0
    step_s: float = 0.0  # wall time from layer 0's attention to the end of the last layer's
    gpu_compute_s: float = 0.0  # device work of the sparse backend (streaming part, GPU tasks, merge)
    gpu_wait_s: float = 0.0  # device idle while the CPU selects / attends / gathers
    cpu_topk_s: float = 0.0
    cpu_attn_s: float = 0.0
    gather_s: float = 0.0
    host_wait_s: float = 0.0  # main thread blocked on the CPU worker
    pcie_bytes: float = 0.0  # H2D + D2H of the sparse path (staging, results, q, ids, new K/V)
    cpu_bytes: float = 0.0  # retrieval K+V bytes attended on the CPU
    gpu_bytes: float = 0.0  # ... sent to and attended on the GPU
    zero_copy_bytes: float = 0.0  # read by the GPU from host pages through the alias (zero-copy feeder)
    cpu_background_s: float = 0.0  # the unread-background term (native.background), plan.background != "off"

    def as_dict(self) -> dict[str, float]:
        n = max(1, self.steps)
        ms = 1000.0 / n
        total = self.cpu_bytes + self.gpu_bytes
        return {
            "steps": float(self.steps),
            "step_ms": self.step_s * ms,
            "gpu_compute_ms": self.gpu_compute_s * ms,
            "gpu_wait_ms": self.gpu_wait_s * ms,
            "gpu_wait_ratio": self.gpu_wait_s / self.step_s if self.step_s else 0.0,
            "cpu_topk_ms": self.cpu_topk_s * ms,
            "cpu_attn_ms": self.cpu_attn_s * ms,
            "cpu_background_ms": self.cpu_background_s * ms,
            "gather_ms": self.gather_s * ms,
            "host_wait_ms": self.host_wait_s * ms,
            "pcie_mb": self.pcie_bytes / n / 1e6,
            "gpu_byte_fraction": self.gpu_bytes / total if total else 0.0,
            "zero_copy_mb": self.zero_copy_bytes / n / 1e6,
        }


class Timer:
    """Intervals on the device timeline: CUDA events on the current stream, or perf_counter on a CPU device.

    mark() returns a handle; span(kind, a, b) adds the a -> b interval to `kind` at the end of the step, when one
    synchronisation makes every event of the step readable (events are pooled, not created per layer)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._free: list[Any] = []
        self._marks: list[Any] = []
        self._spans: list[tuple[str, int, int, float]] = []  # kind, mark a, mark b, sign

    def mark(self) -> int:
        if self.cuda:
            ev = self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)
            ev.record()
            self._marks.append(ev)
        else:
            self._marks.append(time.perf_counter())
        return len(self._marks) - 1

    def span(self, kind: str, a: int, b: int, sign: float = 1.0) -> None:
        self._spans.append((kind, a, b, sign))

    def collect(self) -> dict[str, float]:
        """Seconds per kind for the step so far; waits for the last event (one sync per step)."""
        out: dict[str, float] = {}
        if self._marks and self.cuda:
            self._marks[-1].synchronize()
        for kind, a, b, sign in self._spans:
            if self.cuda:
                dt = self._marks[a].elapsed_time(self._marks[b]) / 1000.0
            else:
                dt = self._marks[b] - self._marks[a]
            out[kind] = out.get(kind, 0.0) + sign * dt
        if self.cuda:
            self._free.extend(self._marks)
        self._marks, self._spans = [], []
        return out


class _Pinned:
    """A flat host buffer (pinned when the device is CUDA) and its device twin, grown by doubling, never shrunk."""

    def __init__(self, dtype: torch.dtype, device: torch.device):
        self.dtype, self.device = dtype, device
        self.pin = device.type == "cuda"
        self.host = torch.empty(0, dtype=dtype)
        self.dev = self.host if not self.pin else torch.empty(0, dtype=dtype, device=device)

    def ensure(self, n: int) -> None:
        if n <= self.host.numel():
            return
        if self.pin:
            torch.cuda.synchronize(self.device)  # the old buffers may still be in flight; growth is rare
        cap = max(n, 2 * self.host.numel(), 1 << 12)
        # zeros, so padding rows the gather never wrote stay finite (masked scores x NaN values would be NaN)
        self.host = torch.zeros(cap, dtype=self.dtype, pin_memory=self.pin)
        self.dev = torch.zeros(cap, dtype=self.dtype, device=self.device) if self.pin else self.host


@dataclass
class ResultRows:
    """Where a captured step wants a layer's retrieval results (HybridExecutor.run's `into`): the CPU tasks' rows in
    pinned host arrays (numpy views: the host writes them at a fraction of a torch call's cost), the GPU tasks' rows
    in device tensors; n_bh = batch * Hkv rows each."""

    o_host: np.ndarray  # fp32 [n_bh, r, D]
    lse_host: np.ndarray  # fp32 [n_bh, r]
    o_dev: torch.Tensor  # fp32 [n_bh, r, D]
    lse_dev: torch.Tensor  # fp32 [n_bh, r]


class HybridExecutor:
    """Runs a layer's retrieval tasks on the CPU worker and the GPU feeder; see the module docstring."""

    def __init__(self, device: torch.device, kv_dtype: torch.dtype, head_dim: int, r: int, costs: CostModel,
                 placement: Placement, timer: Timer, stats: StepStats, feeder: ZeroCopyFeeder | None = None):
        self.device, self.kv_dtype, self.d, self.r = device, kv_dtype, head_dim, r
        self.cost_model, self.placement, self.timer, self.stats = costs, placement, timer, stats
        self.elem = torch.tensor([], dtype=kv_dtype).element_size()
        self.cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fluxion-cpu")
        self._staging = _Pinned(kv_dtype, device)  # K then V of the GPU tasks, [2, rows, D] flattened
        self._cpu_out = _Pinned(torch.float32, device)  # CPU results: out [Tc, r, D] then lse [Tc, r]
        self._meta = _Pinned(torch.int64, device)  # per GPU task: row offset, tokens, flat (seq, group); CPU bh
        self._last_use: torch.cuda.Event | None = None
        # zero-copy GPU side (zero_copy.py): the GPU reads the selected blocks from the host pages itself; None:
        # native gather into staging + H2D
        self.feeder = feeder
        self._zc_meta = _Pinned(torch.int32, device)
        self.zc_calls = 0  # layers whose GPU part went through the feeder

    def close(self) -> None:
        self._worker.shutdown(wait=True)

    def wait_idle(self) -> None:
        """Wait until the device has finished the last layer's reads (before host pages can be reused)."""
        if self._last_use is not None:
            self._last_use.synchronize()

    def _reuse_guard(self) -> None:
        if self._last_use is not None and not self._last_use.query():
            self._last_use.synchronize()

    def all_cpu(self, placement: Placement, total_bytes: float, smallest_bytes: float) -> bool:
        """Whether run() would put every task of a layer on the CPU, for tasks of total_bytes whose smallest
        non-empty one has smallest_bytes: always for placement cpu (or no GPU side), and for auto when the cost
        model's shortcut applies (the CPU finishes everything before the GPU could finish the smallest task). Lets
        a caller that knows the sizes before the selection (the captured host step) select and attend in one
        native call instead."""
        if placement == "cpu":
            return True
        if placement != "auto":
            return False
        costs = self.cost_model.costs
        return not costs.has_gpu or all_cpu_suffices(costs, total_bytes, smallest_bytes)

    def run(self, view: native.KVView, q_host: torch.Tensor, qg: torch.Tensor, tasks: np.ndarray, ids: np.ndarray,
            counts: np.ndarray, bh: np.ndarray, n_bh: int, scale: float,
            placement: Placement | None = None, layer: int | None = None,
            into: ResultRows | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The one place where a layer's retrieval tasks are split between the CPU and the GPU and run.

        tasks int32 [T, 9], ids int32 [T, k_cap], counts int32 [T], bh int64 [T] flat (seq * Hkv + group) index;
        q_host fp32 [B, Hq, D] (CPU), qg [B * Hkv, r, D] on the device. Returns device o fp32 [n_bh, r, D] and
        lse fp32 [n_bh, r] covering every task (lse -inf elsewhere).

        into: result buffers of a captured step (host_capture.StaticStep): the CPU tasks' rows go into its pinned
        host arrays (every other row's lse set to -inf; the caller copies them to the device with the layer's
        other host results), the GPU tasks' rows into its device tensors, which are returned. Nothing is timed on
        the device timeline then (the captured step accounts its own time)."""
        r, d, dev = self.r, self.d, self.device
        g = tasks[:, 3].astype(np.int64)
        nbytes = task_bytes(counts, g, d, self.elem)
        split = split_tasks(nbytes, self.cost_model.costs, placement or self.placement)
        st = self.stats
        st.cpu_bytes += split.cpu_bytes
        st.gpu_bytes += split.gpu_bytes
        if into is not None:
            return self._run_into(into, view, q_host, qg, tasks, ids, counts, bh, scale, split, layer)
        self._reuse_guard()
        o_full = torch.zeros(n_bh, r, d, dtype=torch.float32, device=dev)
        lse_full = torch.full((n_bh, r), float("-inf"), dtype=torch.float32, device=dev)

        # GPU feeder, part 1 (host): gather on the native pool before the CPU worker takes it (not with zero-copy)
        gi = split.gpu
        if len(gi) and self.feeder is None:
            rows_per = counts[gi].astype(np.int64) * g[gi]  # [Tg] upper bound on tokens (full blocks)
            n_rows = int(rows_per.sum())
            self._staging.ensure(2 * n_rows * d)
            k_out = self._staging.host[: n_rows * d].view(n_rows, d)
            v_out = self._staging.host[n_rows * d : 2 * n_rows * d].view(n_rows, d)
            t0 = time.perf_counter()
            offs, toks = native.gather(view, tasks[gi], ids[gi], counts[gi], k_out, v_out)
            dt = time.perf_counter() - t0
            st.gather_s += dt
            self.cost_model.observe_gather(split.gpu_bytes, dt)
        # CPU worker: starts now, runs while the main thread enqueues the device work below
        ci = split.cpu
        fut: Future[float] | None = None
        if len(ci):
            tc = len(ci)
            self._cpu_out.ensure(tc * r * (d + 1))
            o_c = self._cpu_out.host[: tc * r * d].view(tc, r, d)
            l_c = self._cpu_out.host[tc * r * d : tc * r * (d + 1)].view(tc, r)
            if self.cuda or len(gi):
                fut = self._worker.submit(self._cpu_attention, view, q_host, tasks[ci], ids[ci], counts[ci], scale,
                                          o_c, l_c)
            else:  # nothing to overlap with: on this thread (a hand-off to the worker costs two thread switches)
                fut = Future()
                fut.set_result(self._cpu_attention(view, q_host, tasks[ci], ids[ci], counts[ci], scale, o_c, l_c))
        # GPU feeder, part 2 (device): zero-copy read + attention, or one H2D of K and V + attention; scatter
        if len(gi) and self.feeder is not None:
            assert layer is not None, "the zero-copy feeder needs the layer"
            a = self.timer.mark()
            self.zero_copy_into(layer, view, qg, tasks[gi], ids[gi], counts[gi], bh[gi], scale, o_full, lse_full)
            self.timer.span("gpu_tasks", a, self.timer.mark())
            bh_cpu_dev = self._upload_bh(bh[ci]) if len(ci) else None
        elif len(gi):
            tg, kmax = len(gi), int(toks.max()) if len(toks) else 0
            self._meta.ensure(3 * tg + len(ci))
            meta = self._meta.host
            meta[:tg] = torch.from_numpy(offs)
            meta[tg : 2 * tg] = torch.from_numpy(toks.astype(np.int64))
            meta[2 * tg : 3 * tg] = torch.from_numpy(bh[gi])
            meta[3 * tg : 3 * tg + len(ci)] = torch.from_numpy(bh[ci])
            kv_dev = self._copy_kv(2 * n_rows * d)
            meta_dev = self._meta.dev[: 3 * tg + len(ci)]
            if self.cuda:
                meta_dev.copy_(meta[: 3 * tg + len(ci)], non_blocking=True)
            st.pcie_bytes += 2 * n_rows * d * self.elem
            a = self.timer.mark()
            k_dev = kv_dev[: n_rows * d].view(n_rows, d)
            v_dev = kv_dev[n_rows * d :].view(n_rows, d)
            rows = (meta_dev[:tg, None] + torch.arange(max(kmax, 1), device=dev)[None, :]).clamp_(max=max(n_rows - 1, 0))
            o_g, lse_g = block_attention(qg[meta_dev[2 * tg : 3 * tg]], k_dev[rows], v_dev[rows],
                                         meta_dev[tg : 2 * tg], scale)  # [Tg, r, D], [Tg, r]
            o_full.index_copy_(0, meta_dev[2 * tg : 3 * tg], o_g)
            lse_full.index_copy_(0, meta_dev[2 * tg : 3 * tg], lse_g)
            self.timer.span("gpu_tasks", a, self.timer.mark())
            bh_cpu_dev = meta_dev[3 * tg :]
        elif len(ci):
            bh_cpu_dev = self._upload_bh(bh[ci])
        # CPU results -> device
        if fut is not None:
            t0 = time.perf_counter()
            cpu_s = fut.result()  # re-raises a native error from the worker
            st.host_wait_s += time.perf_counter() - t0
            self.cost_model.observe_cpu(split.cpu_bytes, cpu_s)
            n_c = tc * r * (d + 1)
            res = self._cpu_out.dev[:n_c]
            if self.cuda:
                res.copy_(self._cpu_out.host[:n_c], non_blocking=True)
                st.pcie_bytes += n_c * 4
            o_full.index_copy_(0, bh_cpu_dev, res[: tc * r * d].view(tc, r, d))
            lse_full.index_copy_(0, bh_cpu_dev, res[tc * r * d :].view(tc, r))
        if self.cuda:
            self._last_use = torch.cuda.Event()
            self._last_use.record()
        return o_full, lse_full

    def _run_into(self, into: ResultRows, view: native.KVView, q_host: torch.Tensor, qg: torch.Tensor,
                  tasks: np.ndarray, ids: np.ndarray, counts: np.ndarray, bh: np.ndarray, scale: float,
                  split: Split, layer: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """run() into a captured step's buffers: the CPU part on the worker while this thread queues the GPU part
        (zero-copy feeder; a captured step without it runs placement cpu), or on this thread when one side is
        empty."""
        ci, gi = split.cpu, split.gpu
        into.lse_host.fill(-np.inf)  # rows without a CPU task
        cpu_args = (into, view, q_host, tasks[ci], ids[ci], counts[ci], bh[ci], scale, split.cpu_bytes)
        fut = self._worker.submit(self._cpu_rows, *cpu_args) if len(ci) and len(gi) else None
        if len(gi):
            assert layer is not None and self.feeder is not None, "a captured step's GPU tasks need the feeder"
            self.zero_copy_into(layer, view, qg, tasks[gi], ids[gi], counts[gi], bh[gi], scale, into.o_dev,
                                into.lse_dev)
        if fut is not None:
            t0 = time.perf_counter()
            fut.result()  # re-raises a native error from the worker
            self.stats.host_wait_s += time.perf_counter() - t0
        elif len(ci):
            self._cpu_rows(*cpu_args)
        return into.o_dev, into.lse_dev

    def _cpu_rows(self, into: ResultRows, view: native.KVView, q_host: torch.Tensor, tasks: np.ndarray,
                  ids: np.ndarray, counts: np.ndarray, bh: np.ndarray, scale: float, nbytes: float) -> None:
        """CPU tasks' native attention into rows bh of a captured step's host result arrays."""
        o, lse = self.cpu_part(view, q_host, tasks, ids, counts, scale, nbytes)  # [Tc, r, D], [Tc, r]
        into.o_host[bh] = o.numpy()  # [B Hkv, r, D]
        into.lse_host[bh] = lse.numpy()

    def zero_copy_into(self, layer: int, view: native.KVView, qg: torch.Tensor, tasks: np.ndarray, ids: np.ndarray,
                       counts: np.ndarray, bh: np.ndarray, scale: float, o_dst: torch.Tensor,
                       lse_dst: torch.Tensor) -> None:
        """The GPU tasks through the zero-copy feeder, their results scattered into rows bh of o_dst [n_bh, r, D] /
        lse_dst [n_bh, r] on the device (queued, not waited for); counts the PCIe bytes and the host queueing time."""
        assert self.feeder is not None, "zero_copy_into needs the zero-copy feeder"
        t0 = time.perf_counter()
        self._zc_meta.ensure(self.feeder.meta_size(len(tasks), counts))
        o_g, lse_g, bh_g, nread = self.feeder.attend(layer, view.n_tokens, qg, tasks, ids, counts, bh, scale,
                                                     self._zc_meta.host, self._zc_meta.dev)
        o_dst.index_copy_(0, bh_g, o_g)
        lse_dst.index_copy_(0, bh_g, lse_g)
        self.cost_model.observe_zero_copy_host(time.perf_counter() - t0)
        self.stats.pcie_bytes += nread
        self.stats.zero_copy_bytes += nread
        self.zc_calls += 1

    def cpu_part(self, view: native.KVView, q_host: torch.Tensor, tasks: np.ndarray, ids: np.ndarray,
                 counts: np.ndarray, scale: float, nbytes: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Native sparse attention of CPU tasks on the calling thread into the executor's result buffer:
        out fp32 [Tc, r, D], lse fp32 [Tc, r] (valid until the next call); updates the CPU rate."""
        tc, r, d = len(tasks), self.r, self.d
        self._cpu_out.ensure(tc * r * (d + 1))
        o = self._cpu_out.host[: tc * r * d].view(tc, r, d)
        lse = self._cpu_out.host[tc * r * d : tc * r * (d + 1)].view(tc, r)
        self.cost_model.observe_cpu(nbytes, self._cpu_attention(view, q_host, tasks, ids, counts, scale, o, lse))
        return o, lse

    def submit(self, fn: Any, *args: Any) -> Future[Any]:
        """Run fn(*args) on the executor's CPU worker thread."""
        return self._worker.submit(fn, *args)

    def _upload_bh(self, bh_cpu: np.ndarray) -> torch.Tensor:
        """The CPU tasks' rows of the full-size result on the device (int64 [Tc])."""
        n = len(bh_cpu)
        self._meta.ensure(n)
        self._meta.host[:n] = torch.from_numpy(bh_cpu)
        dev = self._meta.dev[:n]
        if self.cuda:
            dev.copy_(self._meta.host[:n], non_blocking=True)
        return dev

    def _copy_kv(self, n: int) -> torch.Tensor:
        """One async H2D of the staging buffer's first n elements on the side stream; the main stream waits for it."""
        if not self.cuda:
            return self._staging.host[:n]
        assert self.copy_stream is not None
        dst = self._staging.dev[:n]  # its readers (the previous layer's GPU tasks) are done: see _reuse_guard
        with torch.cuda.stream(self.copy_stream):
            dst.copy_(self._staging.host[:n], non_blocking=True)
        torch.cuda.current_stream(self.device).wait_stream(self.copy_stream)
        return dst

    def _cpu_attention(self, view: native.KVView, q_host: torch.Tensor, tasks: np.ndarray, ids: np.ndarray,
                       counts: np.ndarray, scale: float, o: torch.Tensor, lse: torch.Tensor) -> float:
        t0 = time.perf_counter()
        native.sparse_attention(view, q_host, tasks, ids, counts, scale, out=o, lse=lse)
        dt = time.perf_counter() - t0
        self.stats.cpu_attn_s += dt  # only this thread writes this field while the main thread waits on it
        return dt
