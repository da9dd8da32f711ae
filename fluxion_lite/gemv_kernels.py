"""Triton matrix-vector kernels for the dense weights of a batch-1 CUDA decode step (one token row).

Why: at batch 1 a decode step's weight matmuls are matrix-vector products whose cost is reading the weights from HBM.
cuBLAS runs them as skinny GEMMs, and for most weights it splits K and adds a separate reduction kernel: in a traced
H200 step (8B shape, 32K, batch 1; bench/results/tpot_trace_h200_7a25f73_early1.json.gz) 94 such reductions took
0.67 ms, each a dependent launch on the layer's chain. Here one program owns BLOCK_N whole weight rows (a weight
[N, K] is row-major, so each row is one contiguous read), walks K in BLOCK_K chunks and keeps a [BLOCK_N, BLOCK_K]
fp32 partial in registers, reduced once at the end: no split, no second kernel. bench/gemv.py times these against
cuBLAS per weight shape; `config` below holds what it chose. Measured (docs/hybrid.md, twenty-third session): about
even with cuBLAS on the 8B shape's large weights in isolation, 1.2-1.9x faster on the 0.5b model's small ones, and
32K batch-1 TPOT 6.25 / 6.36 -> 6.18 / 6.28 ms on the 8B shape.

Three entry points, each one kernel:
  gemv          x [1, K] @ w[N, K]^T (+ bias [N]) -> [1, N]                      (q/k/v, vocabulary)
  gemv_add_     res [1, N] += x [1, K] @ w^T, in place                           (o-projection, down-projection)
  gemv_silu_mul x [1, K], w [2F, K] (gate rows then up rows) -> silu(gate) * up [1, F]  (the MLP's first half)

Numerics follow the cuBLAS path they replace: products summed in fp32; gemv rounds the sum (+ bias) to the output
dtype once; gemv_add_ adds the residual in fp32 and rounds once (as addmm_ with beta = 1 does); gemv_silu_mul rounds
gate and up to the weight dtype first (as the [1, 2F] matmul output would be) and then silu(gate) * up once, as
dense_kernels.silu_mul. Only the summation order differs from cuBLAS. Layouts: x contiguous [1, K]; w [N, K] with
unit last stride, any row stride; bias, res contiguous. Used by model.py when `enabled` (CUDA, Triton, the dense
kernels on, FLUXION_GEMV != 0) for rows == 1; tests/test_gemv_kernels.py checks all three against float64.
"""
from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import torch

