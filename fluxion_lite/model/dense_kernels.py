"""Triton kernels for the small per-layer ops of a CUDA decode step: RMSNorm, RoPE and the MLP's silu(gate) * up, one
kernel each.

Why: at decode (T = batch rows, often 1) these ops move a few KB, so their cost is kernel latency, not bytes. On the
H200 (8B shape, 32K, batch 1; bench/results/tpot_kernel_profile_h200_a0e8732_b1.txt) torch's fused rms_norm took
6.2 us per call (two per layer), RoPE as index_select + mul_ + addcmul_ ~8.2 us per layer and silu + mul_ 3.7 us:
~24 us of the ~240 us per layer. Here each is one short kernel.

Numerics: RMSNorm as model.rms_norm (fp32 statistics, the normalised row rounded to the model dtype, then times the
weight); RoPE x * cos + swap(x) * sin_signed in fp32, rounded once (torch's two in-place ops round twice, so the two
paths may differ by one ulp of the model dtype); silu(gate) * up likewise in fp32, rounded once. Layouts:
  rms_norm  x [T, d] with unit last stride, any row stride; weight [d]; out [T, d] contiguous, x's dtype
  rope_     x [T, H, D] in place (unit last stride), the first R dims of each head rotate; cos, sin [T, 1, R] rows
            of the RoPE table (model.RotaryEmbedding): style "neox" pairs (i, i + R/2), "interleaved" (2i, 2i + 1)
  silu_mul  gate_up [T, 2F] (gate then up, unit last stride) -> out [T, F] contiguous

Used on CUDA when device_kernels.enabled() (Triton present and its probe ran) unless the setting
FLUXION_DENSE_KERNELS=0.
"""
from __future__ import annotations

import torch

from fluxion_lite.sparse.device import kernels as device_kernels
from fluxion_lite.sparse.device.kernels import pow2, triton
from fluxion_lite.settings import ExperimentalSettings, Settings

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, N, x_row, eps, BLOCK: tl.constexpr, PDL: tl.constexpr):
        if PDL:  # (device_kernels.pdl_enabled) the next kernel may start now; x is the previous kernel's output
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        inside = cols < N
        x = tl.load(x_ptr + row * x_row + cols, mask=inside, other=0.0).to(tl.float32)  # [BLOCK]
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
        normed = (x * rstd).to(out_ptr.dtype.element_ty)  # rounded to the model dtype before the weight
        w = tl.load(w_ptr + cols, mask=inside, other=0.0)
        tl.store(out_ptr + row * N + cols, (normed.to(tl.float32) * w.to(tl.float32)).to(out_ptr.dtype.element_ty),
                 mask=inside)

    @triton.jit
    def _rope_kernel(x_ptr, cos_ptr, sin_ptr, H, x_t, x_h, c_t, s_t, R: tl.constexpr, NEOX: tl.constexpr):
        pid = tl.program_id(0)  # = t * H + h
        t, h = pid // H, pid % H
        ii = tl.arange(0, R)
        if NEOX:
            pair = (ii + R // 2) % R
        else:
            pair = ii ^ 1
        row = x_ptr + t * x_t + h * x_h
        x = tl.load(row + ii).to(tl.float32)  # [R]
        x_pair = tl.load(row + pair).to(tl.float32)  # both loads precede the store: one program owns the row
        c = tl.load(cos_ptr + t * c_t + ii).to(tl.float32)
        s = tl.load(sin_ptr + t * s_t + ii).to(tl.float32)
        tl.store(row + ii, (x * c + x_pair * s).to(x_ptr.dtype.element_ty))

    @triton.jit
    def _silu_mul_kernel(gu_ptr, out_ptr, F, gu_row, BLOCK: tl.constexpr):
        row, part = tl.program_id(0), tl.program_id(1)
        cols = part * BLOCK + tl.arange(0, BLOCK)
        inside = cols < F
        gate = tl.load(gu_ptr + row * gu_row + cols, mask=inside, other=0.0).to(tl.float32)  # [BLOCK]
        up = tl.load(gu_ptr + row * gu_row + F + cols, mask=inside, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * F + cols, (gate / (1.0 + tl.exp(-gate)) * up).to(out_ptr.dtype.element_ty),
                 mask=inside)


def enabled(device: torch.device, settings: Settings | None = None) -> bool:
    """Whether model.py should use these kernels on `device` (CUDA, Triton usable, the setting FLUXION_DENSE_KERNELS
    on: settings.dense_kernels; None: Settings.load())."""
    settings = settings if settings is not None else Settings.load()
    return device.type == "cuda" and settings.dense_kernels and device_kernels.enabled(device, settings)


def rope_enabled(device: torch.device, rope_dim: int, settings: Settings | None = None) -> bool:
    """Whether rope_ serves a model on `device` whose heads rotate `rope_dim` dims (a power of two: one tl.arange)."""
    return enabled(device, settings) and rope_dim == pow2(rope_dim)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, pdl: bool = ExperimentalSettings.pdl) -> torch.Tensor:
    """x [T, d] -> a new [T, d] tensor (see the module docstring). pdl: the setting FLUXION_PDL
    (device_kernels.pdl_enabled)."""
    T, d = x.shape
    assert x.stride(1) == 1 and weight.shape == (d,) and weight.is_contiguous()
    out = torch.empty((T, d), dtype=x.dtype, device=x.device)
    if T:
        block = pow2(d)
        _rms_norm_kernel[(T,)](x, weight, out, d, x.stride(0), eps, BLOCK=block, num_warps=8 if block >= 4096 else 4,
                               **device_kernels.launch_args(device_kernels.pdl_enabled(x.device, pdl)))
    return out


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool) -> None:
    """Rotate the first R dims of every head of x [T, H, D] in place by cos, sin [T, 1, R]."""
    T, H, _ = x.shape
    R = cos.shape[-1]
    assert x.stride(2) == 1 and cos.stride(-1) == 1 and sin.stride(-1) == 1 and R == pow2(R)
    if T and H:
        _rope_kernel[(T * H,)](x, cos, sin, H, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0), R=R,
                               NEOX=neox, num_warps=1)


SILU_BLOCK = 1024  # columns per program: F = 14336 (8B shape) is 14 programs per row


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2F] -> silu(gate) * up [T, F], a new tensor (see the module docstring)."""
    T, two_f = gate_up.shape
    assert gate_up.stride(1) == 1 and two_f % 2 == 0
    f = two_f // 2
    out = torch.empty((T, f), dtype=gate_up.dtype, device=gate_up.device)
    if T:
        _silu_mul_kernel[(T, triton.cdiv(f, SILU_BLOCK))](gate_up, out, f, gate_up.stride(0), BLOCK=SILU_BLOCK,
                                                          num_warps=4)
    return out
