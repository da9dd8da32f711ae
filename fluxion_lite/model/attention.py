"""Attention backends: the only place that knows where K/V live and how attention over them is computed.

The model hands a backend the new q/k/v of a packed batch (several sequences, each contributing a chunk of consecutive
positions: a prefill chunk or one decode token). The backend appends k/v to each sequence's cache and returns the causal
attention output for the new queries. Dense here; the hybrid sparse backend implements the same interface.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from fluxion_lite.hostkv.layer import NativeDecoder, decode_attention_unchecked
from fluxion_lite.model.kv_cache import DenseKVCache


@dataclass(frozen=True)
class SeqChunk:
    """One sequence's share of a packed batch: `length` new tokens starting at absolute position `start`."""

    seq_id: int
    start: int
    length: int


class AttentionBackend(ABC):
    """Owns the KV cache of every live sequence and computes attention over it."""

    @abstractmethod
    def allocate(self, seq_id: int, prompt_tokens: int = 0) -> None:
        """A KV cache for a new sequence; prompt_tokens: the length of the prompt it starts with (a backend that
        places sequences by length reads it; 0: unknown)."""

    @abstractmethod
    def free(self, seq_id: int) -> None: ...

    @abstractmethod
    def truncate(self, seq_id: int, n_tokens: int) -> None:
        """Keep only the first n_tokens of a sequence's KV (prefix reuse)."""

    @abstractmethod
    def seq_len(self, seq_id: int) -> int: ...

    @abstractmethod
    def bytes_used(self) -> tuple[int, int]:
        """(bytes in host memory, bytes in GPU memory) held for KV."""

    @abstractmethod
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunks: list[SeqChunk]) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] (T = sum of chunk lengths, packed in chunk order) -> out [T, Hq, D]."""

    def can_reuse(self, seq_id: int, prompt_tokens: int) -> bool:
        """Whether a finished sequence's KV may be truncated and continued by a new prompt of this length (the
        engine's prefix cache); False: free it when the sequence ends."""
        return False

    def stats(self) -> dict[str, float]:
        """Backend-specific counters (sparse statistics); empty for dense attention."""
        return {}

    def captured_decode(self, chunks: list[SeqChunk]) -> CapturedDecode | None:
        """This decode step's attention in capturable form (CUDA graphs, model/cuda_graphs.py), or None: then the
        graphs leave attention out and call attend() eagerly between replays (the default, dense attention's)."""
        return None

    def reset_stats(self) -> None:
        """Start the counters behind stats() afresh (per benchmark sample)."""

    def dense_decode_cache(self, chunks: list[SeqChunk]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """For a step of one token of one sequence whose KV is a dense fp32 CPU cache here: that sequence's whole
        K and V [n_layers, Hkv, cap, D] with room for the token (counted as stored), so that the model appends and
        attends in its one native call for every layer (hostkv.layer.NativeDecoder). None (the default): attend()
        layer by layer."""
        return None

    def native_decode_step(self, decoder: NativeDecoder, x: torch.Tensor, rope_rows: torch.Tensor, rope_stride: int,
                           chunks: list[SeqChunk]) -> bool:
        """For a step of one token per sequence, all of its layers in one native call where this backend can
        (decoder: the model's NativeDecoder; x fp32 [B, d] the embedded tokens, replaced in place by the last
        layer's output; rope_rows: row 0's RoPE table row, the next rope_stride floats on). True: done; False
        (the default): nothing was touched, attend() runs layer by layer."""
        return False


class CapturedDecode(ABC):
    """A backend's decode attention split for capture (AttentionBackend.captured_decode): prologue() and
    epilogue() run inside the captured graphs, host() between their replays, begin()/end() bracket a step.

    key(batch) changes whenever a buffer that a captured graph addresses was reallocated (then the graphs are
    captured anew); owner_id() names the backend, so that one backend's graphs never outlive it. A form with
    whole_step = True has no host work inside a step: all layers are one graph, host() is not called and
    after_replay() runs once after the replay. early(layer, x, query), where offered, is called inside layer - 1's
    post-attention with the residual stream x; query(snapshot of x) gives the layer's predicted q."""

    whole_step = False

    @abstractmethod
    def key(self, batch: int) -> Hashable: ...

    @abstractmethod
    def owner_id(self) -> int: ...

    @abstractmethod
    def begin(self, chunks: list[SeqChunk]) -> None: ...

    @abstractmethod
    def prologue(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """q [B, Hq, D], k, v [B, Hkv, D]: graph buffers of the layer's new token per row."""

    @abstractmethod
    def host(self, layer: int) -> None: ...

    @abstractmethod
    def epilogue(self, layer: int) -> torch.Tensor:
        """The layer's attention output o [B, Hq, D] in the model dtype."""

    def after_replay(self) -> None:
        """whole_step forms: the host work after the step's one replay."""

    @abstractmethod
    def end(self, defer_sync: bool = False) -> None:
        """defer_sync: a whole-step form may wait for the previous step instead of this one (async decode)."""


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """Exact attention of new queries over a sequence's keys, causal, GQA-aware.

    q: [n, Hq, D] at positions start..start+n-1; k, v: [Hkv, L, D] with L == start + n. Returns [n, Hq, D].

    The CPU path is torch's CPU flash kernel, never matmul + softmax in the input dtype: in bf16 that rounds every
    score to 8 bits of mantissa before the softmax (a score of 20 moves by up to 1/16, its weight by up to 6%), which
    measured 10x the bf16 rounding floor on the output (2e-2 vs 1.7e-3 relative) and miscopied UUIDs in
    long-context retrieval that the GPU, whose fused kernels keep scores in fp32, copied right (docs/history.md,
    "The CPU path's bf16 scores"). See cpu_causal_attention for how it is cut.
    """
    n = q.shape[0]
    if n == 1:  # a decode token sees every key: no mask, one fused call
        return decode_attention(q, k, v, scale)
    if q.is_cuda:
        return fused_causal_attention(q, k, v, scale)
    if q.dtype not in CPU_FLASH_DTYPES:  # float64 (references, tests): SDPA's math path with an explicit mask
        hq, hkv, total = q.shape[1], k.shape[0], k.shape[1]
        visible = torch.arange(total)[None, :] <= torch.arange(start, start + n)[:, None]  # [n, L] bool
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None], attn_mask=visible,
                                             scale=scale, enable_gqa=hq != hkv)  # [1, Hq, n, D]
        return out[0].transpose(0, 1)
    return cpu_causal_attention(q, k, v, start, scale)


