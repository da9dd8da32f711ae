"""Host-memory KV store in the native library's page layout (native/fluxion.h), with Quest-style block summaries.

One page = P tokens of one layer for all KV heads of one sequence: K [Hkv, P, D], V [Hkv, P, D] (fp16/bf16), then
min/max summaries [Hkv, P/g, 2, D] in the same 16-bit dtype (exact: min and max of 16-bit values are 16-bit
values) for each kept granularity g, and with value_sums the fp32 sums of each 128-token block's values (what the
unread-background term reads, native.background).  Pages are carved out of large slabs (one
torch allocation each, pinned when CUDA is available): pinning once per slab instead of once per page keeps torch's
pinned allocator from rounding every 1.12 MiB page up to 2 MiB, and lets the GPU read the pages in place through one
alias per slab (fluxion_lite/sparse/zero_copy.py).  Pages sit at a fixed stride inside a slab and never straddle two slabs;
the stride is aligned so that every 16-token chunk of a head starts at a multiple of its own size from any page
(what the GPU gather indexes by).  A sequence grows by one page at a time, capacity grows by adding a slab, and
nothing already stored moves.  Page tables (uint64 addresses) and token counts live in numpy arrays that the C
kernels read in place.
"""
from __future__ import annotations

import math
import mmap
import warnings
from typing import Sequence

import numpy as np
import torch

from fluxion_lite.hostkv import native
from fluxion_lite.errors import CapacityError
from fluxion_lite.settings import Settings


CHUNK_TOKENS = 16  # the GPU gather's unit: the smallest granularity, so every block is whole chunks
DEFAULT_SLAB_BYTES = 256 << 20


def page_stride(page_bytes: int, head_dim: int) -> int:
    """Bytes from one page to the next inside a slab: page_bytes rounded up so that page starts stay aligned to a
    16-token chunk of one head (16 * D * 2 bytes) and to 256 bytes.  For the Llama-3.1-8B shape (1.12 MiB pages) the
    rounding is 0 bytes."""
    align = math.lcm(256, CHUNK_TOKENS * head_dim * 2)
    return -(-page_bytes // align) * align


HUGE_PAGE = 2 << 20


def _huge_page_slab(size: int, wanted: bool = True) -> torch.Tensor | None:
    """A slab in anonymous memory that asks for transparent huge pages (madvise), 2 MiB aligned; None where that is
    unavailable or not wanted (FLUXION_HUGEPAGES=0). Block-sparse reads touch a new 4 KiB page every few blocks: with
    2 MiB pages the page walks go, worth +11-15% of single-thread kernel bandwidth on the VM (docs/native.md).
    Pinned (CUDA) slabs keep torch's allocator."""
    if not wanted or not hasattr(mmap, "MADV_HUGEPAGE") or size < HUGE_PAGE:
        return None
    try:
        region = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        region.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError):
        return None
    with warnings.catch_warnings():  # frombuffer warns on any writable buffer; the tensor keeps the mapping alive
        warnings.simplefilter("ignore")
        whole = torch.frombuffer(region, dtype=torch.uint8)
    offset = (-whole.data_ptr()) % HUGE_PAGE
    return whole[offset : offset + size]


