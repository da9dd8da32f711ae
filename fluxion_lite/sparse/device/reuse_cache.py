"""Reuse cache of the fused device step: blocks read over PCIe at one step, kept in device memory for the next.

Why: with the pin cache (pin_pool.py) the pinned three quarters of each retrieval budget are read from device memory;
the other quarter, chosen by top-k at every step, still crosses PCIe and is the largest sparse item of the step
(H200, 8B shape, 32K b1: block_attention ~35 us per layer, PCIe-bound). Consecutive decode steps choose mostly the
same blocks (bench/select_reuse.py measures by how much on a real model), so each (layer, row, group) keeps the
blocks it read in C entries of device memory and reads only blocks new to it.

Bookkeeping runs inside the step's graph, in device_topk.select_top (per row: hits; the misses, in block order,
take the entries not read this step in turn from a rotating cursor, evicting what those held; misses beyond them
are read but not kept) and device_kernels.block_attention (hits read from their entry, kept misses written to
theirs). An entry keeps its block until a miss needs it: on the 0.5b model 69% of a step's non-pinned blocks
were read the step before, 85% within the last four steps, 93% at any earlier step (bench/select_reuse.py), so
keeping blocks that drop out for a step or two pays. Per layer:

  held   int32 [B, Hkv, NB]           entry holding each block, -1 if none
  owner  int32 [B, Hkv, C_l]          block each entry holds, -1 if none (held and owner mirror each other)
  cursor int32 [B, Hkv]               entry the next miss tries first (entries are refilled in turn)
  kv     store dtype [B, Hkv, C_l, 2, g, D]   the entries' K then V

State is per batch row, so it is cleared whenever the step's sequences change (a row's blocks belong to its
sequence); the cache refills in one step. A layer's entries C_l are a share (REUSE_SHARE) of its widest top-k:
pinned blocks never take an entry, and budgets differ by layer (sized by the model's widest group, the 8B shape's
cache held 268 MB per row at 32K). FLUXION_REUSE_CACHE=0 turns it off.
"""
from __future__ import annotations

import logging
import math
from collections import deque

import torch

from fluxion_lite.sparse.device.kernels import pow2
from fluxion_lite.sparse.device.topk import ReuseViews
from fluxion_lite.settings import ExperimentalSettings, Settings

log = logging.getLogger(__name__)

# entries per (layer, row, group), as a share of the layer's widest top-k (pins: 0.75 of it); the setting's default
REUSE_SHARE = ExperimentalSettings.reuse_share
FREE_MEMORY_SHARE = 0.25  # the cache may take at most this share of the free device memory, else it stays off


def reuse_share(settings: Settings | None = None) -> float:
    """Entries per (layer, row, group) as a share of the layer's widest top-k: the setting FLUXION_REUSE_SHARE (for
    A/B runs; settings.experimental.reuse_share, default REUSE_SHARE; None: Settings.load())."""
    return (settings if settings is not None else Settings.load()).experimental.reuse_share


def _entries(width: int, share: float | None = None) -> int:
    return max(1, math.ceil((reuse_share() if share is None else share) * width))


def _layout_bytes(layout: dict[object, tuple[tuple[int, ...], torch.dtype, int | None]]) -> int:
    return sum(math.prod(size) * dtype.itemsize for size, dtype, _ in layout.values())