# dtypes torch's CPU flash kernel computes right (float64 with an fp32 mask came out wrong in a check: callers keep
# an exact matmul / math path for it)
CPU_FLASH_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def cpu_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """causal_attention on the CPU in bf16 / fp16 / fp32: two flash calls (fp32 scores and accumulation) merged by
    their log-sum-exp, no mask anywhere.

    - The keys before the chunk (positions < start) are seen by every query: one unmasked call per KV group with the
      group's r query heads as r x n rows of one head, so each K/V row of the prefix is read once per group.
    - The chunk's own keys are the causal square: one call with is_causal (top-left alignment is right for a square),
      K/V repeated to the Hq heads (n rows each: small next to the prefix at long context).
    bench/prefill_attention.py times it (VM, 1 thread, 1024 queries; bench/results/prefill_attention_vm_1909e71.json):
    qwen2.5-coder-1.5b's heads (12 / 2 / D 128) 61 / 140 / 312 / 584 ms at 1K / 2K / 4K / 8K keys against 84 / 170 /
    322 / 696 for one masked SDPA call and 59 / 128 / 268 / 594 for the old bf16-score matmul path (10x the error);
    the 0.5b's (14 / 2 / D 64) 37 / 91 / 194 / 373 against 55 / 111 / 229 / 422 and 69 / 108 / 235 / 541.
    """
    n, hq, d = q.shape
    hkv = k.shape[0]
    r = hq // hkv
    qh = q.transpose(0, 1)[None]  # [1, Hq, n, D] (a view)
    k_own = k[None, :, start:].repeat_interleave(r, dim=1)  # [1, Hq, n, D]
    v_own = v[None, :, start:].repeat_interleave(r, dim=1)
    o_own, lse_own = cpu_flash(qh, k_own, v_own, True, scale)  # [1, Hq, n, D], fp32 [1, Hq, n]
    if start == 0:
        return o_own[0].transpose(0, 1)
    qg = q.view(n, hkv, r, d).permute(1, 2, 0, 3).reshape(1, hkv, r * n, d)  # [1, Hkv, r n, D]: head h = g r + j
    o_pre, lse_pre = cpu_flash(qg, k[None, :, :start], v[None, :, :start], False, scale)  # [1, Hkv, r n, D]
    o_pre = o_pre.reshape(1, hq, n, d)  # the same row order as qh's heads (the kernel's out may be strided)
    share = torch.sigmoid(lse_pre.reshape(1, hq, n) - lse_own)[..., None]  # prefix's softmax mass: e^a / (e^a + e^b)
    out = o_pre.float().mul_(share).add_(o_own.float().mul_(1.0 - share))  # [1, Hq, n, D] fp32
    return out.to(q.dtype)[0].transpose(0, 1)  # [n, Hq, D]


