"""The device pin cache: the running sequences' pinned blocks in device memory, so PCIe carries the dynamic ones only.

Pinned blocks (pinned.py) are chosen once, at the end of a prompt, and top-k takes them at every step. Here they are
copied to the device once per sequence and read from there by device_kernels.block_attention.

- One pool `kv` [P, 2, g, D] (store dtype) for every layer, KV head and sequence: budgets differ by layer and group,
  so anything padded to the busiest one holds several times the pins (3.6x for per-layer pools on the 8B shape).
- Entries belong to host-store slots, not batch rows: a sequence keeps its entries while others end, arrive or move
  to another row, so a change of the batch copies the new sequence's pins only (a whole refill was one PCIe read of
  every running sequence's pins: ~2 GB at 32K batch 16 on the 8B shape). A slot gives its entries back when it
  leaves the batch or its pins change (PinnedBlocks.slot_version).
- The pool grows (a copy on the device, and a new `serial`, so graphs that address it are captured again) when the
  free entries run short; never beyond `share` of the free device memory: past that it is dropped for good and
  every block goes over PCIe (logged once).

Per step: reserve() in the step's prepare (before the graph key is taken: it may grow the pool), fill() in begin()
once the page tables are on the device (the PCIe reads of the new slots' blocks), index() to point a step
structure's [L, B, Hkv, NB] table at the rows' entries.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import numpy as np
import torch

from fluxion_lite.hostkv.store import CHUNK_TOKENS
from fluxion_lite.plan.pins import PinnedBlocks

log = logging.getLogger(__name__)


@dataclass
class SlotEntries:
    """One slot's pins and the pool entries holding them (int64 [M] each, layer-major as PinnedBlocks.slot_blocks)."""
    version: int
    layer: np.ndarray
    head: np.ndarray
    block: np.ndarray
    entry: np.ndarray
    serial: int  # names this assignment (index() keys on it)
    filled: bool = False


def span_kv_rows(tables: torch.Tensor, slot_of: torch.Tensor, heads: torch.Tensor, blocks: torch.Tensor, g: int,
                 page_tokens: int, n_kv_heads: int) -> torch.Tensor:
    """Rows of the zero-copy span (CHUNK_TOKENS tokens of one head each) holding g-token blocks: tables [S, pages]
    (each page's first row in the span, zero_copy.py); slot_of, heads, blocks: the same shape [...] (a block's
    sequence slot, KV head, block id) -> int64 [2 * numel * g / CHUNK_TOKENS]: every block's K rows in order, then
    their V rows, so `span.index_select(0, rows).view(2, *blocks.shape, g, D)` reads them. A page keeps its K
    chunks head-major ([Hkv][P / CHUNK_TOKENS] rows), its V chunks after them. device_kernels'
    _block_attention_kernel computes the same offsets for the rows it reads."""
    cph, cpb = page_tokens // CHUNK_TOKENS, g // CHUNK_TOKENS  # chunks per head in a page, per block
    tok = blocks[..., None] * g + torch.arange(cpb, device=blocks.device) * CHUNK_TOKENS  # [..., cpb] chunk starts
    page = torch.div(tok, page_tokens, rounding_mode="floor").clamp_(max=tables.shape[1] - 1)
    k_rows = tables[slot_of[..., None], page] + heads[..., None] * cph + (tok % page_tokens) // CHUNK_TOKENS
    k_rows = k_rows.reshape(-1)  # [numel * cpb]
    return torch.cat([k_rows, k_rows + n_kv_heads * cph])


