"""Weights kept in their GGUF block formats (the CPU default): products by the native library's quantized kernels.

A GGUF file stores most matrices in 4-8 bit blocks. Dequantizing them to fp32 at load costs 6-8x the file's size in
RAM and makes every decode step read that much; here the blocks stay as the file has them (memory-mapped: pages are
read on first use and shared with the page cache) and each product quantizes its activations per block to 8 bits
and runs integer dot products (native/fluxion.h, "QUANTIZED WEIGHTS").

QuantLinear is one or several matrices that share an input (q/k/v; gate/up): one native call computes them all, the
input quantized once. Prefill rows are many: above PREFILL_ROWS the weight is dequantized into a scratch buffer shared
by every layer and multiplied by torch's GEMM, which is faster there than row-blocked integer products: in bf16 where
the CPU has native bf16 (bf16_gemm_pays; the rounding of weights and activations to bf16 is of the order of the
decode path's 8-bit activation rounding), else in fp32.
Up to PREFILL_ROWS rows (decode steps), a layer's work before and after its attention is one native call each
(native_layer: norm, q/k/v, bias and RoPE; output product, residual, norm, gate/up, silu, down, residual), since
~20 torch operations per layer cost as much dispatch time as the products themselves.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from fluxion_lite.hostkv import quant
from fluxion_lite.hostkv.layer import LayerSpec, NativeLayer
from fluxion_lite.model.config import ModelConfig

# Rows above which a product dequantizes the weight and uses the fp32 GEMM (prefill chunks) instead of the
# quantized kernel, which reads each weight row once per 16 rows of x.
PREFILL_ROWS = 32


def bf16_gemm_pays() -> bool:
    """Whether prefill products should run as bf16 GEMMs: where oneDNN has native bf16 (AVX512-BF16, AMX) a bf16
    GEMM is ~4.7x the fp32 one (VM Xeon with AMX, 2 threads: 821 vs 176 GFLOP/s at 512 x 1536 x 8960), which makes
    the 1.5b's prefill compute-bound no longer; on AVX2-only CPUs bf16 GEMMs are slower than fp32 ones."""
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (RuntimeError, AttributeError):
        return False


class DequantScratch:
    """The buffer reused by every prefill product of a model (grown to the largest weight, never shrunk): the weight
    dequantized to bf16 where prefill GEMMs run in bf16 (bf16_gemm_pays), else to fp32."""

    def __init__(self, bf16: bool | None = None) -> None:
        self.buf = torch.empty(0)
        self.bf16 = bf16_gemm_pays() if bf16 is None else bf16
        self.buf16 = torch.empty(0, dtype=torch.bfloat16)

    def take(self, n: int) -> torch.Tensor:
        if self.buf.numel() < n:
            self.buf = torch.empty(n)
        return self.buf[:n]

    def take_bf16(self, n: int) -> torch.Tensor:
        if self.buf16.numel() < n:
            self.buf16 = torch.empty(n, dtype=torch.bfloat16)
        return self.buf16[:n]


class QuantLinear:
    """x [T, k] fp32 -> x @ [W_0; W_1; ...]^T [T, sum n_out] (+ bias) for weights kept in their block formats."""

    def __init__(self, parts: Sequence[quant.QuantWeight], scratch: DequantScratch):
        if not parts or len({p.k for p in parts}) != 1:
            raise ValueError("QuantLinear needs one or more weights of one input width")
        self.parts = list(parts)
        self.group = quant.QuantGroup(self.parts) if len(self.parts) > 1 else None  # C arguments made once
        self.k = parts[0].k
        self.n_out = sum(p.n_out for p in parts)
        self.scratch = scratch
        # prefill rows in fp32 even where bf16 GEMMs pay: set for the vocabulary product, whose rounding reaches the
        # logits directly (teacher-forced top-1 against llama.cpp, AMX VM: smollm2 94.82 -> 95.51%, the 0.5b
        # 97.07 -> 97.75%); serving asks it for a chunk's last rows only, which take the quantized kernel anyway
        self.prefill_fp32 = False

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n_out, self.k)

    @property
    def nbytes(self) -> int:
        return sum(p.n_out * p.row_bytes for p in self.parts)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        x = x.float().contiguous()  # [T, k]
        if x.shape[0] > PREFILL_ROWS:
            if self.scratch.bf16 and not self.prefill_fp32:  # weights and activations rounded to bf16, fp32 sums
                w16 = self.dense_bf16(self.scratch.take_bf16(self.n_out * self.k))  # [n_out, k] bf16
                y = torch.nn.functional.linear(x.to(torch.bfloat16), w16).float()  # [T, n_out]
            else:
                w = self.dense(self.scratch.take(self.n_out * self.k))  # [n_out, k] fp32
                y = torch.nn.functional.linear(x, w)  # [T, n_out]
        elif self.group is None:
            y = self.parts[0].matmul(x)  # [T, n_out]
        elif x.shape[0] == 1:  # one row: the parts write straight into one output row, no concatenation
            y = torch.empty(1, self.n_out)
            self.group.matmul(x, self._row_views(y))
        else:
            y = torch.cat(self.group.matmul(x), dim=1)  # [T, n_out]
        if bias is not None:
            y += bias
        return y

    def _row_views(self, y: torch.Tensor) -> list[torch.Tensor]:
        """Each part's contiguous slice of a one-row output y [1, n_out], as [1, n_out_j]."""
        views, at = [], 0
        for p in self.parts:
            views.append(y[:, at : at + p.n_out])
            at += p.n_out
        return views

    def dense(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The whole matrix as fp32 [n_out, k] (into out's storage when given): prefill GEMMs, analysis tools."""
        full = torch.empty(self.n_out * self.k) if out is None else out
        at = 0
        for p in self.parts:
            p.dequantize(out=full[at * self.k : (at + p.n_out) * self.k].view(p.n_out, self.k))
            at += p.n_out
        return full.view(self.n_out, self.k)

    def dense_bf16(self, out: torch.Tensor) -> torch.Tensor:
        """The whole matrix as bf16 [n_out, k] into out's storage, straight from the blocks (no fp32 copy: the
        dequantize-then-convert pass wrote and read 6 bytes more per weight, a third of a 512-row bf16 GEMM's time)."""
        at = 0
        for p in self.parts:
            p.dequantize_bf16(out=out[at * self.k : (at + p.n_out) * self.k].view(p.n_out, self.k))
            at += p.n_out
        return out.view(self.n_out, self.k)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ids [T] of a one-part matrix as fp32 [T, k]: the embedding lookup."""
        (p,) = self.parts
        out = torch.empty(ids.shape[0], self.k)
        for i, r in enumerate(ids.tolist()):
            p.dequantize(row0=r, n_rows=1, out=out[i : i + 1])
        return out


def native_layer(cfg: ModelConfig, attn_norm: torch.Tensor, ffn_norm: torch.Tensor, qkv_bias: torch.Tensor | None,
                 wqkv: QuantLinear, wo: QuantLinear, w_gate_up: QuantLinear, w_down: QuantLinear) -> NativeLayer:
    """The layer's two native calls (hostkv/layer.py) over the same weights as its QuantLinears."""
    q, k, v = wqkv.parts
    gate, up = w_gate_up.parts
    spec = LayerSpec(d=cfg.d_model, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                     rope_dim=cfg.rope_dim, rope_neox=cfg.rope_style == "neox", ffn=gate.n_out, eps=cfg.rms_eps)
    return NativeLayer(spec, attn_norm, ffn_norm, qkv_bias, q, k, v, wo.parts[0], gate, up, w_down.parts[0])