class HostKVStore:
    """Paged host KV cache for n_layers x n_kv_heads x head_dim, up to max_seqs sequences (slots).

    slab_bytes: largest slab (a power of two: torch's pinned allocator rounds sizes up to one); the first slabs are
    smaller and each new one doubles the capacity until that size.  max_bytes: bound on the bytes of all slabs
    (None: no bound); growing past it raises CapacityError.  hugepages: unpinned slabs ask for transparent huge pages
    (None: the setting FLUXION_HUGEPAGES, read now)."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, *, dtype: torch.dtype = torch.bfloat16,
                 max_seqs: int = 16, page_tokens: int = 256, granularities: Sequence[int] = (16, 32, 64, 128),
                 pin_memory: bool | None = None, initial_pages_per_seq: int = 4,
                 slab_bytes: int = DEFAULT_SLAB_BYTES, max_bytes: int | None = None,
                 value_sums: bool = False, hugepages: bool | None = None) -> None:
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype}")
        for name, value in (("n_layers", n_layers), ("n_kv_heads", n_kv_heads), ("max_seqs", max_seqs)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        native.gran_mask(granularities)  # validates
        self.n_layers, self.n_kv_heads, self.head_dim = n_layers, n_kv_heads, head_dim
        self.dtype, self.max_seqs, self.page_tokens = dtype, max_seqs, page_tokens
        self.granularities = tuple(sorted(set(granularities)))
        self.value_sums = value_sums
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.hugepages = Settings.load().hugepages if hugepages is None else hugepages
        self.page_bytes = native.page_bytes(n_kv_heads, head_dim, page_tokens, self.granularities, value_sums)
        self.page_stride = page_stride(self.page_bytes, head_dim)
        self.chunk_bytes = CHUNK_TOKENS * head_dim * 2
        if slab_bytes < 1 or slab_bytes & (slab_bytes - 1):
            raise ValueError(f"slab_bytes must be a power of two, got {slab_bytes}")
        # a slab must hold a page even after aligning its first page (its base is only 4 KiB aligned)
        self.max_slab_bytes = max(slab_bytes, 1 << (2 * self.page_stride - 1).bit_length())
        self.max_bytes = max_bytes
        # slabs: uint8 tensors; _slab_pages[i] = (address of page 0, pages in slab i); page id = (slab, index)
        self.slabs: list[torch.Tensor] = []
        self._slab_pages: list[tuple[int, int]] = []
        self._free_pages: list[tuple[int, int]] = []  # a stack: the lowest addresses of a new slab come out first
        self.slab_version = 0  # bumped when a slab is added (the GPU alias of the slabs must be rebuilt)
        self.layer_version = np.zeros(n_layers, np.int64)  # bumped when a layer's page table changes
        # pages_table: [L, S, max_pages] addresses; n_tokens_table: [L, S]; page tensors kept alive in _pages.
        self._max_pages = max(1, initial_pages_per_seq)
        self._pages_table = np.zeros((n_layers, max_seqs, self._max_pages), np.uint64)
        self._n_tokens = np.zeros((n_layers, max_seqs), np.int64)
        self._pages: list[list[list[torch.Tensor]]] = [[[] for _ in range(max_seqs)] for _ in range(n_layers)]
        self._page_ids: list[list[list[tuple[int, int]]]] = [[[] for _ in range(max_seqs)] for _ in range(n_layers)]
        self._free_slots = list(range(max_seqs - 1, -1, -1))
        self._in_use: set[int] = set()
        self._views: list[native.KVView] = []
        self._rebuild_views()  # also checks head_dim / page_tokens

    # ---- slots ----

    def allocate(self) -> int:
        """Reserve a sequence slot; raises CapacityError when all max_seqs slots are taken."""
        if not self._free_slots:
            raise CapacityError(f"host KV store is full ({self.max_seqs} sequences)")
        slot = self._free_slots.pop()
        self._in_use.add(slot)
        return slot

    def release(self, slot: int) -> None:
        """Free the slot's pages (all layers) and make the slot reusable."""
        self._check_slot(slot)
        for layer in range(self.n_layers):
            self._pages[layer][slot] = []
            # reversed, so the next pop hands the same pages back in order (a reused slot keeps its locality)
            self._free_pages.extend(reversed(self._page_ids[layer][slot]))
            self._page_ids[layer][slot] = []
        self.layer_version += 1
        self._pages_table[:, slot, :] = 0
        self._n_tokens[:, slot] = 0
        self._in_use.discard(slot)
        self._free_slots.append(slot)

    def n_tokens(self, layer: int, slot: int) -> int:
        return int(self._n_tokens[layer, slot])

    @property
    def bytes_used(self) -> int:
        """Bytes held by allocated pages (K, V and summaries)."""
        return self.page_bytes * sum(len(p) for layer in self._pages for p in layer)

    @property
    def bytes_reserved(self) -> int:
        """Bytes of all slabs (pages in use, free pages, alignment): the host RAM the store holds."""
        return sum(s.numel() for s in self.slabs)

    def page_table(self, layer: int) -> np.ndarray:
        """uint64 [max_seqs, max_pages] page addresses of a layer (0: none); replaced when the table widens."""
        return self._pages_table[layer]

    def page_addresses(self) -> list[tuple[int, int]]:
        """(address of page 0, page count) per slab; pages follow at page_stride."""
        return list(self._slab_pages)

    # ---- writing ----

    def append(self, layer: int, slot: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append a prefill chunk or decode token(s) of one sequence: k, v [T, Hkv, D]."""
        rows = k.shape[0] if isinstance(k, torch.Tensor) and k.dim() == 3 else 0  # bad shapes: append_batch says why
        self.append_batch(layer, [slot], k, v, counts=[rows])

    def append_batch(self, layer: int, slots: Sequence[int], k: torch.Tensor, v: torch.Tensor,
                     counts: Sequence[int] | None = None) -> None:
        """Append to several sequences in one native call: k, v [sum(counts), Hkv, D], rows in slot order.

        counts defaults to one token per slot (a decode step).  Summaries of every kept g are updated incrementally.
        """
        self._check_layer(layer)
        slots_a = np.asarray(slots, dtype=np.int64).reshape(-1)
        for s in slots_a:
            self._check_slot(int(s))
        k, v = self._prepare(k, "k"), self._prepare(v, "v")
        counts_a = np.ones(len(slots_a), np.int64) if counts is None else np.asarray(counts, np.int64).reshape(-1)
        if counts_a.shape != slots_a.shape or (counts_a < 0).any():
            raise ValueError(f"counts must be {len(slots_a)} non-negative ints, got {counts_a.tolist()}")
        if k.shape != v.shape:
            raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
        if k.shape[0] != counts_a.sum():
            raise ValueError(f"k has {k.shape[0]} rows, counts add up to {int(counts_a.sum())}")
        old_len = self._n_tokens[layer, slots_a]
        new_len = old_len + counts_a
        # only rows that cross into a page their length did not need yet (most decode rows do not): one numpy test
        # instead of a Python call per row; pages reserved ahead make the call a no-op
        for i in np.flatnonzero(-(-new_len // self.page_tokens) > -(-old_len // self.page_tokens)).tolist():
            self._ensure_pages(layer, int(slots_a[i]), int(new_len[i]))
        row_start = np.zeros_like(counts_a)
        row_start[1:] = np.cumsum(counts_a)[:-1]
        native.append(self._views[layer], slots_a.astype(np.int32), row_start, counts_a, k, v)

    def reserve_decode(self, slots: np.ndarray, ahead: int = 1) -> None:
        """Pages for `ahead` more tokens of each slot (int64 [B], allocated) in every layer, ahead of a decode step's
        appends: those then never change a page table, so views fetched after this call stay valid for the step.
        ahead = 2 where the appends lag a step behind (device_graph.py: the step's own token and the one queued)."""
        n = self._n_tokens[:, slots]  # [L, B]
        pages = -(-n // self.page_tokens)
        for layer, i in zip(*np.nonzero(-(-(n + ahead) // self.page_tokens) > pages)):
            self._ensure_pages(int(layer), int(slots[i]), int(n[layer, i]) + ahead)

    # ---- what the kernels need ----

    def view(self, layer: int) -> native.KVView:
        """The layer's native view.  Re-fetch after appends: growing the page table replaces it."""
        self._check_layer(layer)
        return self._views[layer]

    def read(self, layer: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy of the slot's stored K, V [n_tokens, Hkv, D] (for tests and debugging; not a hot path)."""
        self._check_layer(layer)
        self._check_slot(slot)
        n, P = self.n_tokens(layer, slot), self.page_tokens
        H, D = self.n_kv_heads, self.head_dim
        ks, vs = [], []
        for page in self._pages[layer][slot]:
            kv = page[: 2 * H * P * D * 2].view(self.dtype).view(2, H, P, D)
            ks.append(kv[0].transpose(0, 1))
            vs.append(kv[1].transpose(0, 1))
        if not ks:
            empty = torch.empty(0, H, D, dtype=self.dtype)
            return empty, empty.clone()
        return torch.cat(ks)[:n].clone(), torch.cat(vs)[:n].clone()

    def summaries(self, layer: int, slot: int, g: int) -> torch.Tensor:
        """Copy of the slot's block summaries for granularity g: [Hkv, n_blocks, 2, D] (min, max) in the store's
        dtype."""
        if g not in self.granularities:
            raise ValueError(f"g={g} is not kept (kept: {self.granularities})")
        n, P, H, D = self.n_tokens(layer, slot), self.page_tokens, self.n_kv_heads, self.head_dim
        off = 2 * H * P * D * 2
        for g2 in self.granularities:
            if g2 == g:
                break
            off += H * (P // g2) * 2 * D * 2
        parts = [page[off: off + H * (P // g) * 2 * D * 2].view(self.dtype).view(H, P // g, 2, D)
                 for page in self._pages[layer][slot]]
        n_blocks = -(-n // g)
        if not parts:
            return torch.empty(H, 0, 2, D, dtype=self.dtype)
        return torch.cat(parts, dim=1)[:, :n_blocks].clone()

    def value_block_sums(self, layer: int, slot: int) -> torch.Tensor:
        """Copy of the slot's per-128-token value sums: fp32 [Hkv, n_blocks, D] (value_sums stores only)."""
        if not self.value_sums:
            raise ValueError("this store keeps no value sums (HostKVStore(value_sums=True))")
        self._check_layer(layer)
        self._check_slot(slot)
        n, P, H, D = self.n_tokens(layer, slot), self.page_tokens, self.n_kv_heads, self.head_dim
        off = native.page_bytes(H, D, P, self.granularities)  # K, V and the summaries come first
        per_page = P // native.MAX_BLOCK
        parts = [page[off: off + H * per_page * D * 4].view(torch.float32).view(H, per_page, D)
                 for page in self._pages[layer][slot]]
        if not parts:
            return torch.empty(H, 0, D)
        return torch.cat(parts, dim=1)[:, :-(-n // native.MAX_BLOCK)].clone()

    # ---- internals ----

    def _prepare(self, x: torch.Tensor, name: str) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a torch tensor, got {type(x).__name__}")
        if x.dim() != 3 or x.shape[1] != self.n_kv_heads or x.shape[2] != self.head_dim:
            raise ValueError(f"{name} must be [T, {self.n_kv_heads}, {self.head_dim}], got {tuple(x.shape)}")
        if x.dtype != self.dtype:
            raise ValueError(f"{name} has dtype {x.dtype}, the store holds {self.dtype}")
        return x.detach().to("cpu").contiguous()

    def _ensure_pages(self, layer: int, slot: int, n_tokens: int) -> None:
        need = -(-n_tokens // self.page_tokens)
        pages = self._pages[layer][slot]
        if need > self._max_pages:
            self._grow_table(need)
        if len(pages) < need:
            self.layer_version[layer] += 1
        while len(pages) < need:
            if not self._free_pages:
                self._add_slab()
            sid, i = self._free_pages.pop()
            base = self._slab_pages[sid][0] - self.slabs[sid].data_ptr() + i * self.page_stride
            page = self.slabs[sid][base : base + self.page_bytes]
            self._pages_table[layer, slot, len(pages)] = page.data_ptr()
            pages.append(page)
            self._page_ids[layer][slot].append((sid, i))

    def _add_slab(self) -> None:
        """One more slab: doubles the capacity (at least 8 pages' worth) up to max_slab_bytes per slab."""
        reserved = self.bytes_reserved
        target = max(8 * self.page_stride, reserved, 2 * self.page_stride)  # 2 strides: a page fits after alignment
        size = min(self.max_slab_bytes, 1 << (target - 1).bit_length())
        smallest = 1 << (2 * self.page_stride - 1).bit_length()
        if self.max_bytes is not None and reserved + size > self.max_bytes:  # the largest slab that still fits
            room = self.max_bytes - reserved
            size = max(smallest, 1 << max(room, 1).bit_length() - 1)
        if self.max_bytes is not None and reserved + size > self.max_bytes:
            raise CapacityError(
                f"host KV store: {self.max_bytes / 2**30:.2f} GiB bound reached ({reserved / 2**30:.2f} GiB in "
                f"{len(self.slabs)} slabs, {self.bytes_used / 2**30:.2f} GiB of pages in use); another "
                f"{size / 2**20:.0f} MiB slab does not fit: fewer or shorter sequences, or a larger bound")
        try:
            # not zeroed: rows a GPU gather reads past a task's valid tokens are masked, NaN bits included
            # (hybrid.masked_attention), and zeroing 100+ GiB of slabs would cost seconds
            slab = None if self.pin_memory else _huge_page_slab(size, self.hugepages)
            if slab is None:
                slab = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin_memory)
        except RuntimeError as e:  # pinned (page-locked) memory is limited by RAM and ulimit -l
            raise CapacityError(f"host KV store: could not allocate a {size / 2**20:.0f} MiB "
                                f"{'pinned ' if self.pin_memory else ''}slab after {reserved / 2**30:.2f} GiB: {e}") from e
        addr = slab.data_ptr()
        first = (-addr) % math.lcm(256, self.chunk_bytes)  # page starts chunk-aligned in absolute address
        n = (size - first) // self.page_stride
        sid = len(self.slabs)
        self.slabs.append(slab)
        self._slab_pages.append((addr + first, n))
        self._free_pages.extend((sid, i) for i in range(n - 1, -1, -1))
        self.slab_version += 1

    def _grow_table(self, need: int) -> None:
        # Only the pointer table is copied; pages stay where they are.
        new_max = max(need, 2 * self._max_pages)
        table = np.zeros((self.n_layers, self.max_seqs, new_max), np.uint64)
        table[:, :, : self._max_pages] = self._pages_table
        self._pages_table, self._max_pages = table, new_max
        self._rebuild_views()

    def _rebuild_views(self) -> None:
        self._views = [
            native.KVView(self._pages_table[layer], self._n_tokens[layer], n_kv_heads=self.n_kv_heads,
                          head_dim=self.head_dim, page_tokens=self.page_tokens, dtype=self.dtype,
                          granularities=self.granularities, value_sums=self.value_sums)
            for layer in range(self.n_layers)
        ]

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.n_layers:
            raise ValueError(f"layer {layer} out of range [0, {self.n_layers})")

    def _check_slot(self, slot: int) -> None:
        if slot not in self._in_use:
            raise ValueError(f"slot {slot} is not allocated")