class DeviceReuseCache:
    """One reuse cache per device-graphed backend, shaped for the current step structure."""

    def __init__(self, n_layers: int, hkv: int, g: int, d: int, dtype: torch.dtype, device: torch.device,
                 share: float | None = None):
        """share: entries as a share of each layer's widest top-k (None: reuse_share(), the setting)."""
        self.n_layers, self.hkv, self.g, self.d, self.dtype, self.device = n_layers, hkv, g, d, dtype, device
        self.share = reuse_share() if share is None else share
        self.shape: tuple[int, int, tuple[int, ...]] = (0, 0, ())  # (batch, blocks, each layer's top-k width)
        self.serial = 0  # bumped on every reallocation: part of the decode graphs' key
        self.enabled = True
        self.rows_key: tuple[object, ...] = ()
        self.hits_read = 0  # hits already counted by take_hits()
        # snapshot_hits' copies of the counter (host tensor, its event on CUDA), oldest first
        self._snapshots: deque[tuple[torch.Tensor, torch.cuda.Event | None]] = deque()
        # "held", "cursor", "scratch", "entry", "hit", "hits", and per layer ("owner", l), ("kv", l): see _layout
        self._tensors: dict[object, torch.Tensor] = {}

    def ensure(self, batch: int, n_blocks: int, widths: tuple[int, ...]) -> bool:
        """Tensors for a step of `batch` rows, `n_blocks` blocks and each layer's top-k width (0: no retrieval);
        False when the cache does not fit in device memory (it then stays off)."""
        if not self.enabled or max(widths, default=0) <= 0:
            return False
        shape = (batch, n_blocks, tuple(widths))
        if shape == self.shape:
            return True
        self._tensors.clear()  # the old structure's memory first
        layout = self._layout(shape)
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            need = _layout_bytes(layout)
            if need > FREE_MEMORY_SHARE * free:
                log.warning("reuse cache off: %.2f GB would exceed %.0f%% of the free device memory (%.2f GB)",
                            need / 1e9, 100 * FREE_MEMORY_SHARE, free / 1e9)
                self.enabled = False
                self.shape = (0, 0, ())
                return False
        self._tensors = {name: (torch.empty(size, dtype=dtype, device=self.device) if fill is None else
                                torch.full(size, fill, dtype=dtype, device=self.device))
                         for name, (size, dtype, fill) in layout.items()}
        self.shape = shape
        self.serial += 1
        self.rows_key = ()
        self.hits_read = 0
        self._snapshots.clear()  # totals of the old counter (a step's hits go uncounted)
        return True

    def _layout(self, shape: tuple[int, int, tuple[int, ...]]
                ) -> dict[object, tuple[tuple[int, ...], torch.dtype, int | None]]:
        """Every tensor of a structure: name -> (size, dtype, initial value or None for uninitialised)."""
        batch, n_blocks, widths = shape
        L, B, H = self.n_layers, batch, self.hkv
        entries = [_entries(w, self.share) for w in widths]
        layout: dict[object, tuple[tuple[int, ...], torch.dtype, int | None]] = {
            "held": ((L, B, H, n_blocks), torch.int32, -1),
            "cursor": ((L, B, H), torch.int32, 0),
            "scratch": ((B * H * 2 * pow2(max(entries)),), torch.int32, None),
            "entry": ((B * H * max(widths),), torch.int32, -1),
            "hit": ((B * H * max(widths),), torch.int8, 0),
            "hits": ((1,), torch.int64, 0),
        }
        for layer, c in enumerate(entries):  # each layer's entries: a share of its own top-k width
            layout[("owner", layer)] = ((B, H, c), torch.int32, -1)
            layout[("kv", layer)] = ((B, H, c, 2, self.g, self.d), self.dtype, None)
        return layout

    def bytes_for(self, shape: tuple[int, int, tuple[int, ...]]) -> int:
        return _layout_bytes(self._layout(shape))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors.values())

    def start_step(self, rows_key: tuple[object, ...]) -> None:
        """Before a step (outside the graph): a change of the rows' sequences clears every entry."""
        if self._tensors and rows_key != self.rows_key:
            self._tensors["held"].fill_(-1)
            self._tensors["cursor"].zero_()
            for layer in range(self.n_layers):
                self.owner(layer).fill_(-1)
            self.rows_key = rows_key

    def views(self, layer: int, width: int) -> ReuseViews:
        """select_top's views for one layer whose top-k width is `width` (<= the structure's width)."""
        t = self._tensors
        B, H = self.shape[0], self.hkv
        n = B * H * width
        return ReuseViews(t["held"][layer], self.owner(layer), t["cursor"][layer], t["scratch"],
                          t["entry"][:n].view(B, H, width), t["hit"][:n].view(B, H, width), t["hits"])

    def owner(self, layer: int) -> torch.Tensor:
        return self._tensors[("owner", layer)]

    def kv(self, layer: int) -> torch.Tensor:
        return self._tensors[("kv", layer)]

    def snapshot_hits(self) -> None:
        """Queue a copy of the hit counter as the queued steps leave it (CUDA: into pinned memory, with an event), so
        take_hits reads it without waiting for the device."""
        if not self._tensors:
            return
        hits = self._tensors["hits"]
        if self.device.type != "cuda":
            self._snapshots.append((hits.clone(), None))
            return
        host = torch.empty(1, dtype=torch.int64, pin_memory=True)
        host.copy_(hits, non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        self._snapshots.append((host, done))

    def take_hits(self) -> int:
        """Blocks read from the cache since the last call, as of the newest snapshot whose copy has landed (never
        waits); without snapshots, the device counter itself (which waits for the queued steps)."""
        if not self._tensors:
            return 0
        total = -1
        if not self._snapshots:
            total = int(self._tensors["hits"].item())
        while self._snapshots and (self._snapshots[0][1] is None or self._snapshots[0][1].query()):
            total = int(self._snapshots.popleft()[0].item())
        if total < 0:
            return 0
        new, self.hits_read = total - self.hits_read, total
        return new


class PolicyModel:
    """One (layer, row, group)'s cache in plain Python, step for step what device_topk's kernel does: an entry keeps
    its block until a miss needs it; misses (in block order) take the entries not read this step in turn from a
    rotating cursor. tests/test_reuse_cache.py holds the kernel to it; bench/select_reuse.py runs it on real
    models' choices to give the hit rate of a cache of a given size."""

    def __init__(self, entries: int):
        self.held: dict[int, int] = {}  # block -> entry
        self.owner = [-1] * entries  # entry -> block
        self.cursor = 0

    def step(self, chosen: list[int], cacheable: set[int]) -> tuple[dict[int, int], set[int]]:
        """chosen blocks -> (entry per chosen block or -1, blocks read from the cache)."""
        c = len(self.owner)
        dynamic = sorted(b for b in chosen if b in cacheable)
        hits = {b for b in dynamic if b in self.held}
        busy = {self.held[b] for b in hits}
        turns = [(p, (self.cursor + p) % c) for p in range(c) if (self.cursor + p) % c not in busy]
        entry = {b: -1 for b in chosen}
        for b in hits:
            entry[b] = self.held[b]
        misses = [b for b in dynamic if b not in hits]
        for b, (_, e) in zip(misses, turns):
            if self.owner[e] >= 0:
                del self.held[self.owner[e]]
            self.held[b], self.owner[e], entry[b] = e, b, e
        n_fill = min(len(misses), len(turns))
        if n_fill:
            self.cursor = (self.cursor + turns[n_fill - 1][0] + 1) % c
        return entry, hits
