"""Triton matrix-vector kernels for GGUF-quantized weights kept in their block formats on the GPU (decode, M <= 16).

Why: a decode step on the GPU is a weight read. The Llama-3.1-8B step reads about 15 GB of bf16 weights; in Q4_K_M
(Q4_K with some Q6_K) the same weights are about 4.6 GB, 3.3x fewer bytes, so a kernel that reads the file's blocks
as they are and dequantizes them in registers can be up to ~3x faster than bf16 at batch 1, and the model fits on
smaller cards. One program owns BLOCK_N whole weight rows (a row is contiguous: k / B blocks back to back), walks K
by KB blocks per step (super-blocks of 256 for the K types), handles all M <= 16 rows of x in the same program (each
weight byte is read once), and keeps fp32 partials in registers, reduced once at the end: no split-K, no second
kernel.

Three entry points, each one kernel launch (mirroring gemv_kernels.py):
  qgemv          x [M, K] @ W [N, K]^T (+ bias [N]) -> [M, N]                        (q/k/v, vocabulary)
  qgemv_add_     res [M, N] += x [M, K] @ W^T, in place                               (o-projection, down-projection)
  qgemv_silu_mul x [M, K], W [2F, K] (gate rows then up rows) -> silu(gate) * up [M, F]  (the MLP's first half)
W is a QuantMatrix: the type id (fluxion_lite.hostkv.quant.TYPE_IDS) and the file's bytes as one uint8 tensor
[N, row_bytes] on the device, rows contiguous.

Layouts read (native/fluxion.h, "QUANTIZED WEIGHTS", states them byte by byte; B elements, bytes per block):
  Q4_0 (32, 18)   f16 d | qs[16]                           d * (n - 8)
  Q4_1 (32, 20)   f16 d | f16 m | qs[16]                   d * n + m
  Q5_0 (32, 22)   f16 d | qh[4] | qs[16]                   d * (n + 16 h - 16)
  Q5_1 (32, 24)   f16 d | f16 m | qh[4] | qs[16]           d * (n + 16 h) + m
  Q8_0 (32, 34)   f16 d | int8 qs[32]                      d * qs
      n(e) = low nibble of qs[e] for e < 16, high nibble of qs[e - 16] above; h(e) = bit e of qh as a uint32
  Q4_K (256, 144) f16 d | f16 dmin | scales[12] | qs[128]  d * sc[j] * n - dmin * mn[j], j = e / 32 (6-bit sc, mn)
  Q5_K (256, 176) as Q4_K with qh[32] before qs: n + 16 * bit j of qh[e % 32]
  Q6_K (256, 210) ql[128] | qh[64] | int8 scales[16] | f16 d   d * scales[e / 16] * (q - 32), q 6-bit
How a program reads them: the integer parts (qs; Q6_K's ql and qh) come in runs of 32 bytes (16 for the 4-bit
32-blocks), one run per group of elements whose x are contiguous: byte p of a Q4_K run is element 64 g + p (low
nibble) and 64 g + 32 + p (high), of a Q4_0 block element p and p + 16. A thread holds PE consecutive bytes of a run
(PR = run / PE threads per run), the threads of a program cover runs, then rows, then blocks, and every load (weights,
scale fields, x) is made through a pointer tile of one 6-D shape [BLOCK_M, PE2, PE1, KB, BLOCK_N, PR], so that Triton
gives them all the same layout and the loop needs no layout conversion: PE1 bytes (one vector: 16 for Q4_K / Q5_K
runs, which start at multiples of 16; 4 for Q4_1 / Q5_1; 2 for Q6_K's 210-byte and the other 32-blocks' 18 / 22 /
34-byte blocks) and the same count of contiguous x elements (at most 16 bytes: 8 bf16), PE2 such pieces per thread;
the lanes that differ in row read the same x (broadcast loads, from L1). Scale fields are loaded once per block and
row: Q4_K / Q5_K's 12 packed scale bytes as three int32 words, f16 fields through an fp16 view of the same bytes.
Integer parts become floats by the exponent trick (n | 0x4B000000 read as fp32 is 2^23 + n, exactly), not by
int-to-float conversions, which run at 1/8 of the FMA rate on Hopper; on CUDA, with 4 or more bytes per vector, one
PRMT per element (inline PTX on the loaded words) does the byte extract, mask and OR.

Numerics: each weight is dequantized in fp32 exactly as fluxion.h states (every product in the formulas is exact in
fp32, so each element is its exact value rounded once: what ggml, gguf-py and the native dequantizer give); x is
read as its dtype (bf16, fp16 or fp32) and used as fp32; products are summed in fp32 (the order differs from the
CPU's). qgemv adds the bias in fp32 and rounds once to out_dtype (default x's dtype); qgemv_add_ adds the residual
in fp32 and rounds once to res's dtype; qgemv_silu_mul computes silu(gate) * up from the fp32 sums and rounds once
to x's dtype. The native CPU path (hostkv.quant) quantizes x to 8 bits first; this one does not.

Tunables: (BLOCK_N, PE, num_warps) per launch (`Tiles`; KB follows: launch_shape), by default from DEFAULT_TILES per
weight type and M; bench/qgemv.py times them. Layouts: x [M, K] with unit last stride (any row stride); bias [N] and
res [M, N] contiguous. Triton missing: triton is None here and the entry points raise RuntimeError. On the CPU the
kernels run only in Triton's interpreter (TRITON_INTERPRET=1; tests/kernels/test_qgemv_kernels.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fluxion_lite.settings import triton_interpreter
from fluxion_lite.sparse.device.kernels import triton

# GGUF type ids (fluxion_lite.hostkv.quant.TYPE_IDS; kept here so that importing this module needs no native library)
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K = 2, 3, 6, 7, 8, 12, 13, 14
# type id -> (name, elements per block, bytes per block) of the types these kernels read
TYPES: dict[int, tuple[str, int, int]] = {
    Q4_0: ("Q4_0", 32, 18), Q4_1: ("Q4_1", 32, 20), Q5_0: ("Q5_0", 32, 22), Q5_1: ("Q5_1", 32, 24),
    Q8_0: ("Q8_0", 32, 34), Q4_K: ("Q4_K", 256, 144), Q5_K: ("Q5_K", 256, 176), Q6_K: ("Q6_K", 256, 210),
}
MAX_M = 16  # rows of x per call: each program keeps all of them in registers
X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# Largest PE (bytes of integer parts per thread and run) the layout allows: the alignment of the runs (Q4_K / Q5_K
# blocks start at multiples of 16 bytes; Q4_1 / Q5_1's qs at multiples of 4; the rest only of 2), and at most 16 bytes
# of x per thread and load (bf16: 8 elements), so that x's loads get the same layout as the weights'.
_ALIGN = {Q4_K: 16, Q5_K: 16, Q4_1: 4, Q5_1: 4, Q6_K: 2, Q8_0: 2, Q4_0: 2, Q5_0: 2}
_RUN = {t: (16 if TYPES[t][1] == 32 and t != Q8_0 else 32) for t in TYPES}  # bytes of a run (a block's qs)

Tiles = tuple[int, int, int]  # (BLOCK_N rows per program, PE bytes per thread, num_warps)
# A program's 32 * num_warps threads cover PR = run / PE threads per run, then BLOCK_N rows, then KB blocks per step,
# KB = 32 * num_warps / (PR * BLOCK_N) (>= 1; below that, each thread takes several rows). Per thread the partials
# are BLOCK_M * PE * (rows per thread) fp32. Key: (type id, largest M of the bucket). bench/qgemv.py sweeps them.
DEFAULT_TILES: dict[tuple[int, int], Tiles] = {}
for _t in TYPES:  # M = 1: whole runs per thread where the alignment allows (fewer scale computations per element)
    DEFAULT_TILES |= {(_t, 1): (8, 32, 4), (_t, 2): (8, 8, 4), (_t, 4): (8, 4, 4), (_t, 8): (8, 4, 4),
                      (_t, 16): (8, 2, 4)}
DEFAULT_TILES |= {(Q6_K, 1): (8, 16, 4)}
del _t


def block_m(m: int) -> int:
    """BLOCK_M: the power of two >= m (1, 2, 4, 8, 16), the bucket of DEFAULT_TILES."""
    return 1 << max(0, (m - 1).bit_length())


def default_tiles(wtype: int, m: int) -> Tiles:
    """DEFAULT_TILES' tiling for weight type `wtype` and m rows of x."""
    return DEFAULT_TILES[(wtype, block_m(m))]


