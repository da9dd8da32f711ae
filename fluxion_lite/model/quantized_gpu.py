"""Weights kept in their GGUF block formats on the GPU (the CUDA default): Triton products for decode rows,
dequantized tiles into bf16 GEMMs for prefill.

A decode step on the GPU is a weight read, and an 8B Q4_K_M file's blocks are 3.3x fewer bytes than the same weights
in bf16. Each matrix goes from the memory-mapped file to the GPU as the file stores it (no fp32 or bf16 copy in host
RAM); up to qgemv_kernels.MAX_M rows of x (decode batches) its products are qgemv_kernels' launches, which dequantize
in registers. Above that (prefill chunks) the matrix is dequantized into a bf16 buffer shared by every layer and
multiplied by torch's GEMM on the tensor cores: per chunk one pass over the blocks against T x the GEMM's work.

dequantize() is the torch form of the block layouts (native/fluxion.h, "QUANTIZED WEIGHTS"): it runs wherever the
bytes are (the GPU here; the CPU in the tests, where it is checked bit for bit against the native dequantizer), every
element its exact value rounded once (each product in the formulas is exact in fp32), as the Triton kernels and
gguf-py compute them.
"""
from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from fluxion_lite.hostkv import quant
from fluxion_lite.model import qgemv_kernels as qk

DEQUANT_CHUNK = 1 << 22  # output elements per dequantize() piece: bounds its fp32 temporaries (~16 MB each)


def supported(qw: quant.QuantWeight) -> bool:
    """Whether a file matrix stays in its blocks on the GPU (the block types qgemv_kernels reads; F16 / BF16 / F32
    matrices are plain tensors there)."""
    return qw.wtype in qk.TYPES


