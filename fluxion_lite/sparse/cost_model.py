"""Priority scheduler for one decode layer's retrieval tasks: which run on the CPU, which on the GPU.

A task is one (sequence, KV group) of a layer with its selected blocks; its volume is the K+V bytes those blocks
hold (blocks x g x head_dim x 2 x element size). Tasks go into one queue ordered by volume, largest first, and two
workers pull from it:

  CPU worker   native sparse attention in place over host KV            time = cpu_fixed + bytes / cpu_gbs
  GPU feeder   native gather into pinned staging (on the CPU pool), one time = gather_fixed + bytes / gather_gbs
               async H2D and attention on the GPU                            (before the CPU worker starts)
                                                                        then  h2d_fixed + bytes / h2d_gbs

The layer's timeline as the hybrid executor runs it (fluxion_lite/sparse/hybrid.py): the gather runs first on the native
thread pool, then the CPU worker's attention and the GPU's copy + attention run concurrently, so

  makespan(C, G) = gather(G) + max(cpu(C), h2d(G))      (gather and h2d are 0 when G is empty)

With the zero-copy feeder (fluxion_lite/sparse/zero_copy.py) the GPU reads the selected blocks from the pinned host pages
itself over PCIe and the CPU does no gather, so the two sides overlap completely:

  makespan(C, G) = max(cpu(C), zc_fixed + G / pcie_read_gbs + G / gpu_attn_gbs)

with the PCIe read and device attention rates probed at start-up (zero_copy.probe), not constants.

Pulling is simulated rather than raced: each task, largest first, goes to the side where the layer would finish
sooner with it (a free worker declines a task the other side finishes earlier). The greedy result is compared with
the two static placements and the best of the three is kept, so the split is never worse than all-CPU or all-GPU
under the model. Costs come from bandwidths measured at start-up (measure_costs) and refined online (CostModel).

Pure Python + numpy: no torch, no GPU, unit-testable (tests/test_scheduler.py).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np

Placement = Literal["cpu", "gpu", "auto"]

# Kernel efficiencies relative to a STREAM-like read on the same pool, measured by bench/kernels.py on the H200 host
# at 16 threads (bench/results/kernels-h200-v2.json: attention 65.3, gather 53.4 of 107.2 GB/s read). Only the start
# values: CostModel.observe_* replaces them with the rates seen while decoding.
CPU_ATTN_EFFICIENCY = 0.6
GATHER_EFFICIENCY = 0.5


@dataclass(frozen=True)
class Costs:
    """Throughputs in GB/s (1e9 bytes of K+V per second) and fixed costs per call in seconds."""

    cpu_gbs: float  # native sparse attention over host KV
    gather_gbs: float  # native gather into pinned staging
    h2d_gbs: float | None  # pinned host -> device copy; None: no GPU side, everything runs on the CPU
    cpu_fixed_s: float = 0.0
    gather_fixed_s: float = 0.0
    h2d_fixed_s: float = 0.0  # copy launch + GPU attention launches + the merge of the GPU part
    # zero-copy GPU side: when set, the GPU reads host pages itself (no gather, no staging copy)
    zero_copy: bool = False
    pcie_read_gbs: float | None = None  # GPU kernel reading pinned host memory through the alias
    gpu_attn_gbs: float | None = None  # device attention over the bytes read (None: negligible)
    zc_fixed_s: float = 0.0  # index math + read + attention launches and the scatter of the GPU part

    @property
    def has_gpu(self) -> bool:
        """Whether there is a GPU side to place tasks on."""
        return (self.pcie_read_gbs is not None) if self.zero_copy else (self.h2d_gbs is not None)

    def cpu_time(self, nbytes: float) -> float:
        return self.cpu_fixed_s + nbytes / (self.cpu_gbs * 1e9) if nbytes > 0 else 0.0

    def gather_time(self, nbytes: float) -> float:
        return self.gather_fixed_s + nbytes / (self.gather_gbs * 1e9) if nbytes > 0 else 0.0

    def h2d_time(self, nbytes: float) -> float:
        if nbytes <= 0:
            return 0.0
        if self.h2d_gbs is None:
            return float("inf")
        return self.h2d_fixed_s + nbytes / (self.h2d_gbs * 1e9)

    def zero_copy_time(self, nbytes: float) -> float:
        """PCIe read of the selected blocks by the GPU plus the device attention over them."""
        if nbytes <= 0:
            return 0.0
        if self.pcie_read_gbs is None:
            return float("inf")
        attn = nbytes / (self.gpu_attn_gbs * 1e9) if self.gpu_attn_gbs else 0.0
        return self.zc_fixed_s + nbytes / (self.pcie_read_gbs * 1e9) + attn

    def makespan(self, cpu_bytes: float, gpu_bytes: float) -> float:
        if self.zero_copy:  # nothing of the GPU side runs on the CPU: the sides overlap completely
            return max(self.cpu_time(cpu_bytes), self.zero_copy_time(gpu_bytes))
        return self.gather_time(gpu_bytes) + max(self.cpu_time(cpu_bytes), self.h2d_time(gpu_bytes))


@dataclass(frozen=True)
class Split:
    """Task indices (into the caller's task list) per side, each in queue order (largest first)."""

    order: np.ndarray  # int64 [T]: the queue, largest volume first (ties: lower index first)
    cpu: np.ndarray  # int64 [Tc]
    gpu: np.ndarray  # int64 [Tg]
    cpu_bytes: float
    gpu_bytes: float
    makespan_s: float  # predicted

    @property
    def gpu_fraction(self) -> float:
        total = self.cpu_bytes + self.gpu_bytes
        return self.gpu_bytes / total if total else 0.0


def task_bytes(counts: np.ndarray, g: np.ndarray, head_dim: int, elem_size: int) -> np.ndarray:
    """K+V bytes of each task's selection: counts [T] blocks of g [T] tokens -> float64 [T]."""
    return np.asarray(counts, np.float64) * np.asarray(g, np.float64) * (head_dim * 2 * elem_size)


def priority_order(nbytes: np.ndarray) -> np.ndarray:
    """The queue: indices by volume, largest first; a stable sort keeps equal tasks in submission order."""
    return np.argsort(-np.asarray(nbytes, np.float64), kind="stable").astype(np.int64)


def all_cpu_suffices(costs: Costs, total: float, smallest: float) -> bool:
    """Whether all-CPU is an optimal split of tasks of `total` bytes whose smallest non-empty task has `smallest`.
    Any split that uses the GPU takes at least makespan(0, smallest): its GPU side alone costs that much in both
    models. When the CPU finishes everything sooner, no split beats all-CPU and the greedy loop (Python, per task,
    ~0.1 ms per layer on the decode path) can be skipped; typical at batch 1, where the GPU's fixed cost wins."""
    return costs.makespan(total, 0.0) <= costs.makespan(0.0, smallest)


def split_tasks(nbytes: np.ndarray, costs: Costs, placement: Placement = "auto") -> Split:
    """Assign every task exactly once to the CPU or the GPU side, minimising the layer's makespan (see module doc)."""
    nbytes = np.asarray(nbytes, np.float64).reshape(-1)
    if (nbytes < 0).any() or not np.isfinite(nbytes).all():
        raise ValueError("task bytes must be finite and non-negative")
    order = priority_order(nbytes)
    total = float(nbytes.sum())
    empty = np.zeros(0, np.int64)
    if placement == "gpu" and not costs.has_gpu:
        raise ValueError("placement='gpu' needs a GPU side (costs.h2d_gbs / pcie_read_gbs is None)")
    all_cpu = Split(order, order, empty, total, 0.0, costs.makespan(total, 0.0))
    all_gpu = Split(order, empty, order, 0.0, total, costs.makespan(0.0, total))
    if placement == "cpu" or (placement == "auto" and not costs.has_gpu) or len(order) == 0:
        return all_cpu
    if placement == "gpu":
        return all_gpu
    if placement != "auto":
        raise ValueError(f"placement must be 'cpu', 'gpu' or 'auto', got {placement!r}")
    positive = nbytes[nbytes > 0]
    if all_cpu_suffices(costs, total, float(positive.min()) if len(positive) else 0.0):
        return all_cpu
    on_gpu = np.zeros(len(order), bool)
    c = gb = 0.0
    for i in order:  # largest first: big tasks placed early, small ones fill the gaps
        b = float(nbytes[i])
        if costs.makespan(c, gb + b) < costs.makespan(c + b, gb):
            gb += b
            on_gpu[i] = True
        else:
            c += b
    greedy = Split(order, order[~on_gpu[order]], order[on_gpu[order]], c, gb, costs.makespan(c, gb))
    return min((greedy, all_cpu, all_gpu), key=lambda s: s.makespan_s)


class CostModel:
    """Costs that start from measured bandwidths and follow the rates observed while decoding (EMA per side).

    Only calls that move at least min_bytes update a rate: smaller ones are dominated by the fixed cost."""

    def __init__(self, costs: Costs, alpha: float = 0.2, min_bytes: float = 256 * 1024):
        self.costs, self.alpha, self.min_bytes = costs, alpha, min_bytes
        self._zc_probe_s = costs.zc_fixed_s  # the device-side fixed cost probed at start-up
        self._zc_host_s: float | None = None  # EMA of the host time to queue a zero-copy GPU part

    def _rate(self, old: float, nbytes: float, seconds: float, fixed: float) -> float:
        if nbytes < self.min_bytes or seconds <= fixed:
            return old
        observed = nbytes / (seconds - fixed) / 1e9
        return (1 - self.alpha) * old + self.alpha * observed

    def observe_cpu(self, nbytes: float, seconds: float) -> None:
        c = self.costs
        rate = self._rate(c.cpu_gbs, nbytes, seconds, c.cpu_fixed_s)
        if rate != c.cpu_gbs:  # replace() costs a few us, once per decode layer
            self.costs = replace(c, cpu_gbs=rate)

    def observe_gather(self, nbytes: float, seconds: float) -> None:
        c = self.costs
        self.costs = replace(c, gather_gbs=self._rate(c.gather_gbs, nbytes, seconds, c.gather_fixed_s))

    def observe_h2d(self, nbytes: float, seconds: float) -> None:
        c = self.costs
        if c.h2d_gbs is not None:
            self.costs = replace(c, h2d_gbs=self._rate(c.h2d_gbs, nbytes, seconds, c.h2d_fixed_s))

    def observe_zero_copy_host(self, seconds: float) -> None:
        """The host time to queue a zero-copy GPU part (index math, launches): the GPU side cannot finish sooner, so
        the fixed cost follows it when it exceeds the probed device-side fixed cost (small layers then stay on the
        CPU instead of paying ~30 launches for a few KiB)."""
        c = self.costs
        if c.pcie_read_gbs is None:
            return
        self._zc_host_s = seconds if self._zc_host_s is None else 0.8 * self._zc_host_s + 0.2 * seconds
        self.costs = replace(c, zc_fixed_s=max(self._zc_probe_s, self._zc_host_s))

    def observe_zero_copy(self, nbytes: float, seconds: float) -> None:
        """A zero-copy GPU part (read + attention) of nbytes took seconds: updates the read rate (the attention
        share is taken out at its probed rate)."""
        c = self.costs
        if c.pcie_read_gbs is None:
            return
        attn = nbytes / (c.gpu_attn_gbs * 1e9) if c.gpu_attn_gbs else 0.0
        self.costs = replace(c, pcie_read_gbs=self._rate(c.pcie_read_gbs, nbytes, seconds - attn, c.zc_fixed_s))


# ---- start-up measurement -----------------------------------------------------------------------------------------

_measured: dict[str, Costs] = {}


def measure_costs(device: str = "cpu", probe_mib: int = 128) -> Costs:
    """Measure host read GB/s (native STREAM-like probe on the kernel pool) and, for CUDA, pinned H2D GB/s.

    Cached per device for the process (a benchmark builds many backends). Takes ~0.1-0.3 s the first time."""
    key = f"{device}:{probe_mib}"
    if key not in _measured:
        _measured[key] = _measure(device, probe_mib)
    return _measured[key]


def _best_seconds(fn: object, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        best = min(best, time.perf_counter() - t0)
    return best


def _measure(device: str, probe_mib: int) -> Costs:
    from fluxion_lite.hostkv import native

    buf = np.ones(probe_mib << 20, np.uint8)  # written once so every page is faulted in before timing
    read_s = _best_seconds(lambda: native.read_bandwidth_probe(buf, 1), 3)
    tiny = np.ones(4096, np.uint8)
    call_s = _best_seconds(lambda: native.read_bandwidth_probe(tiny, 1), 20)  # pool dispatch round trip
    read_gbs = buf.nbytes / read_s / 1e9
    h2d_gbs: float | None = None
    h2d_fixed = 0.0
    if device.startswith("cuda"):
        import torch

        src = torch.empty(probe_mib << 20, dtype=torch.uint8, pin_memory=True)
        dst = torch.empty_like(src, device=device)
        small_src, small_dst = src[:4096], dst[:4096]

        def copy(a: torch.Tensor, b: torch.Tensor) -> None:
            b.copy_(a, non_blocking=True)
            torch.cuda.synchronize(device)

        copy(src, dst)  # warm-up (context, DMA mappings)
        h2d_gbs = src.numel() / _best_seconds(lambda: copy(src, dst), 3) / 1e9
        h2d_fixed = _best_seconds(lambda: copy(small_src, small_dst), 10)
        del src, dst
    return Costs(cpu_gbs=read_gbs * CPU_ATTN_EFFICIENCY, gather_gbs=read_gbs * GATHER_EFFICIENCY, h2d_gbs=h2d_gbs,
                 cpu_fixed_s=call_s, gather_fixed_s=call_s, h2d_fixed_s=h2d_fixed)