def cpu_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
              mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's CPU flash attention with its log-sum-exp (fp32 scores and accumulation): q [B, H, m, D], k, v
    [B, H, L, D] (last dim contiguous), mask an additive bias broadcastable to [B, H, m, L] -> out [B, H, m, D]
    (q's dtype), lse fp32 [B, H, m]."""
    res = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=mask,
                                                                     scale=scale)
    return res[0], res[1]


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One query position over all of a sequence's keys (a decode step): q [1, Hq, D], k, v [Hkv, L, D] -> [1, Hq, D].

    The r = Hq / Hkv query heads sharing a KV head are laid out as r query rows of one SDPA head ([1, Hkv, r, D]), so
    each K/V row is read once per KV head, no K/V is repeated or copied, and no mask is needed. k, v may be views
    into a larger cache buffer (last dim contiguous), which every SDPA backend (CPU flash, CUDA flash /
    memory-efficient) accepts as they are.
    """
    _, hq, d = q.shape
    hkv = k.shape[0]
    out = gqa_decode(q.view(1, hkv, hq // hkv, d), k[None], v[None], scale)  # [1, Hkv, r, D]
    return out.reshape(1, hq, d)


def gqa_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [1, Hkv, r, D] over k, v [1, Hkv, L, D] (views allowed) -> [1, Hkv, r, D], no mask.

    On CUDA this is split-L ("flash decoding"): torch's fused SDPA parallelises over (batch, head, query block) only,
    so one decode query per KV head gives it Hkv thread blocks (2-8) on a 132-SM GPU, and a P @ V matmul has the same
    problem (tiny M and N, the whole L as its reduction). Cutting L into chunks that become the batch dimension of one
    flash call gives S x Hkv blocks; the chunks' partial outputs merge by their log-sum-exp. The CPU keeps SDPA (its
    flash kernel is the fastest CPU path measured, see docs/model.md).
    """
    if q.is_cuda and _split_decode_ok:
        try:
            return split_decode(q, k, v, scale)
        except RuntimeError:  # an SDPA build without the flash kernel for this shape: matmuls from now on
            _disable_split_decode()
    if not q.is_cuda:
        return F.scaled_dot_product_attention(q, k, v, scale=scale)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale  # [1, Hkv, r, L]
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, v)


_split_decode_ok = True
SPLIT_TARGET_BLOCKS = 256  # chunks x KV heads: about two thread blocks per SM of an H100/H200
SPLIT_MIN_CHUNK = 128


def _disable_split_decode() -> None:
    global _split_decode_ok
    _split_decode_ok = False


def split_chunk(n_keys: int, n_kv_heads: int) -> int:
    """Keys per chunk: enough chunks for SPLIT_TARGET_BLOCKS blocks, chunks of at least SPLIT_MIN_CHUNK keys, and a
    multiple of 128 (whole flash key tiles)."""
    per = -(-n_keys * n_kv_heads // SPLIT_TARGET_BLOCKS)
    return max(SPLIT_MIN_CHUNK, -(-per // 128) * 128)


def _flash_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """One flash-attention call that also returns the log-sum-exp: q [B, H, n, D], k, v [B, H, L, D] (any batch/head
    strides, last dim contiguous) -> out [B, H, n, D], lse fp32 [B, H, n]."""
    res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=scale)
    return res[0], res[1]


def split_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """gqa_decode's CUDA path: q [1, Hkv, r, D], k, v [1, Hkv, L, D] -> [1, Hkv, r, D] (q's dtype)."""
    hkv, n_keys = k.shape[1], k.shape[2]
    chunk = split_chunk(n_keys, hkv)
    n_full = n_keys // chunk
    outs, lses = [], []
    if n_full:
        span = n_full * chunk
        kc = k[0, :, :span].unflatten(1, (n_full, chunk)).transpose(0, 1)  # [S, Hkv, C, D]: views, no copy
        vc = v[0, :, :span].unflatten(1, (n_full, chunk)).transpose(0, 1)
        qc = q.expand(n_full, -1, -1, -1).contiguous()  # [S, Hkv, r, D] (small)
        o, lse = _flash_with_lse(qc, kc, vc, scale)
        outs.append(o)
        lses.append(lse)
    if n_full * chunk < n_keys:  # the tail chunk
        o, lse = _flash_with_lse(q, k[:, :, n_full * chunk :], v[:, :, n_full * chunk :], scale)
        outs.append(o)
        lses.append(lse)
    if len(outs) == 1 and outs[0].shape[0] == 1:
        return outs[0]
    o_all = torch.cat(outs) if len(outs) > 1 else outs[0]  # [S', Hkv, r, D]
    lse_all = torch.cat(lses) if len(lses) > 1 else lses[0]  # [S', Hkv, r]
    w = torch.softmax(lse_all, dim=0)  # each chunk's share of the total softmax mass
    return (o_all.float() * w[..., None]).sum(0, keepdim=True).to(q.dtype)


def fused_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """causal_attention through torch's fused SDPA kernels (flash / memory-efficient on CUDA): never materialises the
    [n, L] score matrix, which dominates long prefills. Same contract as causal_attention; the queries are the last n
    positions, so the causal mask is aligned to the bottom-right corner.
    """
    n, hq, _ = q.shape
    hkv, total, _ = k.shape
    r = hq // hkv
    # The fused kernels want one K/V head per query head; repeating K/V costs O(L) memory, far below the O(n L) scores.
    kh = k.repeat_interleave(r, dim=0)[None]  # [1, Hq, L, D]
    vh = v.repeat_interleave(r, dim=0)[None]
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], kh, vh, attn_mask=causal_lower_right(n, total),
                                         scale=scale)  # [1, Hq, n, D]
    return out[0].transpose(0, 1)


