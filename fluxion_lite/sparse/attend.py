"""Torch attention pieces of the sparse step: attention over gathered or masked tokens, the streaming part over
the device slab, and the log-sum-exp merge of partial attentions over disjoint keys."""
from __future__ import annotations

import torch

from fluxion_lite.model.attention import CPU_FLASH_DTYPES, cpu_flash


def lse_merge(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor:
    """Merge two partial attentions over disjoint keys: o [..., D] fp32, lse [...] (natural log). At least one lse
    per row must be finite; a part with lse = -inf gets weight 0."""
    m = torch.maximum(lse_a, lse_b)
    w_a, w_b = torch.exp(lse_a - m), torch.exp(lse_b - m)
    return (o_a * w_a[..., None] + o_b * w_b[..., None]) / (w_a + w_b)[..., None]


def lse_merge_parts(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """lse_merge of any number of partial attentions over disjoint keys (or terms standing for them): [(o [..., D],
    lse [...]), ...] -> o. At least one lse per row must be finite."""
    m = parts[0][1]
    for _, lse in parts[1:]:
        m = torch.maximum(m, lse)
    num = den = None
    for o, lse in parts:
        w = torch.exp(lse - m)
        num = o * w[..., None] if num is None else num + o * w[..., None]
        den = w if den is None else den + w
    assert num is not None and den is not None
    return num / den[..., None]


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: torch.Tensor,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of each task's query heads over its gathered tokens.

    q: [T, r, D]; k, v: [T, K, D] (rows >= lens[t] are padding, masked out); lens: [T] int64.
    Returns out fp32 [T, r, D], lse fp32 [T, r]; a task with no tokens gives out 0, lse -inf (like the native kernel)."""
    valid = torch.arange(k.shape[1], device=k.device)[None, :] < lens[:, None]  # [T, K]
    return masked_attention(q, k, v, valid, scale)


_HALF = (torch.bfloat16, torch.float16)
_bmm_out_dtype_ok = True  # False once a torch without bmm's out_dtype said so (not asked again every call)


def fp32_scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q [..., r, D] times k [..., L, D] transposed -> fp32 scores [..., r, L] (q's and k's leading dims equal).

    A bf16 matmul writes bf16 scores: each rounded to 8 bits of mantissa before the softmax, which is what cost the
    CPU path its RULER points (attention.causal_attention). On CUDA, half inputs go through one bmm whose output is
    fp32 (cuBLAS accumulates in fp32 either way; only the stored scores change); k's leading dims merge by a copy
    when they are not contiguous (a device slab's K half: the step's sink + window keys, one layer's)."""
    global _bmm_out_dtype_ok
    if _bmm_out_dtype_ok and q.is_cuda and q.dtype in _HALF and q.shape[:-2] == k.shape[:-2]:
        lead, r, n = q.shape[:-2], q.shape[-2], k.shape[-2]
        q3, k3 = q.reshape(-1, r, q.shape[-1]), k.reshape(-1, n, k.shape[-1])
        try:
            return torch.bmm(q3, k3.transpose(1, 2), out_dtype=torch.float32).view(*lead, r, n)
        except (TypeError, RuntimeError):  # a torch without bmm's out_dtype: the upcast below from now on
            _bmm_out_dtype_ok = False
    if q.dtype in _HALF:  # the CPU (whose half matmuls are slow anyway), or a torch without bmm's out_dtype
        return torch.matmul(q.float(), k.float().transpose(-1, -2))
    return torch.matmul(q, k.transpose(-1, -2)).float()


def biased_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The streaming part over the device sink/ring slab: q [B, Hkv, r, D], k, v [B, Hkv, L, D], bias fp32
    broadcastable to [B, Hkv, r, L] (0 where a slot is attended, -inf elsewhere; at least one 0 per row).
    Returns out fp32 [B, Hkv, r, D], lse fp32 [B, Hkv, r].

    On the CPU in bf16/fp16/fp32 this is torch's CPU flash kernel, which returns the LSE too and keeps the scores in
    fp32: a bf16 matmul rounds them to 8 bits of mantissa first (relative output error 1.1e-2 against float64 where
    the rounding floor is 1.7e-3, LSE off by up to 0.08; see attention.causal_attention for what that cost)."""
    if q.device.type == "cpu" and q.dtype in CPU_FLASH_DTYPES:
        out, lse = cpu_flash(q, k, v, False, scale, mask=bias)
        return out.float(), lse
    scores = fp32_scores(q, k) * scale  # [B, Hkv, r, L]
    scores += bias
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse[..., None]).to(v.dtype), v).float(), lse


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """block_attention with any token mask: valid bool [T, K] (the zero-copy layout has holes: partial blocks)."""
    k, v = k.to(q.dtype), v.to(q.dtype)  # bf16 on CUDA; fp32 on a CPU device (as precise as the native kernel)
    scores = fp32_scores(q, k) * scale  # [T, r, K]
    scores.masked_fill_(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [T, r]
    probs = torch.exp(scores - lse.clamp(min=torch.finfo(torch.float32).min)[..., None])  # -inf rows -> 0
    # masked rows get weight 0, but 0 x NaN is NaN: padding may hold any bits (stale or never written pages)
    v = v.masked_fill(~valid[..., None], 0)
    out = torch.matmul(probs.to(v.dtype), v).float()  # [T, r, D]
    return out, lse
