"""Sparse decode attention over a host-memory KV store (the CPU path of Fluxion; modes `fixed` and `fluxion`).

Prefill is dense (a scratch KV on the compute device, dropped when decoding starts). Every token's K/V also goes to the
host store (native page layout, bf16, block summaries). A decode step then attends, per (layer, KV group):
  streaming part  sink + recent window, kept on the compute device, for every group        -> (o_s, lse_s)
  retrieval part  top-k blocks of granularity g by the Quest bound, native kernels in place over host KV,
                  for the plan's retrieval groups                                           -> (o_r, lse_r)
and merges the two by log-sum-exp. The two parts cover disjoint tokens: the native top-k skips blocks that touch the
sink or the window, so for a group with block size g the streaming part covers the sink rounded up to g and the window
rounded down to g (the device buffers keep 128 spare tokens for that).
"""
from __future__ import annotations

import numpy as np
import torch

from . import native
from .attention import AttentionBackend, SeqChunk, causal_attention
from .config import ModelConfig
from .host_kv import HostKVStore
from .kv_cache import DenseKVCache
from .sparse_plan import GRANULARITIES, SparsePlan

MAX_G = max(GRANULARITIES)


def _align_up(x: int, a: int) -> int:
    return -(-x // a) * a


class SparseAttention(AttentionBackend):
    def __init__(self, cfg: ModelConfig, plan: SparsePlan, dtype: torch.dtype, device: torch.device, max_seqs: int):
        plan.validate(cfg.n_layers, cfg.n_kv_heads)
        self.cfg, self.plan, self.dtype, self.device = cfg, plan, dtype, device
        self.scale = cfg.head_dim**-0.5
        self.r = cfg.n_heads // cfg.n_kv_heads
        self.store = HostKVStore(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, dtype=torch.bfloat16, max_seqs=max_seqs,
                                 page_tokens=256, granularities=GRANULARITIES)
        self.sink_cap = _align_up(max(plan.sink, 1), MAX_G)
        self.ring_cap = plan.window + MAX_G
        self.scratch = DenseKVCache(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, dtype, device)
        self._slot: dict[int, int] = {}
        # seq -> [2 (k, v), L, Hkv, sink_cap + ring_cap, D]: sink tokens at 0..sink_cap-1, then a ring where slot j
        # holds the latest position p == j (mod ring_cap). One buffer, so a decode step reads it without copies.
        self._near: dict[int, torch.Tensor] = {}
        self._len: dict[int, int] = {}
        self._prefilling: set[int] = set()
        # plan as tensors: [L, Hkv]
        self._streaming = torch.tensor([[gp.streaming for gp in row] for row in plan.groups])
        self._g = torch.tensor([[1 if gp.streaming else gp.g for gp in row] for row in plan.groups])
        self._budget = np.array([[gp.budget for gp in row] for row in plan.groups], dtype=np.float64)  # [L, Hkv]
        self._read_tokens = 0.0  # sum over decode (step, layer, seq, group) of tokens read
        self._context_tokens = 0.0  # same sum of context lengths

    # ---- sequence lifecycle ---------------------------------------------------------------------------------------
    def allocate(self, seq_id: int) -> None:
        if seq_id in self._slot:
            raise ValueError(f"sequence {seq_id} already has a KV cache")
        c = self.cfg
        self._slot[seq_id] = self.store.allocate()
        self.scratch.allocate(seq_id)
        self._prefilling.add(seq_id)
        self._near[seq_id] = torch.zeros(2, c.n_layers, c.n_kv_heads, self.sink_cap + self.ring_cap, c.head_dim,
                                         dtype=self.dtype, device=self.device)
        self._len[seq_id] = 0

    def free(self, seq_id: int) -> None:
        slot = self._slot.pop(seq_id, None)
        if slot is not None:
            self.store.release(slot)
        self.scratch.free(seq_id)
        for d in (self._near, self._len):
            d.pop(seq_id, None)
        self._prefilling.discard(seq_id)

    def truncate(self, seq_id: int, n_tokens: int) -> None:
        raise NotImplementedError("the sparse backend does not support prefix reuse yet")

    def seq_len(self, seq_id: int) -> int:
        return self._len[seq_id]

    def bytes_used(self) -> tuple[int, int]:
        device_bytes = self.scratch.bytes_used() + sum(
            t.numel() * t.element_size() for t in self._near.values()
        )
        if self.device.type == "cuda":
            return self.store.bytes_used, device_bytes
        return self.store.bytes_used + device_bytes, 0

    def stats(self) -> dict[str, float]:
        frac = self._read_tokens / self._context_tokens if self._context_tokens else 0.0
        return {"kv_read_fraction": frac, "streaming_fraction": self.plan.streaming_fraction}

    def reset_stats(self) -> None:
        self._read_tokens = self._context_tokens = 0.0

    # ---- attention ------------------------------------------------------------------------------------------------
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunks: list[SeqChunk]) -> torch.Tensor:
        out = torch.empty_like(q)
        self._write(layer, k, v, chunks)
        decode_rows: list[int] = []
        decode_chunks: list[SeqChunk] = []
        offset = 0
        for c in chunks:
            sl = slice(offset, offset + c.length)
            if c.length > 1:
                if c.seq_id not in self._prefilling:
                    raise ValueError(f"sequence {c.seq_id}: a prefill chunk after decoding started is not supported")
                keys, values = self.scratch.append(layer, c.seq_id, c.start, k[sl], v[sl])
                out[sl] = causal_attention(q[sl], keys, values, c.start, self.scale)
            else:
                decode_rows.append(offset)
                decode_chunks.append(c)
            offset += c.length
        if decode_chunks:
            rows = torch.tensor(decode_rows, device=q.device)
            out[rows] = self._decode(layer, q[rows], decode_chunks)
        if layer == self.cfg.n_layers - 1:
            for c in chunks:
                self._len[c.seq_id] = c.start + c.length
                if c.length == 1 and c.seq_id in self._prefilling:  # decoding started: the dense scratch goes
                    self._prefilling.discard(c.seq_id)
                    self.scratch.free(c.seq_id)
        return out

    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor, chunks: list[SeqChunk]) -> None:
        """Append the new tokens' K/V to the host store (one native call) and to each sequence's sink/window."""
        slots = [self._slot[c.seq_id] for c in chunks]
        self.store.append_batch(layer, slots, k.to(torch.bfloat16).cpu(), v.to(torch.bfloat16).cpu(),
                                counts=[c.length for c in chunks])
        offset = 0
        for c in chunks:
            kc, vc = k[offset : offset + c.length], v[offset : offset + c.length]  # [n, Hkv, D]
            pos = torch.arange(c.start, c.start + c.length, device=k.device)
            near = self._near[c.seq_id]
            if c.start < self.sink_cap:
                in_sink = pos < self.sink_cap
                near[0, layer][:, pos[in_sink]] = kc[in_sink].transpose(0, 1).to(self.dtype)
                near[1, layer][:, pos[in_sink]] = vc[in_sink].transpose(0, 1).to(self.dtype)
            tail = slice(max(0, c.length - self.ring_cap), c.length)
            ring_idx = self.sink_cap + pos[tail] % self.ring_cap
            near[0, layer][:, ring_idx] = kc[tail].transpose(0, 1).to(self.dtype)
            near[1, layer][:, ring_idx] = vc[tail].transpose(0, 1).to(self.dtype)
            offset += c.length

    def _decode(self, layer: int, q: torch.Tensor, chunks: list[SeqChunk]) -> torch.Tensor:
        """q: [B, Hq, D], one new token per sequence (already written) -> out [B, Hq, D]."""
        B, hkv, r, d = len(chunks), self.cfg.n_kv_heads, self.r, self.cfg.head_dim
        dev = q.device
        n_ctx = torch.tensor([c.start + 1 for c in chunks], device=dev)  # [B] tokens incl. the new one
        g = self._g[layer].to(dev)  # [Hkv] (1 for streaming groups)
        # Streaming coverage per (seq, group): [0, sink_hi) and [win_lo, n_ctx), block-aligned to the group's g.
        sink_hi = torch.minimum(((self.plan.sink + g - 1) // g * g)[None, :], n_ctx[:, None])  # [B, Hkv]
        win_lo = torch.maximum(((n_ctx[:, None] - self.plan.window).clamp(min=0) // g) * g, sink_hi)  # [B, Hkv]
        # Positions held in the device buffers: sink slots 0..sink_cap-1, ring slot j -> latest p == j (mod cap).
        j = torch.arange(self.ring_cap, device=dev)
        last = n_ctx - 1
        ring_pos = last[:, None] - ((last[:, None] - j[None, :]) % self.ring_cap)  # [B, ring_cap]
        sink_pos = torch.arange(self.sink_cap, device=dev).expand(B, -1)
        pos = torch.cat([sink_pos, ring_pos], dim=1)  # [B, Ltot]
        is_sink = torch.zeros_like(pos, dtype=torch.bool)
        is_sink[:, : self.sink_cap] = True
        valid = torch.where(
            is_sink[:, None, :],
            pos[:, None, :] < sink_hi[:, :, None],
            (pos[:, None, :] >= win_lo[:, :, None]) & (pos[:, None, :] >= 0),
        )  # [B, Hkv, Ltot]
        if B == 1:
            kv = self._near[chunks[0].seq_id][:, layer, None]  # [2, 1, Hkv, Ltot, D], a view
        else:
            kv = torch.stack([self._near[c.seq_id][:, layer] for c in chunks], dim=1)  # [2, B, Hkv, Ltot, D]
        keys, values = kv[0], kv[1]  # [B, Hkv, Ltot, D]
        qg = q.view(B, hkv, r, d)
        scores = torch.matmul(qg, keys.transpose(-1, -2)).float() * self.scale  # [B, Hkv, r, Ltot]
        scores.masked_fill_(~valid[:, :, None, :], float("-inf"))
        lse_s = torch.logsumexp(scores, dim=-1)  # [B, Hkv, r]
        probs = torch.exp(scores - lse_s[..., None]).to(values.dtype)
        out = torch.matmul(probs, values).float()  # [B, Hkv, r, D]
        read = valid.sum(-1).double()  # [B, Hkv] streaming tokens read

        # Retrieval tasks of this layer, built with array ops (no Python loop over sequences x groups): a retrieval
        # group whose gap between sink and window holds at least one block. meta columns: b, h, g, k, lo, hi, n.
        lo_np, hi_np = sink_hi.cpu().numpy(), win_lo.cpu().numpy()  # [B, Hkv]
        g_np = self._g[layer].numpy()  # [Hkv]
        n_np = np.array([c.start + 1 for c in chunks], dtype=np.int64)  # [B]
        wanted = (~self._streaming[layer].numpy())[None, :] & (hi_np - lo_np >= g_np[None, :])
        bi_np, h_np = np.nonzero(wanted)
        gh = g_np[h_np]
        k_blocks = np.ceil(self._budget[layer, h_np] * n_np[bi_np] / gh).astype(np.int64)
        meta = np.stack([bi_np, h_np, gh, k_blocks, lo_np[bi_np, h_np], hi_np[bi_np, h_np], n_np[bi_np]], axis=1)
        if len(meta):
            slots = np.array([self._slot[c.seq_id] for c in chunks])[meta[:, 0]]  # per task
            tasks = native.make_tasks(slots, meta[:, 0], meta[:, 1], meta[:, 2], meta[:, 3],
                                      exclude=[(0, meta[:, 4]), (meta[:, 5], meta[:, 6])])
            view = self.store.view(layer)
            q_host = q.detach().float().cpu().contiguous()  # [B, Hq, D]
            ids, _, counts = native.group_topk(view, q_host, tasks)
            o_r, lse_r = native.sparse_attention(view, q_host, tasks, ids, counts, self.scale)  # [T, r, D], [T, r]
            bi, hi_ = torch.from_numpy(meta[:, 0]), torch.from_numpy(meta[:, 1])
            o_r_t, lse_r_t = torch.from_numpy(o_r).to(dev), torch.from_numpy(lse_r).to(dev)
            lse_s_sel, out_sel = lse_s[bi, hi_], out[bi, hi_]  # [T, r], [T, r, D]
            m = torch.maximum(lse_s_sel, lse_r_t)
            w_s, w_r = torch.exp(lse_s_sel - m), torch.exp(lse_r_t - m)  # lse_r = -inf (empty) -> weight 0
            out[bi, hi_] = (out_sel * w_s[..., None] + o_r_t * w_r[..., None]) / (w_s + w_r)[..., None]
            read[bi, hi_] += torch.from_numpy(counts.astype(np.float64) * meta[:, 2]).to(dev)
        self._read_tokens += float(read.sum())
        self._context_tokens += float(n_ctx.double().sum()) * hkv
        return out.view(B, hkv * r, d).to(q.dtype)