class DenseAttention(AttentionBackend):
    """Full attention with the KV cache on the compute device (the `full` mode)."""

    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        self.cache = DenseKVCache(n_layers, n_kv_heads, head_dim, dtype, device)
        self.scale = head_dim**-0.5
        # fp32 cache on the CPU: a decode step appends and attends in one native call per sequence and layer
        self._native_decode = torch.device(device).type == "cpu" and dtype == torch.float32

    def allocate(self, seq_id: int, prompt_tokens: int = 0) -> None:
        self.cache.allocate(seq_id)

    def can_reuse(self, seq_id: int, prompt_tokens: int) -> bool:
        return True

    def free(self, seq_id: int) -> None:
        self.cache.free(seq_id)

    def truncate(self, seq_id: int, n_tokens: int) -> None:
        self.cache.truncate(seq_id, n_tokens)

    def seq_len(self, seq_id: int) -> int:
        return self.cache.seq_len(seq_id)

    def bytes_used(self) -> tuple[int, int]:
        n = self.cache.bytes_used()
        return (0, n) if self.cache.device.type == "cuda" else (n, 0)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunks: list[SeqChunk]) -> torch.Tensor:
        if all(c.length == 1 for c in chunks):  # a pure decode batch: row i is sequence i
            return self._decode(layer, q, k, v, chunks)
        if len(chunks) == 1:  # a lone prefill chunk: no output buffer to fill
            c = chunks[0]
            keys, values = self.cache.append(layer, c.seq_id, c.start, k, v)  # [Hkv, L, D] views of the cache
            return causal_attention(q, keys, values, c.start, self.scale)
        out = torch.empty_like(q)
        offset = 0
        for c in chunks:
            sl = slice(offset, offset + c.length)
            keys, values = self.cache.append(layer, c.seq_id, c.start, k[sl], v[sl])  # [Hkv, L, D] each
            out[sl] = causal_attention(q[sl], keys, values, c.start, self.scale)
            offset += c.length
        return out

    def dense_decode_cache(self, chunks: list[SeqChunk]) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not self._native_decode or len(chunks) != 1 or chunks[0].length != 1:
            return None
        return self.cache.decode_stack(chunks[0].seq_id, chunks[0].start)

    def _decode(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunks: list[SeqChunk]) -> torch.Tensor:
        """q: [B, Hq, D], k/v: [B, Hkv, D], one token per sequence -> [B, Hq, D].

        Each sequence's K/V live in their own buffer, so it is one fused SDPA call per sequence (GQA heads as query rows,
        as in decode_attention) over views of the cache, and one concatenation of the outputs.
        """
        b, hq, d = q.shape
        hkv = k.shape[1]
        if self._native_decode and q.dtype == torch.float32 and k.dtype == torch.float32:
            # the native kernel appends the token and attends in one call per sequence: no torch op per layer
            # beyond the output (SDPA's setup and the appends' copies cost more than the attention at these sizes)
            out = torch.empty(b, hq, d)
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
            for i, c in enumerate(chunks):
                k_cache, v_cache = self.cache.decode_slot(layer, c.seq_id, c.start)  # [Hkv, cap, D]
                decode_attention_unchecked(q[i], k_cache, v_cache, c.start + 1, self.scale, out[i], k[i], v[i])
            return out
        kvs = self.cache.append_decode(layer, [c.seq_id for c in chunks], [c.start for c in chunks], k, v)
        qs = q.view(b, 1, hkv, hq // hkv, d).unbind(0)  # B x [1, Hkv, r, D]
        outs = [gqa_decode(qi, ki, vi, self.scale) for qi, (ki, vi) in zip(qs, kvs)]
        out = outs[0] if b == 1 else torch.cat(outs)  # [B, Hkv, r, D]
        return out.reshape(b, hq, d)
