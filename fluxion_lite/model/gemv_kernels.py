"""Triton matrix-vector kernels for the dense weights of a batch-1 CUDA decode step (one token row).

Why: at batch 1 a decode step's weight matmuls are matrix-vector products whose cost is reading the weights from HBM.
cuBLAS runs them as skinny GEMMs, and for most weights it splits K and adds a separate reduction kernel: in a traced
H200 step (8B shape, 32K, batch 1; bench/results/tpot_trace_h200_7a25f73_early1.json.gz) 94 such reductions took
0.67 ms, each a dependent launch on the layer's chain. Here one program owns BLOCK_N whole weight rows (a weight
[N, K] is row-major, so each row is one contiguous read), walks K in BLOCK_K chunks and keeps a [BLOCK_N, BLOCK_K]
fp32 partial in registers, reduced once at the end: no split, no second kernel. bench/gemv.py times these against
cuBLAS per weight shape; `config` below holds what it chose. Measured (docs/history.md): about
even with cuBLAS on the 8B shape's large weights in isolation, 1.2-1.9x faster on the 0.5b model's small ones, and
32K batch-1 TPOT 6.25 / 6.36 -> 6.18 / 6.28 ms on the 8B shape.

Three entry points, each one kernel:
  gemv          x [1, K] @ w[N, K]^T (+ bias [N]) -> [1, N]                      (q/k/v, vocabulary)
  gemv_add_     res [1, N] += x [1, K] @ w^T, in place                           (o-projection, down-projection)
  gemv_silu_mul x [1, K], w [2F, K] (gate rows then up rows) -> silu(gate) * up [1, F]  (the MLP's first half)
gemv can also rotate its first rows by RoPE (`Rope`: q and k of a q/k/v product, a program owning whole pairs) and
gemv / gemv_silu_mul can take the RMS norm of x inside (`Norm`); model.py uses what fuse_mode says (RoPE by
default: the norm inside measured slower on large weights, docs/history.md). Each takes an L2
eviction policy for its weight reads (l2_hints_enabled says why).

Numerics follow the cuBLAS path they replace: products summed in fp32; gemv rounds the sum (+ bias) to x's dtype
once (then stores it widened if out_dtype asks; with RoPE the rotation is rounded once more, as
dense_kernels.rope_); gemv_add_ adds the residual in fp32 and rounds once (as addmm_ with beta = 1 does);
gemv_silu_mul rounds gate and up to the weight dtype first (as the [1, 2F] matmul output would be) and then silu(gate) * up once, as
dense_kernels.silu_mul. Only the summation order differs from cuBLAS. Layouts: x contiguous [1, K]; w [N, K] with
unit last stride, any row stride; bias, res contiguous. Used by model.py when `enabled` (CUDA, Triton, the dense
kernels on, the setting FLUXION_GEMV on) for rows == 1; tests/test_gemv_kernels.py checks all three against float64.
The experimental settings (FLUXION_GEMV_FUSE, _L2_HINTS, _GEMV_CONFIG, _PDL) reach the kernels as arguments from
model.py, which has them from its settings.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from fluxion_lite.model import dense_kernels
from fluxion_lite.sparse.device.kernels import launch_args, pdl_enabled, triton
from fluxion_lite.settings import ExperimentalSettings, Settings

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _x_chunk(x_ptr, g_ptr, kk, k_ok, squares, NORM: tl.constexpr):
        """fp32 x [BLOCK_K] at columns kk, times the norm weight with NORM (squares gains x^2): (h chunk, squares)."""
        x = tl.load(x_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
        if NORM:
            squares += x * x
            x = x * tl.load(g_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
        return x, squares

    @triton.jit
    def _row_dots(x_ptr, w_ptr, rows, row_ok, K, w_row, g_ptr, eps, NORM: tl.constexpr, EVICT: tl.constexpr,
                  WAIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """fp32 [BLOCK_N]: the dot products of h [K] with the weight rows `rows`, where h = x, or with NORM the RMS
        norm x / sqrt(mean(x^2) + eps) * g. The norm's scale is one number, so it multiplies the dot products at
        the end, and the sum of squares builds up from the same loads of x: no pass over x before the weight reads
        start (such a pass in every program cost more than the separate norm kernel saved). h is not rounded to
        the model dtype on the way, as the separate norm's output is: one rounding fewer. EVICT: the L2 eviction
        policy of the weight loads ("" default, "evict_first", "evict_last"; see l2_hints_enabled). WAIT (a
        programmatic dependent launch, pdl_enabled): the first weight tile is requested before the wait for the
        previous kernel, whose output x is, so the weight stream starts while that kernel finishes."""
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        squares = tl.zeros([BLOCK_K], dtype=tl.float32)
        cols = tl.arange(0, BLOCK_K)
        start = 0
        if WAIT:
            w = tl.load(w_ptr + rows[:, None] * w_row + cols[None, :], mask=row_ok[:, None] & (cols < K)[None, :],
                        other=0.0, eviction_policy=EVICT)  # [BLOCK_N, BLOCK_K]: weights only, nothing x depends on
            tl.extra.cuda.gdc_wait()  # the previous kernel's writes (x, a residual) are visible after this
            x, squares = _x_chunk(x_ptr, g_ptr, cols, cols < K, squares, NORM)
            acc += w.to(tl.float32) * x[None, :]
            start = BLOCK_K
        for k0 in range(start, K, BLOCK_K):
            kk = k0 + cols
            k_ok = kk < K
            x, squares = _x_chunk(x_ptr, g_ptr, kk, k_ok, squares, NORM)  # [BLOCK_K]
            w = tl.load(w_ptr + rows[:, None] * w_row + kk[None, :], mask=row_ok[:, None] & k_ok[None, :],
                        other=0.0, eviction_policy=EVICT)  # [BLOCK_N, BLOCK_K]
            acc += w.to(tl.float32) * x[None, :]
        dots = tl.sum(acc, axis=1)
        if NORM:
            dots = dots / tl.sqrt(tl.sum(squares, axis=0) / K + eps)
        return dots

    @triton.jit
    def _gemv_kernel(x_ptr, w_ptr, b_ptr, res_ptr, out_ptr, g_ptr, cos_ptr, sin_ptr, N, K, w_row, eps, n_rot,
                     HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, NORM: tl.constexpr, ROPE: tl.constexpr,
                     NEOX: tl.constexpr, HEAD_DIM: tl.constexpr, EVICT: tl.constexpr, PDL: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        if PDL:  # the next kernel may be scheduled as this one's programs finish (it waits for them before reading)
            tl.extra.cuda.gdc_launch_dependents()
        pid = tl.program_id(0)
        lane = tl.arange(0, BLOCK_N)
        rows = pid * BLOCK_N + lane
        col = rows
        rotate = pid < 0
        if ROPE:
            # The first n_rot rows (q and k) rotate: their programs come first, each owning BLOCK_N / 2 whole pairs
            # (lane 2i the first member, lane 2i + 1 the second), so a pair meets in one program's registers.
            rope_programs = tl.cdiv(n_rot, BLOCK_N)
            rotate = (pid + 0 * lane) < rope_programs  # [BLOCK_N], the same for every lane
            pair = pid * (BLOCK_N // 2) + lane // 2
            second = lane % 2
            if NEOX:  # pairs (j, j + D/2) of each head
                col = pair % (HEAD_DIM // 2) + second * (HEAD_DIM // 2)
                rot_rows = (pair // (HEAD_DIM // 2)) * HEAD_DIM + col
            else:  # pairs (2j, 2j + 1)
                rot_rows = 2 * pair + second
                col = rot_rows % HEAD_DIM
            rows = tl.where(rotate, rot_rows, n_rot + (pid - rope_programs) * BLOCK_N + lane)
        row_ok = rows < N
        if ROPE:
            row_ok = rows < tl.where(rotate, n_rot, N)  # a rotating program's last pairs may pass n_rot
        y = _row_dots(x_ptr, w_ptr, rows, row_ok, K, w_row, g_ptr, eps, NORM, EVICT, PDL, BLOCK_N, BLOCK_K)
        if HAS_BIAS:
            y += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        if HAS_RES:  # res and out may be one tensor: each program reads its own rows before it writes them
            y += tl.load(res_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        y = y.to(x_ptr.dtype.element_ty)  # the model dtype, also when the output is stored wider (fp32 logits)
        if ROPE:
            # as dense_kernels.rope_: the rounded projection times the table's factors in fp32, rounded once more
            yf = y.to(tl.float32)
            rot_ok = row_ok & rotate
            c = tl.load(cos_ptr + col, mask=rot_ok, other=1.0).to(tl.float32)
            s = tl.load(sin_ptr + col, mask=rot_ok, other=0.0).to(tl.float32)
            y_first, y_second = tl.split(tl.reshape(yf, [BLOCK_N // 2, 2]))
            y_partner = tl.reshape(tl.join(y_second, y_first), [BLOCK_N])  # each lane's pair member
            y = tl.where(rot_ok, (yf * c + y_partner * s).to(x_ptr.dtype.element_ty), y)
        tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_ok)

    @triton.jit
    def _gemv_silu_mul_kernel(x_ptr, w_ptr, out_ptr, g_ptr, F, K, w_row, eps,
                              NORM: tl.constexpr, EVICT: tl.constexpr, PDL: tl.constexpr, BLOCK_N: tl.constexpr,
                              BLOCK_K: tl.constexpr):
        if PDL:
            tl.extra.cuda.gdc_launch_dependents()
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < F
        gate = _row_dots(x_ptr, w_ptr, rows, row_ok, K, w_row, g_ptr, eps, NORM, EVICT, PDL, BLOCK_N, BLOCK_K)
        up = _row_dots(x_ptr, w_ptr, rows + F, row_ok, K, w_row, g_ptr, eps, NORM, EVICT, False, BLOCK_N, BLOCK_K)
        gate = gate.to(w_ptr.dtype.element_ty).to(tl.float32)  # rounded as the [1, 2F] matmul output would be
        up = up.to(w_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + rows, (gate / (1.0 + tl.exp(-gate)) * up).to(out_ptr.dtype.element_ty), mask=row_ok)


def enabled(device: torch.device, settings: Settings | None = None) -> bool:
    """Whether model.py should run batch-1 weight products here (CUDA, Triton, dense kernels on, the setting
    FLUXION_GEMV on: settings.gemv; None: Settings.load())."""
    settings = settings if settings is not None else Settings.load()
    return dense_kernels.enabled(device, settings) and settings.gemv


FUSE_MODES = ("none", "rope", "all")


def fuse_mode(settings: Settings | None = None) -> str:
    """What model.py moves into these kernels besides the product (FLUXION_GEMV_FUSE): "rope" (default) RoPE after
    q/k/v and the early query; "all" also the RMS norm before q/k/v, gate/up and the vocabulary; "none" neither.
    Why not "all": on the 8B shape's large weights the norm's extra loads in the weight loop cost more than the norm
    kernel they replace (docs/history.md)."""
    # the setting is settings.experimental.gemv_fuse (None: Settings.load()); a bad value is a SettingError (also a
    # RequestError) naming the variable, raised when the settings are loaded
    return (settings if settings is not None else Settings.load()).experimental.gemv_fuse


EVICT_POLICIES = ("", "evict_first", "evict_last")


def _evict(policy: str) -> str:
    assert policy in EVICT_POLICIES, policy
    return policy


def l2_hints_enabled(settings: Settings | None = None) -> bool:
    """Whether model.py passes L2 eviction policies with the batch-1 weight reads (the setting FLUXION_L2_HINTS:
    settings.experimental.l2_hints; None: Settings.load()): the early query (device_graph.py) reads layer l's q rows
    during layer l - 1's MLP, and layer l's q/k/v product reads them again ~100 us later. With the early query's
    loads marked evict_last and every other weight read (read once per step) evict_first, those rows can still be in
    L2 (50 MB on the H200; the 8B shape's q rows are 33.6 MB)."""
    return (settings if settings is not None else Settings.load()).experimental.l2_hints


TABLE = Path(__file__).with_name("gemv_configs.json")  # written by `bench/gemv.py --write-table` on the H200
DEFAULT_CONFIG = (4, 512, 4)


@functools.cache
def _table() -> dict[str, tuple[int, int, int]]:
    if not TABLE.exists():
        return {}
    return {key: (int(c[0]), int(c[1]), int(c[2])) for key, c in json.loads(TABLE.read_text())["configs"].items()}


Tiles = tuple[int, int, int]  # (BLOCK_N, BLOCK_K, num_warps)


def config(n: int, k: int, kind: str = "plain", forced: Tiles | None = ExperimentalSettings.gemv_config) -> Tiles:
    """(BLOCK_N, BLOCK_K, num_warps) for `kind` ("plain": gemv and gemv_add_, "silu": gemv_silu_mul with F = n) over
    a weight of n rows (F rows each of gate and up for silu) and k columns: `forced` if given (the setting
    FLUXION_GEMV_CONFIG="bn,bk,warps", bench/gemv.py's sweep), else the tuned table's entry for the shape, else
    DEFAULT_CONFIG."""
    if forced is not None:
        return forced
    return _table().get(f"{kind}:{n}x{k}", DEFAULT_CONFIG)


@dataclass(frozen=True)
class Norm:
    """An RMS norm applied to x inside the kernel: h = x / sqrt(mean(x^2) + eps) * weight, in fp32 (not rounded to
    the model dtype as dense_kernels.rms_norm's output is)."""

    weight: torch.Tensor  # [K], contiguous
    eps: float


@dataclass(frozen=True)
class Rope:
    """RoPE applied to the first `rows` output rows (q and k heads of head_dim each) inside gemv, as
    dense_kernels.rope_ would apply it to the rounded output. cos, sin: the step's rows of the RoPE table [1, 1, D]
    (model.RotaryEmbedding; rope_dim == head_dim), unit last stride."""

    cos: torch.Tensor
    sin: torch.Tensor
    rows: int
    head_dim: int
    neox: bool


def _check(x: torch.Tensor, w: torch.Tensor, norm: Norm | None = None) -> tuple[int, int]:
    n, k = w.shape
    assert x.shape == (1, k) and x.is_contiguous() and w.stride(1) == 1, (x.shape, w.shape, w.stride())
    assert norm is None or (norm.weight.shape == (k,) and norm.weight.is_contiguous()), "norm weight must be [K]"
    return n, k


def _norm_args(norm: Norm | None, x: torch.Tensor) -> dict:
    """The kernel arguments of an optional fused norm (weight pointer, eps, NORM)."""
    return dict(g_ptr=norm.weight if norm is not None else x, eps=norm.eps if norm is not None else 0.0,
                NORM=norm is not None)


def _rope_args(rope: Rope | None, x: torch.Tensor, n: int) -> dict:
    """The kernel arguments of an optional RoPE of the first rope.rows outputs (any pointer when there is none)."""
    if rope is None:
        return dict(cos_ptr=x, sin_ptr=x, n_rot=0, ROPE=False, NEOX=False, HEAD_DIM=2)
    d = rope.head_dim
    assert rope.rows % d == 0 and rope.rows <= n and d % 2 == 0, (rope.rows, d, n)
    assert rope.cos.shape[-1] == d and rope.cos.stride(-1) == 1 and rope.sin.stride(-1) == 1, "rope_dim != head_dim"
    return dict(cos_ptr=rope.cos, sin_ptr=rope.sin, n_rot=rope.rows, ROPE=True, NEOX=rope.neox, HEAD_DIM=d)


def gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, norm: Norm | None = None,
         rope: Rope | None = None, out_dtype: torch.dtype | None = None, evict: str = "",
         pdl: bool = ExperimentalSettings.pdl, tiles: Tiles | None = ExperimentalSettings.gemv_config) -> torch.Tensor:
    """h @ w [N, K]^T (+ bias [N]) -> a new [1, N] tensor, where h = x [1, K] or its RMS norm (`norm`); `rope`
    rotates the first rope.rows outputs. The result is rounded to x's dtype and stored as out_dtype (default x's:
    fp32 logits are the rounded values widened, as the unfused `.float()` gives). evict: the weight loads' L2
    eviction policy (EVICT_POLICIES). pdl: the setting FLUXION_PDL (device_kernels.pdl_enabled); tiles: one tiling
    in place of the table's (config's `forced`, the setting FLUXION_GEMV_CONFIG)."""
    n, k = _check(x, w, norm)
    out = torch.empty((1, n), dtype=out_dtype or x.dtype, device=x.device)
    bn, bk, warps = config(n, k, forced=tiles)
    rot = 0 if rope is None else rope.rows
    if rope is not None:
        bn = max(bn, 2)  # a program owns whole pairs
    programs = triton.cdiv(rot, bn) + triton.cdiv(n - rot, bn)  # the rotating rows' programs first
    _gemv_kernel[(programs,)](x, w, bias if bias is not None else w, out, out, N=n, K=k, w_row=w.stride(0),
                              HAS_BIAS=bias is not None, HAS_RES=False, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
                              EVICT=_evict(evict), **_norm_args(norm, x), **_rope_args(rope, x, n),
                              **launch_args(pdl_enabled(x.device, pdl)))
    return out