from . import dense_kernels
from .device_kernels import triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _row_dots(x_ptr, w_ptr, rows, row_ok, K, w_row, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """fp32 [BLOCK_N]: the dot products of x [K] with the weight rows `rows`."""
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        cols = tl.arange(0, BLOCK_K)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + cols
            k_ok = kk < K
            x = tl.load(x_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)  # [BLOCK_K]
            w = tl.load(w_ptr + rows[:, None] * w_row + kk[None, :], mask=row_ok[:, None] & k_ok[None, :],
                        other=0.0)  # [BLOCK_N, BLOCK_K]
            acc += w.to(tl.float32) * x[None, :]
        return tl.sum(acc, axis=1)

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, b_ptr, res_ptr, out_ptr, N, K, w_row,
                     HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        y = _row_dots(x_ptr, w_ptr, rows, row_ok, K, w_row, BLOCK_N, BLOCK_K)  # [BLOCK_N] fp32
        if HAS_BIAS:
            y += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        if HAS_RES:  # res and out may be one tensor: each program reads its own rows before it writes them
            y += tl.load(res_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_ok)

    @triton.jit
    def _gemv_silu_mul_kernel(x_ptr, w_ptr, out_ptr, F, K, w_row, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < F
        gate = _row_dots(x_ptr, w_ptr, rows, row_ok, K, w_row, BLOCK_N, BLOCK_K)
        up = _row_dots(x_ptr, w_ptr, rows + F, row_ok, K, w_row, BLOCK_N, BLOCK_K)
        gate = gate.to(w_ptr.dtype.element_ty).to(tl.float32)  # rounded as the [1, 2F] matmul output would be
        up = up.to(w_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + rows, (gate / (1.0 + tl.exp(-gate)) * up).to(out_ptr.dtype.element_ty), mask=row_ok)


def enabled(device: torch.device) -> bool:
    """Whether model.py should run batch-1 weight products here (CUDA, Triton, dense kernels on, FLUXION_GEMV != 0)."""
    return dense_kernels.enabled(device) and os.environ.get("FLUXION_GEMV", "1") != "0"


TABLE = Path(__file__).with_name("gemv_configs.json")  # written by `bench/gemv.py --write-table` on the H200
DEFAULT_CONFIG = (4, 512, 4)


@functools.cache
def _table() -> dict[str, tuple[int, int, int]]:
    if not TABLE.exists():
        return {}
    return {key: (int(c[0]), int(c[1]), int(c[2])) for key, c in json.loads(TABLE.read_text())["configs"].items()}


def config(n: int, k: int, kind: str = "plain") -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for `kind` ("plain": gemv and gemv_add_, "silu": gemv_silu_mul with F = n) over
    a weight of n rows (F rows each of gate and up for silu) and k columns: FLUXION_GEMV_CONFIG="bn,bk,warps" if set
    (bench/gemv.py's sweep), else the tuned table's entry for the shape, else DEFAULT_CONFIG."""
    forced = os.environ.get("FLUXION_GEMV_CONFIG")
    if forced:
        bn, bk, warps = (int(v) for v in forced.split(","))
        return bn, bk, warps
    return _table().get(f"{kind}:{n}x{k}", DEFAULT_CONFIG)


def _check(x: torch.Tensor, w: torch.Tensor) -> tuple[int, int]:
    n, k = w.shape
    assert x.shape == (1, k) and x.is_contiguous() and w.stride(1) == 1, (x.shape, w.shape, w.stride())
    return n, k


def gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [1, K] @ w [N, K]^T (+ bias [N]) -> a new [1, N] tensor of x's dtype."""
    n, k = _check(x, w)
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    bn, bk, warps = config(n, k)
    _gemv_kernel[(triton.cdiv(n, bn),)](x, w, bias if bias is not None else w, out, out, n, k, w.stride(0),
                                       HAS_BIAS=bias is not None, HAS_RES=False, BLOCK_N=bn, BLOCK_K=bk,
                                       num_warps=warps)
    return out


def gemv_add_(res: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """res [1, N] += x [1, K] @ w [N, K]^T, in place; returns res."""
    n, k = _check(x, w)
    assert res.shape == (1, n) and res.is_contiguous() and res.dtype == x.dtype
    bn, bk, warps = config(n, k)
    _gemv_kernel[(triton.cdiv(n, bn),)](x, w, w, res, res, n, k, w.stride(0), HAS_BIAS=False, HAS_RES=True,
                                       BLOCK_N=bn, BLOCK_K=bk, num_warps=warps)
    return res


def gemv_silu_mul(x: torch.Tensor, w_gate_up: torch.Tensor) -> torch.Tensor:
    """x [1, K], w_gate_up [2F, K] (gate rows, then up rows) -> silu(x @ gate^T) * (x @ up^T) [1, F]."""
    two_f, k = _check(x, w_gate_up)
    assert two_f % 2 == 0
    f = two_f // 2
    out = torch.empty((1, f), dtype=x.dtype, device=x.device)
    bn, bk, warps = config(f, k, "silu")
    _gemv_silu_mul_kernel[(triton.cdiv(f, bn),)](x, w_gate_up, out, f, k, w_gate_up.stride(0), BLOCK_N=bn,
                                                BLOCK_K=bk, num_warps=warps)
    return out
