"""Dense per-sequence KV storage on the compute device.

Each sequence owns K and V tensors [n_layers, Hkv, capacity, D]; capacity doubles when full, so appending is amortised
O(1) and memory stays proportional to the tokens actually held (no max_context x max_batch pre-allocation).
"""
from __future__ import annotations

import torch

INITIAL_CAPACITY = 256


class DenseKVCache:
    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        self.n_layers, self.n_kv_heads, self.head_dim = n_layers, n_kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self._k: dict[int, torch.Tensor] = {}  # seq_id -> [n_layers, Hkv, cap, D]
        self._v: dict[int, torch.Tensor] = {}
        self._len: dict[int, int] = {}  # tokens whose K/V are stored in every layer
        # seq_id -> per-layer [Hkv, cap, D] views of _k / _v, made once per allocation or growth, so an append
        # indexes a Python list instead of issuing a select per tensor and layer
        self._k_layers: dict[int, list[torch.Tensor]] = {}
        self._v_layers: dict[int, list[torch.Tensor]] = {}
        # the same as [1, Hkv, cap, D] (SDPA's batch dim in front), for the decode path
        self._k4: dict[int, list[torch.Tensor]] = {}
        self._v4: dict[int, list[torch.Tensor]] = {}

    def allocate(self, seq_id: int) -> None:
        if seq_id in self._k:
            raise ValueError(f"sequence {seq_id} already has a KV cache")
        shape = (self.n_layers, self.n_kv_heads, INITIAL_CAPACITY, self.head_dim)
        self._k[seq_id] = torch.empty(shape, dtype=self.dtype, device=self.device)
        self._v[seq_id] = torch.empty(shape, dtype=self.dtype, device=self.device)
        self._len[seq_id] = 0
        self._split_layers(seq_id)

    def _split_layers(self, seq_id: int) -> None:
        self._k_layers[seq_id] = list(self._k[seq_id].unbind(0))
        self._v_layers[seq_id] = list(self._v[seq_id].unbind(0))
        self._k4[seq_id] = list(self._k[seq_id].unsqueeze(1).unbind(0))
        self._v4[seq_id] = list(self._v[seq_id].unsqueeze(1).unbind(0))

    def free(self, seq_id: int) -> None:
        self._k.pop(seq_id, None)
        self._v.pop(seq_id, None)
        self._len.pop(seq_id, None)
        for views in (self._k_layers, self._v_layers, self._k4, self._v4):
            views.pop(seq_id, None)

    def truncate(self, seq_id: int, n_tokens: int) -> None:
        if not 0 <= n_tokens <= self._len[seq_id]:
            raise ValueError(f"cannot truncate sequence {seq_id} of {self._len[seq_id]} tokens to {n_tokens}")
        self._len[seq_id] = n_tokens

    def seq_len(self, seq_id: int) -> int:
        return self._len[seq_id]

    def bytes_used(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self._k.values(), *self._v.values()))

    def view(self, layer: int, seq_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of one layer as [Hkv, seq_len, D] views (no copy)."""
        n = self._len[seq_id]
        return self._k[seq_id][layer][:, :n], self._v[seq_id][layer][:, :n]

    def _ensure_capacity(self, seq_id: int, needed: int) -> None:
        cap = self._k[seq_id].shape[2]
        if needed <= cap:
            return
        new_cap = max(needed, 2 * cap)
        for store in (self._k, self._v):
            old = store[seq_id]
            grown = torch.empty(old.shape[0], old.shape[1], new_cap, old.shape[3], dtype=old.dtype, device=old.device)
            grown[:, :, :cap] = old
            store[seq_id] = grown
        self._split_layers(seq_id)

    def append(
        self, layer: int, seq_id: int, start: int, k_new: torch.Tensor, v_new: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k_new/v_new ([n, Hkv, D]) at positions start..start+n-1 of `layer`; return that layer's K, V as
        [Hkv, start+n, D] views. Positions are explicit so a re-run of a layer cannot silently shift the cache."""
        n = k_new.shape[0]
        end = start + n
        if start > self._len[seq_id] and layer == 0:
            raise ValueError(f"sequence {seq_id}: append at {start} leaves a gap after {self._len[seq_id]} tokens")
        self._ensure_capacity(seq_id, end)
        k_all, v_all = self._k_layers[seq_id][layer], self._v_layers[seq_id][layer]  # [Hkv, cap, D]
        # copy_ casts if the dtypes differ, so no separate .to() call (one dispatcher call fewer per tensor and layer)
        k_all[:, start:end].copy_(k_new.transpose(0, 1))
        v_all[:, start:end].copy_(v_new.transpose(0, 1))
        if layer == self.n_layers - 1:
            self._len[seq_id] = end
        return k_all[:, :end], v_all[:, :end]

    def decode_stack(self, seq_id: int, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Room for one new token at position `start` in every layer, written by the caller (one native call for
        the whole step): the sequence's K, V [n_layers, Hkv, cap, D] with cap > start. The token counts as stored."""
        if start > self._len[seq_id]:
            raise ValueError(f"sequence {seq_id}: append at {start} leaves a gap after {self._len[seq_id]} tokens")
        self._ensure_capacity(seq_id, start + 1)
        self._len[seq_id] = start + 1
        return self._k[seq_id], self._v[seq_id]

    def decode_slot(self, layer: int, seq_id: int, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Room for one new token at position `start` of `layer`, written by the caller (the native decode attention
        appends and attends in one call): that layer's K, V as [Hkv, cap, D] with cap > start. Counts the token as
        stored once the last layer has taken it, as append_decode does."""
        if layer == 0 and start > self._len[seq_id]:
            raise ValueError(f"sequence {seq_id}: append at {start} leaves a gap after {self._len[seq_id]} tokens")
        self._ensure_capacity(seq_id, start + 1)
        if layer == self.n_layers - 1:
            self._len[seq_id] = start + 1
        return self._k_layers[seq_id][layer], self._v_layers[seq_id][layer]

    def append_decode(
        self, layer: int, seq_ids: list[int], starts: list[int], k_new: torch.Tensor, v_new: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One new token per sequence: k_new/v_new [B, Hkv, D], row i at position starts[i] of seq_ids[i]. Returns each
        sequence's K, V of `layer` as [1, Hkv, start+1, D] views. The lean twin of append for decode steps: a handful
        of dispatcher calls per sequence (its 4-D layer views are kept ready), since that count, not the bytes
        written, is what a decode step pays for."""
        ks, vs = k_new.unbind(0), v_new.unbind(0)  # B x [Hkv, D]
        last = layer == self.n_layers - 1
        out = []
        for i, (seq_id, start) in enumerate(zip(seq_ids, starts)):
            if start > self._len[seq_id] and layer == 0:
                raise ValueError(f"sequence {seq_id}: append at {start} leaves a gap after {self._len[seq_id]} tokens")
            self._ensure_capacity(seq_id, start + 1)
            k4, v4 = self._k4[seq_id][layer], self._v4[seq_id][layer]  # [1, Hkv, cap, D]
            k4[:, :, start].copy_(ks[i])
            v4[:, :, start].copy_(vs[i])
            if last:
                self._len[seq_id] = start + 1
            out.append((k4[:, :, : start + 1], v4[:, :, : start + 1]))
        return out