def gemv_add_(res: torch.Tensor, x: torch.Tensor, w: torch.Tensor, evict: str = "",
              pdl: bool = ExperimentalSettings.pdl, tiles: Tiles | None = ExperimentalSettings.gemv_config
              ) -> torch.Tensor:
    """res [1, N] += x [1, K] @ w [N, K]^T, in place; returns res. evict, pdl, tiles: as gemv's."""
    n, k = _check(x, w)
    assert res.shape == (1, n) and res.is_contiguous() and res.dtype == x.dtype
    bn, bk, warps = config(n, k, forced=tiles)
    _gemv_kernel[(triton.cdiv(n, bn),)](x, w, w, res, res, N=n, K=k, w_row=w.stride(0), HAS_BIAS=False,
                                       HAS_RES=True, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, EVICT=_evict(evict),
                                       **launch_args(pdl_enabled(x.device, pdl)), **_norm_args(None, x),
                                       **_rope_args(None, x, n))
    return res


def gemv_silu_mul(x: torch.Tensor, w_gate_up: torch.Tensor, norm: Norm | None = None,
                  evict: str = "", pdl: bool = ExperimentalSettings.pdl,
                  tiles: Tiles | None = ExperimentalSettings.gemv_config) -> torch.Tensor:
    """h [1, K] (x, or its RMS norm with `norm`), w_gate_up [2F, K] (gate rows, then up rows)
    -> silu(h @ gate^T) * (h @ up^T) [1, F]. evict, pdl, tiles: as gemv's."""
    two_f, k = _check(x, w_gate_up, norm)
    assert two_f % 2 == 0
    f = two_f // 2
    out = torch.empty((1, f), dtype=x.dtype, device=x.device)
    bn, bk, warps = config(f, k, "silu", forced=tiles)
    _gemv_silu_mul_kernel[(triton.cdiv(f, bn),)](x, w_gate_up, out, F=f, K=k, w_row=w_gate_up.stride(0),
                                                BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, EVICT=_evict(evict),
                                                **_norm_args(norm, x), **launch_args(pdl_enabled(x.device, pdl)))
    return out
