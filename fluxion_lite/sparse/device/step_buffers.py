"""DeviceStep: the tensors a captured device-selection decode step (device_graph.py) addresses, per step structure.

A structure is (batch, each (layer, group)'s block count k_cap, blocks scanned, page-table width): the graphs are
captured per structure and replay against these buffers, which begin() refills in place every step. Kept apart from
device_graph.py, which drives the step, so that each reads in one sitting.
"""
from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import numpy as np
import torch

from fluxion_lite.sparse.device import kernels as device_kernels

from fluxion_lite.hostkv import native

if TYPE_CHECKING:
    from fluxion_lite.sparse.backend import SparseAttention

_serials = itertools.count()  # names a DeviceStep in graph keys (an id() could be reused after one is dropped)


class DeviceStep:
    """Per step structure (batch, k_cap per (layer, group), blocks scanned): the tensors the graphs address."""

    def __init__(self, owner: SparseAttention, batch: int, k_cap: np.ndarray, n_blocks: int, page_cap: int,
                 fused: bool):
        cfg, dev, store = owner.cfg, owner.device, owner.store
        hkv, d, n_layers = cfg.n_kv_heads, cfg.head_dim, cfg.n_layers
        cuda = dev.type == "cuda"
        self.batch, self.n_blocks, self.k_cap = batch, n_blocks, k_cap  # k_cap: int64 [L, Hkv], 0 = no task
        self.serial = next(_serials)
        # The step's integer inputs in one tensor, so begin() moves them in one asynchronous copy (they were six
        # copies, two of them pageable ones that wait for the device): views of it, in this order
        self.background = owner.plan.background != "off"  # the unread-background term (device_background.py)
        per_group = n_layers * batch * hkv
        self.ints = torch.zeros(5 * batch + per_group * (3 if self.background else 1), dtype=torch.long, device=dev)
        self.slots = self.ints[:batch]  # [B] store slots = rows of the device slab
        self.pos = self.ints[batch: 2 * batch]  # [B] the new token's position
        self.ring = self.ints[2 * batch: 3 * batch]  # [B] its slot in the ring
        self.bounds = self.ints[3 * batch: 5 * batch].view(2, batch)  # [2, B] eligible blocks [lo, hi)
        self.k_row = self.ints[5 * batch: 5 * batch + per_group].view(n_layers, batch, hkv)  # [L, B, Hkv]: k
        # with the term: each (layer, row, group)'s background candidates, 16-token blocks [lo, hi) ([2, L, B, Hkv])
        self.bg_bounds = (self.ints[5 * batch + per_group:].view(2, n_layers, batch, hkv) if self.background
                          else None)
        ltot = owner.state.sink_cap + owner.state.ring_cap
        self.bias = torch.zeros(owner.state.bias_rows, batch, ltot, dtype=torch.float32, device=dev)  # [G, B, Ltot]
        self.pinned = torch.zeros(n_layers, batch, hkv, n_blocks, dtype=torch.bool, device=dev)  # [L, B, Hkv, NB]
        # per layer: each page's first chunk in the zero-copy span, rows = store slots (static copies of the
        # feeder's tables, refreshed in place when the store's page tables change)
        self.tables = torch.zeros(n_layers, store.max_seqs, page_cap, dtype=torch.long, device=dev)
        self.table_slabs = -1  # the store's slab_version and layer_version [L] that tables were copied at
        self.table_versions = np.full(n_layers, -1, np.int64)
        # per layer: the flat block list, entry i = rank flat_j[i] of group flat_h[i] (k_cap entries per group)
        self.flat: list[tuple[int, torch.Tensor, torch.Tensor] | None] = []  # (top-k width, flat_h, flat_j)
        caps = np.minimum(k_cap, n_blocks)  # [L, Hkv]: ranks each group fetches
        for layer in range(n_layers):
            if not caps[layer].any():
                self.flat.append(None)
                continue
            flat_h = np.repeat(np.arange(hkv), caps[layer])
            flat_j = np.concatenate([np.arange(c) for c in caps[layer]])
            self.flat.append((int(caps[layer].max()), torch.from_numpy(flat_h).to(dev),
                              torch.from_numpy(flat_j).to(dev)))
        self.fetched_blocks = int(caps.sum()) * batch  # per step, over PCIe, on the torch path (masked ranks too)
        r = owner.r
        if fused:  # device_kernels: per layer each group's slice of the flat list, and buffers reused by all layers
            self.caps = torch.from_numpy(caps.astype(np.int64)).to(dev)  # [L, Hkv]
            self.starts = torch.from_numpy((np.cumsum(caps, axis=1) - caps).astype(np.int64)).to(dev)
            n_max = max(1, int(caps.sum(1).max()))
            self.scores = torch.empty(batch, hkv, n_blocks, dtype=torch.float32, device=dev)
            width_max = max(1, int(caps.max()))  # each layer's chosen blocks: a [B, Hkv, width] view of these
            self.top_ids = torch.zeros(batch * hkv * width_max, dtype=torch.long, device=dev)
            self.top_vals = torch.empty(batch * hkv * width_max, dtype=torch.float32, device=dev)
            self.part_o = torch.empty(batch, n_max, r, d, dtype=torch.float32, device=dev)  # [B, N, r, D]
            self.part_m = torch.empty(batch, n_max, r, dtype=torch.float32, device=dev)
            self.part_l = torch.empty(batch, n_max, r, dtype=torch.float32, device=dev)
            self.out = torch.empty(n_layers, batch, hkv, r, d, dtype=owner.dtype, device=dev)  # per layer: merged
            splits = device_kernels.stream_splits(owner.state.sink_cap + owner.state.ring_cap)  # any layer's streaming partials
            self.stream_o = torch.empty(batch, hkv, splits, r, d, dtype=torch.float32, device=dev)
            self.stream_m = torch.empty(batch, hkv, splits, r, dtype=torch.float32, device=dev)
            self.stream_l = torch.empty(batch, hkv, splits, r, dtype=torch.float32, device=dev)
        else:  # the torch ops path: the retrieval part, merged in the epilogue with each layer's streaming part
            self.o_ret = torch.zeros(batch, hkv, r, d, dtype=torch.float32, device=dev)
            self.lse_ret = torch.full((batch, hkv, r), float("-inf"), dtype=torch.float32, device=dev)
            self.out_s: list[torch.Tensor | None] = [None] * n_layers
            self.lse_s: list[torch.Tensor | None] = [None] * n_layers
        # every layer's new K/V for the host store: staged on the device, one D2H per step into pinned rows. Two
        # sets of host rows, used in turn: a step's rows are appended to the store during the next step (end()),
        # while that step's D2H goes to the other set.
        self.stage = torch.zeros(n_layers, batch, 2, hkv, d, dtype=store.dtype, device=dev)  # [L, B, 2, Hkv, D]
        self.kv_host = [torch.zeros(n_layers, batch, 2, hkv, d, dtype=store.dtype, pin_memory=cuda) for _ in range(2)]
        self.slots32 = [np.zeros(batch, np.int32) for _ in range(2)]  # the store slots of each set's rows
        self.appenders: list[list[native.PreparedAppend]] = []
        for kv_host, slots32 in zip(self.kv_host, self.slots32):
            # per layer, viewed as rows of [Hkv, D]: row 2b is batch row b's k, row 2b + 1 its v
            rows = [kv_host[layer].view(2 * batch, hkv, d) for layer in range(n_layers)]
            self.appenders.append([native.PreparedAppend(store.view(0), slots32, np.arange(batch) * 2,
                                                         r[: 2 * batch - 1], r[1:]) for r in rows])
        self.buf = 0  # the set of host rows this step's D2H fills
        self.pins_key: tuple[object, ...] = ()
        self.pin_count = np.zeros((n_layers, batch, hkv), np.int64)  # pinned blocks per (layer, row, group)
        # with the pin cache: each pinned block's entry in the pool (pin_pool.py), -1 when not cached
        self.pin_slot = torch.full((n_layers, batch, hkv, n_blocks), -1, dtype=torch.int32, device=dev)
        self.pin_index_key: tuple[object, ...] = ()  # what pin_slot was last built for (DevicePinPool.index)
