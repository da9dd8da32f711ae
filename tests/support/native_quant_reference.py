"""float64 references for the quantized-weight kernels (native/fluxion.h, "QUANTIZED WEIGHTS"), written from the
stated block layouts with numpy (no code shared with C or with gguf-py): random block packers, a dequantizer, the
activation quantizer, and the error bounds the tests hold the kernels to."""
from __future__ import annotations

import numpy as np

# type id -> (name, elements per block, bytes per block)
TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 30: ("BF16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
         6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 12: ("Q4_K", 256, 144),
         13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210)}
IDS = {name: tid for tid, (name, _, _) in TYPES.items()}
U = 2.0 ** -24  # fp32 unit roundoff


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(v.astype(np.float16)).view(np.uint8).reshape(*v.shape, 2)


def _f16(b: np.ndarray) -> np.ndarray:
    """little-endian f16 fields [..., 2] -> float64"""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float64)


def random_scales(rng: np.random.Generator, n: int, lo: float = 2.0 ** -10, hi: float = 2.0 ** -4) -> np.ndarray:
    """n nonzero fp16-representable values of random sign, log-uniform in [lo, hi] in magnitude."""
    mag = np.exp(rng.uniform(np.log(lo), np.log(hi), n)).astype(np.float16).astype(np.float64)
    return mag * rng.choice([-1.0, 1.0], n)