def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The f16 field at byte `at` of every block, blocks uint8 [n, nb, bytes] -> fp32 [n, nb, 1]."""
    return blocks[..., at : at + 2].contiguous().view(torch.float16).float()


def _bits(b: torch.Tensor, n_bits: int) -> torch.Tensor:
    """uint8 [..., m] -> [..., n_bits, m]: bit i of every byte in row i (0 or 1, uint8)."""
    shifts = torch.arange(n_bits, dtype=torch.uint8, device=b.device)[:, None]  # [n_bits, 1]
    return (b.unsqueeze(-2) >> shifts) & 1


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """qs uint8 [..., m] -> [..., 2 m]: the low nibbles, then the high ones (a 32-block's element order)."""
    return torch.cat((qs & 0xF, qs >> 4), dim=-1)


def _k_scales(sc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 packed bytes [n, nb, 12] -> the 6-bit scales and mins, fp32 [n, nb, 8] each."""
    lo, hi = sc[..., 0:4], sc[..., 4:8]
    last = sc[..., 8:12]
    scale = torch.cat((lo & 63, (last & 0xF) | ((lo >> 6) << 4)), dim=-1)
    mins = torch.cat((hi & 63, (last >> 4) | ((hi >> 6) << 4)), dim=-1)
    return scale.float(), mins.float()


def _dequantize_blocks(wtype: int, blocks: torch.Tensor) -> torch.Tensor:
    """blocks uint8 [n, nb, bytes] of one type -> fp32 [n, nb, B] (B elements per block)."""
    n, nb = blocks.shape[:2]
    d = _f16(blocks, 208 if wtype == qk.Q6_K else 0)  # [n, nb, 1]
    if wtype == qk.Q8_0:
        return d * blocks[..., 2:34].view(torch.int8).float()
    if wtype in (qk.Q4_0, qk.Q4_1):
        q = _nibbles(blocks[..., -16:]).float()  # [n, nb, 32]
        return d * (q - 8) if wtype == qk.Q4_0 else d * q + _f16(blocks, 2)
    if wtype in (qk.Q5_0, qk.Q5_1):
        qh = blocks[..., -20:-16]  # [n, nb, 4]: bit e of the little-endian word is element e's fifth bit
        high = _bits(qh, 8).transpose(-1, -2).reshape(n, nb, 32)  # element e = 8 byte + bit
        q = (_nibbles(blocks[..., -16:]) | (high << 4)).float()
        return d * (q - 16) if wtype == qk.Q5_0 else d * q + _f16(blocks, 2)
    if wtype in (qk.Q4_K, qk.Q5_K):
        scale, mins = _k_scales(blocks[..., 4:16])  # [n, nb, 8]: sub-block j = elements 32 j .. 32 j + 31
        qs = blocks[..., -128:].reshape(n, nb, 4, 32)  # run g: elements 64 g + p (low), 64 g + 32 + p (high)
        q = torch.stack((qs & 0xF, qs >> 4), dim=3).reshape(n, nb, 8, 32)  # [n, nb, j, 32]
        if wtype == qk.Q5_K:
            q = q | (_bits(blocks[..., 16:48], 8) << 4)  # element 32 j + l: bit j of qh[l]
        dmin = _f16(blocks, 2)
        return ((d * scale)[..., None] * q.float() - (dmin * mins)[..., None]).reshape(n, nb, 256)
    if wtype == qk.Q6_K:
        ql = blocks[..., 0:128].reshape(n, nb, 2, 2, 32)  # [half, which 32 of the half's 64 bytes, l]
        qh = blocks[..., 128:192].reshape(n, nb, 2, 1, 32)  # [half, -, l]
        low = torch.stack((ql & 0xF, ql >> 4), dim=3).reshape(n, nb, 2, 4, 32)  # t = 2 nibble + which
        shifts = torch.arange(0, 8, 2, dtype=torch.uint8, device=blocks.device)[:, None]  # [4, 1]: t -> 2 t
        q = (low | (((qh >> shifts) & 3) << 4)).reshape(n, nb, 256).float() - 32  # element 128 half + 32 t + l
        scales = blocks[..., 192:208].view(torch.int8).float().repeat_interleave(16, dim=-1)  # [n, nb, 256]
        return d * scales * q
    raise ValueError(f"no dequantizer for type id {wtype}")


def dequantize(w: qk.QuantMatrix, dtype: torch.dtype = torch.float32, rows: torch.Tensor | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """The matrix w (or its rows `rows` [R] long) as dtype [n, k] on w's device, into out when given, in pieces of
    about DEQUANT_CHUNK elements."""
    _, block, nbytes = qk.TYPES[w.wtype]
    data = w.data if rows is None else w.data.index_select(0, rows.to(w.device))  # [n, row_bytes]
    n = data.shape[0]
    if out is None:
        out = torch.empty(n, w.k, dtype=dtype, device=w.device)
    step = max(1, DEQUANT_CHUNK // w.k)
    for r in range(0, n, step):
        piece = data[r : r + step]
        out[r : r + step] = _dequantize_blocks(w.wtype, piece.view(piece.shape[0], -1, nbytes)).view(-1, w.k)
    return out


class GpuScratch:
    """The bf16 (or fp16) buffer on the GPU reused by every prefill product of a model: grown to the largest weight
    it has held, never shrunk."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.buf = torch.empty(0, dtype=dtype, device=device)

    def take(self, n: int) -> torch.Tensor:
        if self.buf.numel() < n:
            self.buf = torch.empty(0, dtype=self.buf.dtype, device=self.buf.device)  # free the old one first
            self.buf = torch.empty(n, dtype=self.buf.dtype, device=self.buf.device)
        return self.buf[:n]


class GpuQuantLinear:
    """x [T, k] -> x @ [W_0; W_1; ...]^T [T, sum n_out] (+ bias) for file matrices sharing an input (q/k/v;
    gate/up), their blocks on the GPU. Consecutive parts of one type are one QuantMatrix (one launch: q and k, gate and
    up in the usual files); a part of another type (llama.cpp's recipes give attn_v and some ffn_down Q6_K) is its
    own launch."""

    def __init__(self, parts: Sequence[quant.QuantWeight], device: torch.device, scratch: GpuScratch):
        if not parts or len({p.k for p in parts}) != 1:
            raise ValueError("GpuQuantLinear needs one or more weights of one input width")
        self.k = parts[0].k
        self.n_out = sum(p.n_out for p in parts)
        self.scratch = scratch
        runs: list[list[quant.QuantWeight]] = []
        for p in parts:
            if runs and runs[-1][0].wtype == p.wtype:
                runs[-1].append(p)
            else:
                runs.append([p])
        # each run's bytes straight from the mapped file to the GPU, then concatenated there (no host copy)
        self.groups = [_to_device(run, device) for run in runs]
        self.head_views: dict[int, GpuQuantLinear] = {}  # head(n) views, made once (query_ahead asks every step)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n_out, self.k)

    @property
    def nbytes(self) -> int:
        return sum(g.data.numel() for g in self.groups)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x [T, k] (bf16 / fp16 / fp32, unit last stride) -> [T, n_out] in out_dtype (default x's)."""
        if x.shape[0] > qk.MAX_M:
            y = F.linear(x, self.dense(x.dtype), bias)  # [T, n_out]
            return y if out_dtype is None else y.to(out_dtype)
        if len(self.groups) == 1:
            return qk.qgemv(x, self.groups[0], bias, out_dtype=out_dtype)
        y = torch.cat([qk.qgemv(x, g, out_dtype=out_dtype) for g in self.groups], dim=1)
        if bias is not None:
            y += bias
        return y

    def add_(self, res: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """res [T, n_out] += x [T, k] @ W^T in place; returns res."""
        if x.shape[0] <= qk.MAX_M and len(self.groups) == 1 and res.is_contiguous():
            return qk.qgemv_add_(res, x, self.groups[0])
        res += self(x)
        return res

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """For gate and up rows (n_out = 2F): silu(x @ gate^T) * (x @ up^T) [T, F] in x's dtype."""
        if x.shape[0] <= qk.MAX_M and len(self.groups) == 1:
            return qk.qgemv_silu_mul(x, self.groups[0])
        gate, up = self(x).chunk(2, dim=-1)  # [T, F] views
        return F.silu(gate).mul_(up)

    def head(self, n_rows: int) -> GpuQuantLinear:
        """The first n_rows outputs (q of q/k/v) as a matrix of their own, over the same device bytes."""
        if n_rows not in self.head_views:
            g = self.groups[0]
            if n_rows > g.n_rows:
                raise ValueError(f"the first {n_rows} rows span two block types")
            view = object.__new__(GpuQuantLinear)
            view.k, view.n_out, view.scratch, view.head_views = self.k, n_rows, self.scratch, {}
            view.groups = [qk.QuantMatrix(g.wtype, g.data[:n_rows], n_rows, g.k)]
            self.head_views[n_rows] = view
        return self.head_views[n_rows]

    def dense(self, dtype: torch.dtype, scratch: bool = True) -> torch.Tensor:
        """The whole matrix as dtype [n_out, k] on the GPU: in the shared scratch buffer (prefill products), or
        with scratch=False a tensor of its own (analysis tools)."""
        buf = self.scratch.take(self.n_out * self.k) if scratch and dtype == self.scratch.buf.dtype else None
        out = buf.view(self.n_out, self.k) if buf is not None else torch.empty(
            self.n_out, self.k, dtype=dtype, device=self.groups[0].device)
        at = 0
        for g in self.groups:
            dequantize(g, out=out[at : at + g.n_rows])
            at += g.n_rows
        return out

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ids [T] of a one-type matrix as dtype [T, k]: the embedding lookup."""
        (g,) = self.groups
        out = torch.empty(ids.shape[0], self.k, dtype=dtype, device=g.device)
        return dequantize(g, rows=ids, out=out)


def _to_device(run: list[quant.QuantWeight], device: torch.device) -> qk.QuantMatrix:
    """One type's matrices (same k) as one QuantMatrix on the device, their rows in order."""
    with warnings.catch_warnings():  # torch warns that the mapped file is read-only: it is only copied from
        warnings.simplefilter("ignore", UserWarning)
        mats = [qk.QuantMatrix.from_bytes(p.wtype, p.w, p.n_out, p.k, device) for p in run]
    if len(mats) == 1:
        return mats[0]
    return qk.QuantMatrix(run[0].wtype, torch.cat([m.data for m in mats]), sum(m.n_rows for m in mats), run[0].k)