def launch_shape(wtype: int, tiles: Tiles, x_dtype: torch.dtype) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, PE1, PE2, KB, num_warps) as launched for `tiles` = (BLOCK_N, PE, num_warps): PE capped at the run,
    split into PE2 pieces of PE1 bytes, PE1 the widest the type's alignment and x's 16-byte vectors allow."""
    bn, pe, warps = tiles
    pe = min(pe, _RUN[wtype])
    pe1 = min(pe, _ALIGN[wtype], 16 // torch.empty(0, dtype=x_dtype).element_size())
    kb = max(1, 32 * warps // (_RUN[wtype] // pe * bn))
    return bn, pe1, pe // pe1, kb, warps


@dataclass(frozen=True)
class QuantMatrix:
    """A weight matrix W [n_rows, k] in a GGUF block format on one device: `data` holds the file's bytes,
    uint8 [n_rows, row_bytes], contiguous (row r at byte r * row_bytes)."""

    wtype: int  # GGUF type id, one of TYPES
    data: torch.Tensor  # uint8 [n_rows, row_bytes]
    n_rows: int
    k: int

    def __post_init__(self) -> None:
        if self.wtype not in TYPES:
            raise ValueError(f"weight type {self.wtype!r} is not supported by the quantized GPU kernels "
                             f"(supported: {sorted(name for name, _, _ in TYPES.values())})")
        name, block, _ = TYPES[self.wtype]
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k <= 0 or self.k % block:
            raise ValueError(f"k={self.k!r} is not a positive multiple of {name}'s block of {block}")
        if isinstance(self.n_rows, bool) or not isinstance(self.n_rows, int) or self.n_rows < 0:
            raise ValueError(f"n_rows must be an int >= 0, got {self.n_rows!r}")
        if not isinstance(self.data, torch.Tensor) or self.data.dtype != torch.uint8:
            raise ValueError(f"data must be a uint8 tensor, got {getattr(self.data, 'dtype', type(self.data))}")
        if tuple(self.data.shape) != (self.n_rows, self.row_bytes) or not self.data.is_contiguous():
            raise ValueError(f"data must be a contiguous uint8 [{self.n_rows}, {self.row_bytes}] tensor, got "
                             f"{list(self.data.shape)}{'' if self.data.is_contiguous() else ' (not contiguous)'}")

    @property
    def name(self) -> str:
        return TYPES[self.wtype][0]

    @property
    def row_bytes(self) -> int:
        _, block, nbytes = TYPES[self.wtype]
        return self.k // block * nbytes

    @property
    def device(self) -> torch.device:
        return self.data.device

    @classmethod
    def from_bytes(cls, wtype: int | str, data: Any, n_rows: int, k: int,
                   device: torch.device | str | None = None) -> QuantMatrix:
        """From a type (id or name) and the matrix's bytes: a torch tensor or numpy array of any dtype holding
        exactly n_rows * row_bytes bytes, C-contiguous; copied to `device` (default: where it is)."""
        tid = _type_id(wtype)
        name, block, nbytes = TYPES[tid]
        if isinstance(k, bool) or not isinstance(k, int) or k <= 0 or k % block:
            raise ValueError(f"k={k!r} is not a positive multiple of {name}'s block of {block}")
        if not isinstance(data, torch.Tensor):
            import numpy as np

            if not isinstance(data, np.ndarray):
                raise ValueError(f"data must be a torch tensor or a numpy array, got {type(data).__name__}")
            if not data.flags.c_contiguous:
                raise ValueError("data must be C-contiguous")
            data = torch.from_numpy(data.reshape(-1).view(np.uint8))
        if not data.is_contiguous():
            raise ValueError("data must be contiguous")
        rb = k // block * nbytes
        if data.numel() * data.element_size() != n_rows * rb:
            raise ValueError(f"data holds {data.numel() * data.element_size()} bytes, expected {n_rows} rows of "
                             f"{rb} ({name}, k={k})")
        raw = data.reshape(-1).view(torch.uint8).reshape(n_rows, rb)
        return cls(tid, raw.to(device) if device is not None else raw, n_rows, k)

    @classmethod
    def from_quant_weight(cls, qw: Any, device: torch.device | str | None = None) -> QuantMatrix:
        """From a fluxion_lite.hostkv.quant.QuantWeight (its bytes copied to `device`)."""
        return cls.from_bytes(qw.wtype, qw.w, qw.n_out, qw.k, device)


def _type_id(wtype: int | str) -> int:
    if isinstance(wtype, str):
        ids = {name: tid for tid, (name, _, _) in TYPES.items()}
        if wtype.upper() not in ids:
            raise ValueError(f"weight type {wtype!r} is not supported by the quantized GPU kernels "
                             f"(supported: {sorted(ids)})")
        return ids[wtype.upper()]
    if isinstance(wtype, bool) or int(wtype) not in TYPES:
        raise ValueError(f"weight type {wtype!r} is not supported by the quantized GPU kernels "
                         f"(supported ids: {sorted(TYPES)})")
    return int(wtype)


if triton is not None:
    import triton.language as tl

    MAGIC = tl.constexpr(0x4B000000)  # fp32 bits of 2^23: (n | MAGIC) read as fp32 is 2^23 + n for 0 <= n < 2^23

    @triton.jit
    def _float(n, offset: tl.constexpr):
        """int32 n in [0, 2^23) -> fp32 n - offset, exactly (offset an integer below 2^23): an OR and an FADD in
        place of an int-to-float conversion, which runs at 1/8 of the FMA rate on Hopper."""
        return (n | MAGIC).to(tl.float32, bitcast=True) - (8388608.0 + offset)

    @triton.jit
    def _nibble(q, HI: tl.constexpr, ASM: tl.constexpr):
        """uint8 q -> fp32 2^23 + its low (HI false) or high nibble, exactly (subtract 2^23 for the nibble). ASM
        (CUDA, 4 consecutive bytes per thread): on the loaded 32-bit words, one PRMT per element puts the masked
        byte under the exponent of 2^23 (instead of a byte extract, a mask and an OR)."""
        if ASM:
            if HI:
                return tl.inline_asm_elementwise(
                    "{ .reg .b32 t, m; shr.u32 t, $4, 4; and.b32 t, t, 0x0f0f0f0f; mov.b32 m, 0x4b000000; "
                    "prmt.b32 $0, t, m, 0x7650; prmt.b32 $1, t, m, 0x7651; prmt.b32 $2, t, m, 0x7652; "
                    "prmt.b32 $3, t, m, 0x7653; }", "=r,=r,=r,=r,r", [q], dtype=tl.float32, is_pure=True, pack=4)
            else:
                return tl.inline_asm_elementwise(
                    "{ .reg .b32 t, m; and.b32 t, $4, 0x0f0f0f0f; mov.b32 m, 0x4b000000; "
                    "prmt.b32 $0, t, m, 0x7650; prmt.b32 $1, t, m, 0x7651; prmt.b32 $2, t, m, 0x7652; "
                    "prmt.b32 $3, t, m, 0x7653; }", "=r,=r,=r,=r,r", [q], dtype=tl.float32, is_pure=True, pack=4)
        else:
            n = q.to(tl.int32)
            if HI:
                n = n >> 4
            else:
                n = n & 15
            return (n | MAGIC).to(tl.float32, bitcast=True)

    @triton.jit
    def _with_bit4(f, bit):
        """fp32 2^23 + n (n < 16) -> 2^23 + n + 16 * bit (bit int32 0 / 1), on the bits."""
        return (f.to(tl.int32, bitcast=True) | (bit << 4)).to(tl.float32, bitcast=True)

    @triton.jit
    def _k_scale(sw0, sw1, sw2, J: tl.constexpr):
        """Q4_K / Q5_K: the 6-bit scale and min of sub-block J, as fp32, from the scale words (bytes 0-3, 4-7,
        8-11 of `scales`, little-endian int32)."""
        if J < 4:
            sc = (sw0 >> (8 * J)) & 63
            mn = (sw1 >> (8 * J)) & 63
        else:
            sc = ((sw2 >> (8 * (J - 4))) & 15) | (((sw0 >> (8 * (J - 4) + 6)) & 3) << 4)
            mn = ((sw2 >> (8 * (J - 4) + 4)) & 15) | (((sw1 >> (8 * (J - 4) + 6)) & 3) << 4)
        return sc.to(tl.float32), mn.to(tl.float32)

    # Tiles are 6-D, [BLOCK_M, PE2, PE1, KB, BLOCK_N, PR]: a thread holds PE = PE2 * PE1 consecutive bytes of one run
    # of a block's integer parts (32 bytes of a K type's qs / ql / qh, a 32-block type's 16-byte qs or Q8_0's 32), as
    # PE2 pieces of PE1 (the widest vector both the weights' alignment and 16 bytes of x allow); PR = run / PE
    # threads cover a run, then BLOCK_N rows, then KB blocks. Every load (weights, scales, x) is made with a pointer
    # tile of that full shape, so that Triton gives them all the same layout (PE1 contiguous bytes, and as many
    # contiguous elements of x, in one thread) and the loop needs no layout conversion; x's tile repeats over the
    # rows (the lanes of a warp that differ in row read the same x: broadcast loads, from L1).

    @triton.jit
    def _index(row0, n_rows_ok, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KB: tl.constexpr,
               PE1: tl.constexpr, PE2: tl.constexpr, PR: tl.constexpr):
        """The index tiles: kb [1, 1, 1, KB, 1, 1]; p (byte of a thread within the run) [1, PE2, PE1, 1, 1, PR];
        xp (p repeated over the rows, x's column within the run) [1, PE2, PE1, 1, BN, PR]; pr (the run piece)
        [1, 1, 1, 1, 1, PR]; rows (int64) and ok (row < n_rows_ok) [1, 1, 1, 1, BN, PR]; m [BM, 1, 1, 1, 1, 1]."""
        pe2 = tl.arange(0, PE2)[None, :, None, None, None, None]
        pe1 = tl.arange(0, PE1)[None, None, :, None, None, None]
        kb = tl.arange(0, KB)[None, None, None, :, None, None]
        bn = tl.arange(0, BLOCK_N)[None, None, None, None, :, None]
        pr = tl.arange(0, PR)[None, None, None, None, None, :]
        m = tl.arange(0, BLOCK_M)[:, None, None, None, None, None]
        rows = (row0 + bn + 0 * pr).to(tl.int64)
        ok = (bn + 0 * pr) < n_rows_ok
        p = (PE1 * PE2) * pr + PE1 * pe2 + pe1
        return kb, p, 0 * bn + p, pr, rows, ok, m

    @triton.jit
    def _dots_k(x_ptr, w_ptr, h_ptr, w32_ptr, row0, n_rows_ok, M, K, x_row, row_bytes,
                WTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KB: tl.constexpr,
                PE1: tl.constexpr, PE2: tl.constexpr, PR: tl.constexpr, ASM: tl.constexpr):
        """fp32 [BLOCK_M, BLOCK_N]: x [M, K] times the weight rows row0 + [0, BLOCK_N) (those below n_rows_ok) of a
        K type (Q4_K, Q5_K, Q6_K), KB super-blocks of 256 per step."""
        n_sb = K // 256
        kb6, p6, xp, pr6, r6, ok6, m6 = _index(row0, n_rows_ok, BLOCK_M, BLOCK_N, KB, PE1, PE2, PR)
        acc = tl.zeros([BLOCK_M, PE2, PE1, KB, BLOCK_N, PR], dtype=tl.float32)
        for sb0 in range(0, n_sb, KB):
            sb6 = sb0 + kb6  # [1, 1, KB, 1, 1] super-block index
            w_ok = ok6 & (sb6 < n_sb)  # [1, 1, 1, KB, BN, PR]
            x_ok = (m6 < M) & w_ok  # [BM, 1, 1, KB, BN, PR]
            xrow = x_ptr + m6 * x_row + sb6 * 256 + xp  # [BM, PE2, PE1, KB, BN, PR] pointers: + the run's first column
            if WTYPE == 14:  # Q6_K: ql[128] | qh[64] | int8 scales[16] | f16 d; 2-byte aligned
                blk = r6 * row_bytes + sb6 * 210  # [1, 1, 1, KB, BN, PR] byte offset of the block
                d = tl.load(h_ptr + r6 * (row_bytes // 2) + sb6 * 105 + 104, mask=w_ok, other=0.0).to(tl.float32)
                if PE1 * PE2 <= 16:  # a thread's bytes lie in one 16-byte half of the run: one scale per thread
                    sc16 = (PE1 * PE2 * pr6) // 16
                else:
                    sc16 = p6 // 16
                for hq in tl.static_range(2):  # elements 128 hq + 32 q + p, q = 2 Q + qq
                    qh = tl.load(w_ptr + blk + (128 + 32 * hq) + p6, mask=w_ok, other=0).to(tl.int32)
                    for qq in tl.static_range(2):
                        ql = tl.load(w_ptr + blk + (64 * hq + 32 * qq) + p6, mask=w_ok, other=0).to(tl.int32)
                        for Q in tl.static_range(2):
                            sc = tl.load(w_ptr + blk + (192 + 8 * hq + 4 * Q + 2 * qq) + sc16, mask=w_ok,
                                         other=0).to(tl.int32)  # scales[8 hq + 2 q + p / 16]
                            a = d * ((sc ^ 128) - 128).to(tl.float32)  # d * int8 scale, exact
                            if Q == 0:
                                lo = ql & 15
                            else:
                                lo = ql >> 4
                            q = lo | (((qh >> (4 * Q + 2 * qq)) & 3) << 4)
                            w = a * _float(q, 32.0)  # exact: |d * sc| has <= 18 significant bits, q - 32 <= 5
                            x = tl.load(xrow + (128 * hq + 64 * Q + 32 * qq), mask=x_ok, other=0.0).to(tl.float32)
                            acc += x * w
            else:  # Q4_K / Q5_K: f16 d | f16 dmin | scales[12] | (Q5_K: qh[32]) | qs[128]; 16-byte aligned
                BYTES = 144 if WTYPE == 12 else 176
                QS = 16 if WTYPE == 12 else 48
                blk = r6 * row_bytes + sb6 * BYTES
                half = r6 * (row_bytes // 2) + sb6 * (BYTES // 2)
                d = tl.load(h_ptr + half, mask=w_ok, other=0.0).to(tl.float32)
                dmin = tl.load(h_ptr + half + 1, mask=w_ok, other=0.0).to(tl.float32)
                word = r6 * (row_bytes // 4) + sb6 * (BYTES // 4)
                sw0 = tl.load(w32_ptr + word + 1, mask=w_ok, other=0)  # scales[0..3]
                sw1 = tl.load(w32_ptr + word + 2, mask=w_ok, other=0)  # scales[4..7]
                sw2 = tl.load(w32_ptr + word + 3, mask=w_ok, other=0)  # scales[8..11]
                if WTYPE == 13:
                    qh = tl.load(w_ptr + blk + 16 + p6, mask=w_ok, other=0).to(tl.int32)  # qh[e % 32]
                for g in tl.static_range(4):  # elements 64 g + 32 h + p: nibble h of qs[32 g + p]
                    qs = tl.load(w_ptr + blk + (QS + 32 * g) + p6, mask=w_ok, other=0)  # uint8
                    for h in tl.static_range(2):
                        sc, mn = _k_scale(sw0, sw1, sw2, 2 * g + h)  # sub-block j = 2 g + h
                        f = _nibble(qs, h == 1, ASM)  # 2^23 + n
                        if WTYPE == 13:
                            f = _with_bit4(f, (qh >> (2 * g + h)) & 1)
                        w = (d * sc) * (f - 8388608.0) - dmin * mn  # the exact value, rounded once
                        x = tl.load(xrow + (64 * g + 32 * h), mask=x_ok, other=0.0).to(tl.float32)
                        acc += x * w
        return tl.sum(tl.sum(tl.sum(tl.sum(acc, axis=5), axis=3), axis=2), axis=1)

    @triton.jit
    def _dots_32(x_ptr, w_ptr, h_ptr, row0, n_rows_ok, M, K, x_row, row_bytes,
                 WTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KB: tl.constexpr,
                 PE1: tl.constexpr, PE2: tl.constexpr, PR: tl.constexpr, ASM: tl.constexpr):
        """fp32 [BLOCK_M, BLOCK_N]: as _dots_k for a 32-element block type (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), KB blocks
        per step."""
        BYTES = 18 if WTYPE == 2 else (20 if WTYPE == 3 else (22 if WTYPE == 6 else (24 if WTYPE == 7 else 34)))
        QS = 2 if WTYPE == 2 or WTYPE == 8 else (4 if WTYPE == 3 else (6 if WTYPE == 6 else 8))
        n_b = K // 32
        kb6, p6, xp, pr6, r6, ok6, m6 = _index(row0, n_rows_ok, BLOCK_M, BLOCK_N, KB, PE1, PE2, PR)
        acc = tl.zeros([BLOCK_M, PE2, PE1, KB, BLOCK_N, PR], dtype=tl.float32)
        for b0 in range(0, n_b, KB):
            b6 = b0 + kb6  # [1, 1, KB, 1, 1] block index
            w_ok = ok6 & (b6 < n_b)  # [1, 1, 1, KB, BN, PR]
            x_ok = (m6 < M) & w_ok
            xrow = x_ptr + m6 * x_row + b6 * 32 + xp  # [BM, PE2, PE1, KB, BN, PR]
            blk = r6 * row_bytes + b6 * BYTES  # [1, 1, 1, KB, BN, PR]
            half = r6 * (row_bytes // 2) + b6 * (BYTES // 2)
            d = tl.load(h_ptr + half, mask=w_ok, other=0.0).to(tl.float32)
            q = tl.load(w_ptr + blk + QS + p6, mask=w_ok, other=0)  # uint8 [1, PE2, PE1, KB, BN, PR]
            if WTYPE == 8:  # Q8_0: int8 qs[32], element p
                w = d * _float(q.to(tl.int32) ^ 128, 128.0)  # (q ^ 128) - 128: the int8 value
                x = tl.load(xrow, mask=x_ok, other=0.0).to(tl.float32)
                acc += x * w
            else:  # elements p (low nibbles) and p + 16 (high)
                if WTYPE == 6 or WTYPE == 7:  # qh[4] at byte 2 (Q5_0) / 4 (Q5_1), read as a uint32
                    QH = 1 if WTYPE == 6 else 2  # in halves
                    lo16 = tl.load(h_ptr + half + QH, mask=w_ok, other=0.0).to(tl.int16, bitcast=True)
                    hi16 = tl.load(h_ptr + half + QH + 1, mask=w_ok, other=0.0).to(tl.int16, bitcast=True)
                    qh = (lo16.to(tl.int32) & 65535) | (hi16.to(tl.int32) << 16)
                if WTYPE == 3 or WTYPE == 7:
                    mn = tl.load(h_ptr + half + 1, mask=w_ok, other=0.0).to(tl.float32)
                for h in tl.static_range(2):
                    f = _nibble(q, h == 1, ASM)  # 2^23 + n
                    if WTYPE == 6 or WTYPE == 7:
                        f = _with_bit4(f, (qh >> (p6 + 16 * h)) & 1)  # bit e of qh
                    if WTYPE == 2:
                        w = d * (f - 8388616.0)  # n - 8
                    elif WTYPE == 6:
                        w = d * (f - 8388624.0)  # n + 16 h - 16
                    else:  # Q4_1 / Q5_1
                        w = d * (f - 8388608.0) + mn
                    x = tl.load(xrow + 16 * h, mask=x_ok, other=0.0).to(tl.float32)
                    acc += x * w
        return tl.sum(tl.sum(tl.sum(tl.sum(acc, axis=5), axis=3), axis=2), axis=1)

    @triton.jit
    def _dots(x_ptr, w_ptr, h_ptr, w32_ptr, row0, n_rows_ok, M, K, x_row, row_bytes,
              WTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KB: tl.constexpr,
              PE1: tl.constexpr, PE2: tl.constexpr, PR: tl.constexpr, ASM: tl.constexpr):
        if WTYPE == 12 or WTYPE == 13 or WTYPE == 14:
            return _dots_k(x_ptr, w_ptr, h_ptr, w32_ptr, row0, n_rows_ok, M, K, x_row, row_bytes,
                           WTYPE, BLOCK_M, BLOCK_N, KB, PE1, PE2, PR, ASM)
        else:
            return _dots_32(x_ptr, w_ptr, h_ptr, row0, n_rows_ok, M, K, x_row, row_bytes,
                            WTYPE, BLOCK_M, BLOCK_N, KB, PE1, PE2, PR, ASM)

    @triton.jit
    def _qgemv_kernel(x_ptr, w_ptr, h_ptr, w32_ptr, b_ptr, out_ptr, M, N, K, x_row, row_bytes,
                      WTYPE: tl.constexpr, MODE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, KB: tl.constexpr, PE1: tl.constexpr, PE2: tl.constexpr,
                      PR: tl.constexpr, ASM: tl.constexpr):
        """One program: output columns pid * BLOCK_N + [0, BLOCK_N) of all M rows. MODE 0: out = x @ W^T (+ bias);
        1: out += x @ W^T (out is the residual); 2: out = silu(x @ gate^T) * (x @ up^T), gate = W's rows [0, N),
        up = rows [N, 2N). out [M, N] contiguous."""
        row0 = tl.program_id(0) * BLOCK_N
        n_ok = N - row0  # rows of this program that exist
        y = _dots(x_ptr, w_ptr, h_ptr, w32_ptr, row0, n_ok, M, K, x_row, row_bytes,
                  WTYPE, BLOCK_M, BLOCK_N, KB, PE1, PE2, PR, ASM)
        if MODE == 2:
            up = _dots(x_ptr, w_ptr, h_ptr, w32_ptr, row0 + N, n_ok, M, K, x_row, row_bytes,
                       WTYPE, BLOCK_M, BLOCK_N, KB, PE1, PE2, PR, ASM)
            y = y / (1.0 + tl.exp(-y)) * up
        mm = tl.arange(0, BLOCK_M)[:, None]  # [BM, 1]
        rows = row0 + tl.arange(0, BLOCK_N)[None, :]  # [1, BN]
        ok = (mm < M) & (rows < N)
        if HAS_BIAS:
            y += tl.load(b_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)
        if MODE == 1:  # the residual: each program reads its own outputs before it writes them
            y += tl.load(out_ptr + mm * N + rows, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + mm * N + rows, y.to(out_ptr.dtype.element_ty), mask=ok)


def _check(x: torch.Tensor, w: QuantMatrix, tiles: Tiles | None) -> Tiles:
    """Validates x against w; returns the tiling to use."""
    if triton is None:
        raise RuntimeError("the quantized GPU kernels need Triton, which is not installed")
    if not isinstance(w, QuantMatrix):
        raise ValueError(f"w must be a QuantMatrix, got {type(w).__name__}")
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != w.k:
        raise ValueError(f"x must be a [M, {w.k}] tensor, got {getattr(x, 'shape', type(x).__name__)}")
    if x.dtype not in X_DTYPES:
        raise ValueError(f"x must be bf16, fp16 or fp32, got {x.dtype}")
    if x.stride(1) != 1:
        raise ValueError("x's rows must have unit stride")
    m = x.shape[0]
    if m > MAX_M:
        raise ValueError(f"x has {m} rows; these kernels take at most {MAX_M} (decode)")
    if x.device != w.device:
        raise ValueError(f"x is on {x.device}, the weights on {w.device}")
    if x.device.type != "cuda" and not triton_interpreter():
        raise ValueError(f"tensors on {x.device}: these kernels run on CUDA (or in Triton's interpreter, "
                         "TRITON_INTERPRET=1)")
    if tiles is None:
        tiles = default_tiles(w.wtype, max(m, 1))
    if len(tiles) != 3 or any(not isinstance(v, int) or v < 1 or v & (v - 1) for v in tiles):
        raise ValueError(f"tiles must be (BLOCK_N, PE, num_warps), powers of two, got {tiles!r}")
    return tiles


def _launch(x: torch.Tensor, w: QuantMatrix, bias: torch.Tensor | None, out: torch.Tensor, n: int, mode: int,
            tiles: Tiles) -> None:
    m = x.shape[0]
    if m == 0 or n == 0:
        return
    if m > 1 and x.stride(0) % 16:
        x = x.contiguous()  # rows at multiples of 16 elements keep x's loads vectorized (K is a multiple of 32)
    bn, pe1, pe2, kb, warps = launch_shape(w.wtype, tiles, x.dtype)
    data = w.data
    h = data.view(torch.float16)  # [N, row_bytes / 2]: the f16 fields (every row_bytes is even)
    w32 = data.view(torch.int32) if w.row_bytes % 4 == 0 else data  # Q4_K / Q5_K's scale words
    _qgemv_kernel[(triton.cdiv(n, bn),)](
        x, data, h, w32, bias if bias is not None else x, out, m, n, w.k, x.stride(0) if m > 1 else 0, w.row_bytes,
        WTYPE=w.wtype, MODE=mode, HAS_BIAS=bias is not None, BLOCK_M=block_m(m), BLOCK_N=bn, KB=kb, PE1=pe1,
        PE2=pe2, PR=_RUN[w.wtype] // (pe1 * pe2), ASM=x.device.type == "cuda" and pe1 >= 4 and w.wtype != Q8_0,
        num_warps=warps)


def qgemv(x: torch.Tensor, w: QuantMatrix, bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
          tiles: Tiles | None = None) -> torch.Tensor:
    """x [M, K] @ W [N, K]^T (+ bias [N]) -> a new [M, N] tensor of out_dtype (default x's), M <= 16. The fp32 sum
    (+ bias) is rounded once. tiles: (BLOCK_N, PE, num_warps) in place of DEFAULT_TILES'."""
    tiles = _check(x, w, tiles)
    n = w.n_rows
    if bias is not None and (bias.shape != (n,) or not bias.is_contiguous() or bias.device != x.device
                             or not bias.is_floating_point()):
        raise ValueError(f"bias must be a contiguous float [{n}] tensor on {x.device}, got "
                         f"{bias.dtype} {list(bias.shape)} on {bias.device}")
    out_dtype = out_dtype or x.dtype
    if out_dtype not in X_DTYPES:
        raise ValueError(f"out_dtype must be bf16, fp16 or fp32, got {out_dtype}")
    out = torch.empty((x.shape[0], n), dtype=out_dtype, device=x.device)
    _launch(x, w, bias, out, n, 0, tiles)
    return out


def qgemv_add_(res: torch.Tensor, x: torch.Tensor, w: QuantMatrix, tiles: Tiles | None = None) -> torch.Tensor:
    """res [M, N] += x [M, K] @ W [N, K]^T in place (fp32 sum plus res, rounded once to res's dtype); returns res."""
    tiles = _check(x, w, tiles)
    if (not isinstance(res, torch.Tensor) or tuple(res.shape) != (x.shape[0], w.n_rows) or not res.is_contiguous()
            or res.dtype not in X_DTYPES or res.device != x.device):
        raise ValueError(f"res must be a contiguous bf16/fp16/fp32 [{x.shape[0]}, {w.n_rows}] tensor on {x.device}, "
                         f"got {getattr(res, 'dtype', None)} {list(getattr(res, 'shape', []))}")
    _launch(x, w, None, res, w.n_rows, 1, tiles)
    return res


def qgemv_silu_mul(x: torch.Tensor, w_gate_up: QuantMatrix, tiles: Tiles | None = None) -> torch.Tensor:
    """x [M, K], W [2F, K] (gate rows, then up rows) -> silu(x @ gate^T) * (x @ up^T) [M, F] in x's dtype, from
    the fp32 sums, rounded once."""
    tiles = _check(x, w_gate_up, tiles)
    if w_gate_up.n_rows % 2:
        raise ValueError(f"w_gate_up must have an even number of rows (gate then up), got {w_gate_up.n_rows}")
    f = w_gate_up.n_rows // 2
    out = torch.empty((x.shape[0], f), dtype=x.dtype, device=x.device)
    _launch(x, w_gate_up, None, out, f, 2, tiles)
    return out


__all__ = ["QuantMatrix", "TYPES", "DEFAULT_TILES", "MAX_M", "Tiles", "default_tiles", "launch_shape", "qgemv",
           "qgemv_add_", "qgemv_silu_mul"]