class DevicePinPool:
    def __init__(self, g: int, n_kv_heads: int, head_dim: int, page_tokens: int, dtype: torch.dtype,
                 device: torch.device, share: float):
        self.g, self.hkv, self.d, self.page_tokens = g, n_kv_heads, head_dim, page_tokens
        self.dtype, self.device, self.share = dtype, device, share
        self.enabled = True
        self.kv: torch.Tensor | None = None  # [P, 2, g, D]
        self.serial = 0  # bumped when kv is reallocated (or dropped)
        self._free = np.zeros(0, np.int64)  # free entries, taken from the end
        self.held: dict[int, SlotEntries] = {}
        self._assignments = 0
        self._key: tuple[object, ...] = ()
        self.blocks_copied = 0  # every block fill() has read over PCIe (tests check that a batch change is cheap)

    def nbytes(self) -> int:
        return 0 if self.kv is None else self.kv.numel() * self.kv.element_size()

    # ---- prepare: entries, and room ---------------------------------------------------------------------------
    def reserve(self, pins: PinnedBlocks, slots: np.ndarray) -> None:
        """Entries for the pins of the rows' slots (int [B]); slots that left the rows, or whose pins changed, give
        theirs back first. May grow the pool (a new serial) or drop it (enabled turns False)."""
        key = (tuple(slots.tolist()), pins.version)
        if not self.enabled or key == self._key:  # a step's usual case: nothing new
            return
        self._key = key
        rows = set(slots.tolist())
        for slot in [s for s, e in self.held.items() if s not in rows or e.version != pins.slot_version(s)]:
            self._free = np.concatenate([self._free, self.held.pop(slot).entry])
        new = {s: pins.slot_blocks(s) for s in rows if s not in self.held}
        need = sum(len(b[0]) for b in new.values())
        if need > len(self._free) and not self._grow(need - len(self._free)):
            return
        for slot, (layer, head, block) in new.items():
            m = len(layer)
            entry, self._free = self._free[len(self._free) - m :], self._free[: len(self._free) - m]
            self._assignments += 1
            self.held[slot] = SlotEntries(pins.slot_version(slot), layer, head, block, entry, self._assignments)

    def _grow(self, more: int) -> bool:
        old = 0 if self.kv is None else self.kv.shape[0]
        cap = -(-(old + more + (old + more) // 4) // 256) * 256  # a quarter spare: the next arrival fits
        nbytes = cap * 2 * self.g * self.d * self.dtype.itemsize
        free = (torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda"  # CPU "device" (tests): RAM
                else os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        try:
            if nbytes > self.share * (free + self.nbytes()):
                raise torch.cuda.OutOfMemoryError(f"{nbytes / 2**20:.0f} MiB > {self.share:.0%} of "
                                                  f"{(free + self.nbytes()) / 2**20:.0f} MiB free")
            grown = torch.empty(cap, 2, self.g, self.d, dtype=self.dtype, device=self.device)
        except torch.cuda.OutOfMemoryError as e:
            log.warning("device pin cache left out (every block over PCIe from now on): %s", e)
            self.enabled, self.kv, self.held, self._free = False, None, {}, np.zeros(0, np.int64)
            self.serial += 1
            return False
        if self.kv is not None:
            grown[:old] = self.kv  # held entries keep their place
        self.kv = grown
        self._free = np.concatenate([np.arange(cap - 1, old - 1, -1), self._free])  # old free ones are taken first
        self.serial += 1
        return True

    # ---- begin: copies, and the step's index ------------------------------------------------------------------
    def fill(self, span: torch.Tensor, tables: torch.Tensor) -> None:
        """Copy the blocks of slots assigned since the last fill from the host store through the zero-copy span
        ([chunks, CHUNK_TOKENS * D], store dtype): one PCIe read each. tables [L, S, pages] (the step's copy)."""
        if self.kv is None:
            return
        dev, g = self.kv.device, self.g
        by_layer = tables.reshape(-1, tables.shape[2])  # [L * S, pages]: row layer * S + slot
        for slot, e in self.held.items():
            if e.filled or not len(e.entry):
                e.filled = True
                continue
            layer_t, head_t, block_t, entry_t = (torch.from_numpy(x).to(dev) for x in (e.layer, e.head, e.block,
                                                                                         e.entry))
            rows = span.index_select(0, span_kv_rows(by_layer, layer_t * tables.shape[1] + slot, head_t, block_t,
                                                     g, self.page_tokens, self.hkv))  # [2 * M * cpb, CHUNK * D]
            self.kv[entry_t] = rows.view(2, len(e.entry), g, self.d).transpose(0, 1)  # [M, 2, g, D]
            self.blocks_copied += len(e.entry)
            e.filled = True

    def index(self, pin_slot: torch.Tensor, slots: np.ndarray, key: tuple[object, ...]) -> tuple[object, ...]:
        """Point pin_slot [L, B, Hkv, NB] int32 (a step structure's) at the entries of the rows' slots (-1: not
        cached). Returns the key it was built for; pass the previous one back to skip an unchanged rebuild."""
        now = (tuple(slots.tolist()), self.serial,
               tuple(e.serial if (e := self.held.get(s)) is not None and e.filled else -1 for s in slots.tolist()))
        if now == key:
            return key
        pin_slot.fill_(-1)
        nb = pin_slot.shape[3]
        parts = [(e.layer, np.full(len(e.layer), row), e.head, e.block, e.entry)
                 for row, s in enumerate(slots.tolist()) if (e := self.held.get(s)) is not None and e.filled]
        if parts and self.kv is not None:
            layer, row, head, block, entry = (np.concatenate(x) for x in zip(*parts))
            keep = block < nb
            idx = tuple(torch.from_numpy(x[keep]).to(pin_slot.device) for x in (layer, row, head, block))
            pin_slot[idx] = torch.from_numpy(entry[keep].astype(np.int32)).to(pin_slot.device)
        return now