def pack_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K: 6-bit scales and mins [n, 8] -> the 12 packed bytes [n, 12] (fluxion.h's packing, inverted)."""
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    out = np.zeros((len(sc), 12), np.uint8)
    out[:, 0:4] = (sc[:, 0:4] & 63) | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (mn[:, 0:4] & 63) | ((mn[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 15) | ((mn[:, 4:8] & 15) << 4)
    return out


def unpack_k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 packed bytes [n, 12] -> scales, mins [n, 8] (as fluxion.h states the packing)."""
    s = s.astype(np.int64)
    sc = np.zeros((len(s), 8), np.int64)
    mn = np.zeros((len(s), 8), np.int64)
    for j in range(4):
        sc[:, j] = s[:, j] & 63
        mn[:, j] = s[:, j + 4] & 63
        sc[:, j + 4] = (s[:, j + 8] & 15) | ((s[:, j] >> 6) << 4)
        mn[:, j + 4] = (s[:, j + 8] >> 4) | ((s[:, j + 4] >> 6) << 4)
    return sc, mn


def random_blocks(tid: int, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """n_blocks random blocks of type tid as bytes [n_blocks, block_bytes]: random integer parts, random nonzero
    scales / mins of random sign (K types: 6-bit scales and mins in [1, 63] packed; Q6_K: int8 scales != 0)."""
    name, block, nbytes = TYPES[tid]
    out = np.zeros((n_blocks, nbytes), np.uint8)
    raw = lambda n: rng.integers(0, 256, (n_blocks, n), dtype=np.uint8)  # noqa: E731
    if name == "F32":
        return np.ascontiguousarray(rng.standard_normal(n_blocks).astype(np.float32)).view(np.uint8).reshape(-1, 4)
    if name == "F16":
        return _f16_bytes(rng.standard_normal(n_blocks))
    if name == "BF16":
        v = rng.standard_normal(n_blocks).astype(np.float32).view(np.uint32) >> 16  # truncated: any bf16 is fine
        return np.ascontiguousarray(v.astype(np.uint16)).view(np.uint8).reshape(-1, 2)
    if name in ("Q4_0", "Q5_0", "Q8_0"):
        out[:, 0:2] = _f16_bytes(random_scales(rng, n_blocks))
        out[:, 2:] = raw(nbytes - 2)
    elif name in ("Q4_1", "Q5_1"):
        out[:, 0:2] = _f16_bytes(random_scales(rng, n_blocks))
        out[:, 2:4] = _f16_bytes(random_scales(rng, n_blocks, 2.0 ** -8, 2.0 ** -2))
        out[:, 4:] = raw(nbytes - 4)
    elif name in ("Q4_K", "Q5_K"):
        out[:, 0:2] = _f16_bytes(random_scales(rng, n_blocks, 2.0 ** -12, 2.0 ** -8))
        out[:, 2:4] = _f16_bytes(random_scales(rng, n_blocks, 2.0 ** -12, 2.0 ** -8))
        out[:, 4:16] = pack_k_scales(rng.integers(1, 64, (n_blocks, 8)), rng.integers(1, 64, (n_blocks, 8)))
        out[:, 16:] = raw(nbytes - 16)
    elif name == "Q6_K":
        out[:, 0:192] = raw(192)
        sc = rng.integers(1, 128, (n_blocks, 16)) * rng.choice([-1, 1], (n_blocks, 16))
        out[:, 192:208] = sc.astype(np.int8).view(np.uint8)
        out[:, 208:210] = _f16_bytes(random_scales(rng, n_blocks, 2.0 ** -14, 2.0 ** -9))
    return out


def random_matrix(tid: int, n_out: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """W [n_out, k] of type tid as the file's bytes, uint8 [n_out, row_bytes]."""
    _, block, nbytes = TYPES[tid]
    return random_blocks(tid, n_out * (k // block), rng).reshape(n_out, (k // block) * nbytes)


def _bits(b: np.ndarray, n: int) -> np.ndarray:
    """bit i (i < n) of little-endian byte fields b [..., n / 8] -> [..., n] of 0/1"""
    return np.unpackbits(b, axis=-1, bitorder="little")[..., :n].astype(np.int64)


def dequantize(tid: int, w: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """W's bytes [n_out, row_bytes] -> (values, magnitudes), float64 [n_out, k].  values: fluxion.h's formulas in
    float64 (exact for the fields random_blocks draws).  magnitudes: the sum of the absolute values of the formula's
    parts (|d n| + |m| with a min, |d n| + |8 d| for Q4_0), what the kernels' fp32 arithmetic rounds."""
    name, block, nbytes = TYPES[tid]
    n_out = w.shape[0]
    blk = np.ascontiguousarray(w).reshape(-1, nbytes)
    if name == "F32":
        v = blk.view(np.float32)[:, 0].astype(np.float64)
        return v.reshape(n_out, k), np.abs(v).reshape(n_out, k)
    if name == "F16":
        v = _f16(blk)
        return v.reshape(n_out, k), np.abs(v).reshape(n_out, k)
    if name == "BF16":
        v = (blk.view(np.uint16)[:, 0].astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        return v.reshape(n_out, k), np.abs(v).reshape(n_out, k)
    if block == 32:
        d = _f16(blk[:, 0:2])[:, None]
        off = {"Q4_0": 2, "Q4_1": 4, "Q5_0": 6, "Q5_1": 8}.get(name)
        if name == "Q8_0":
            q = blk[:, 2:34].view(np.int8).astype(np.int64)
        else:
            qs = blk[:, off:off + 16].astype(np.int64)
            q = np.concatenate([qs & 15, qs >> 4], axis=1)  # n(e): low nibbles are elements 0..15
            if name in ("Q5_0", "Q5_1"):
                qh_at = 2 if name == "Q5_0" else 4
                q = q + 16 * _bits(blk[:, qh_at:qh_at + 4], 32)  # h(e): bit e of the uint32
        if name in ("Q4_1", "Q5_1"):
            m = _f16(blk[:, 2:4])[:, None]
            v, mag = d * q + m, np.abs(d * q) + np.abs(m)
        else:  # Q4_0 / Q5_0: d n and the offset d * 8 (16) are separate fp32 terms in the kernels
            o = {"Q4_0": 8, "Q5_0": 16, "Q8_0": 0}[name]
            v = d * (q - o)
            mag = np.abs(d * q) + np.abs(d * o)
        return v.reshape(n_out, k), mag.reshape(n_out, k)
    if name in ("Q4_K", "Q5_K"):
        d, dmin = _f16(blk[:, 0:2])[:, None], _f16(blk[:, 2:4])[:, None]
        sc, mn = unpack_k_scales(blk[:, 4:16])
        qs = blk[:, 48:176] if name == "Q5_K" else blk[:, 16:144]
        e = np.arange(256)
        j = e // 32
        n = (qs[:, 32 * (e // 64) + e % 32].astype(np.int64) >> (4 * (j % 2))) & 15
        if name == "Q5_K":
            qh = blk[:, 16:48].astype(np.int64)
            n = n + 16 * ((qh[:, e % 32] >> j) & 1)
        a, b = d * sc[:, j] * n, dmin * mn[:, j]
        return (a - b).reshape(n_out, k), (np.abs(a) + np.abs(b)).reshape(n_out, k)
    # Q6_K
    ql, qh = blk[:, 0:128].astype(np.int64), blk[:, 128:192].astype(np.int64)
    sc = blk[:, 192:208].view(np.int8).astype(np.int64)
    d = _f16(blk[:, 208:210])[:, None]
    e = np.arange(256)
    h, t = e // 128, e % 128
    q = ((ql[:, 64 * h + t % 64] >> (4 * (t // 64))) & 15) | (((qh[:, 32 * h + t % 32] >> (2 * (t // 32))) & 3) << 4)
    v = d * sc[:, e // 16] * (q - 32)
    return v.reshape(n_out, k), np.abs(v).reshape(n_out, k)


def quantize_x(x: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """fluxion.h's activation quantization of x fp32 [m, k] per block of `block` elements, in fp32 arithmetic as
    stated: (qx int [m, k], dx fp32 [m, k / block]).  Finite x only."""
    m, k = x.shape
    xb = x.astype(np.float32).reshape(m, k // block, block)
    amax = np.abs(xb).max(axis=2)
    with np.errstate(divide="ignore", invalid="ignore"):
        dx = np.where(amax > 0, amax / np.float32(127), np.float32(0)).astype(np.float32)
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint((xb * inv[:, :, None]).astype(np.float32))  # the fp32 product, rounded half to even
    return q.astype(np.int64).reshape(m, k), dx


def activation_block(tid: int) -> int:
    """The block of x's quantization for a weight type: 32 (Q4_0 .. Q8_0), 256 (K types), 0 (not quantized)."""
    return {32: 32, 256: 256}.get(TYPES[tid][1], 0)


def dequantized_x(x: np.ndarray, tid: int) -> np.ndarray:
    """x as the kernels see it, float64: dx * qx (or x itself for the float weight types)."""
    block = activation_block(tid)
    if not block:
        return x.astype(np.float64)
    q, dx = quantize_x(x, block)
    return q * np.repeat(dx.astype(np.float64), block, axis=1)
