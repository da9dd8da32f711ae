"""Tiny GGUF files with weights whose decoded float values the tests know independently of any dequantiser.

Quantised tensors are built from chosen integer codes and fp16-representable scales/mins, packed into ggml block bytes
by the code below (layouts as in ggml / gguf-py), while the expected float64 values come straight from the codes with
the block formula. A loader that unpacks a bit field wrongly therefore disagrees with `expected`, rather than agreeing
with a packer that shares its bug.

Block layouts (little-endian; "d"/"m"/"dmin" are fp16):
  Q8_0  (32)  d, qs[32] int8                        x = d * q
  Q4_0  (32)  d, qs[16]                             x = d * (q - 8)    q_j = qs[j] & 15, q_{j+16} = qs[j] >> 4
  Q4_1  (32)  d, m, qs[16]                          x = d * q + m      nibbles as Q4_0
  Q5_0  (32)  d, qh u32, qs[16]                     x = d * (q - 16)   q_j = nibble_j | bit j of qh << 4
  Q5_1  (32)  d, m, qh u32, qs[16]                  x = d * q + m
  Q4_K  (256) d, dmin, scales[12], qs[128]          x = d*sc_s*q - dmin*m_s over 8 sub-blocks of 32 (6-bit sc, m)
  Q5_K  (256) d, dmin, scales[12], qh[32], qs[128]  as Q4_K with a 5th bit: bit s of qh[l] for sub-block s
  Q6_K  (256) ql[128], qh[64], sc[16] int8, d       x = d * sc_s * (q - 32) over 16 sub-blocks of 16
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np

QTYPE = gguf.GGMLQuantizationType
ALL_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
BLOCK = {"Q8_0": 32, "Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q5_1": 32, "Q4_K": 256, "Q5_K": 256, "Q6_K": 256}


def _f16(values: np.ndarray) -> np.ndarray:
    """Round to fp16; the fp16 values are what both the file and the expectation use."""
    return np.asarray(values, dtype=np.float64).astype(np.float16)


def _f16_bytes(values: np.ndarray) -> np.ndarray:
    """fp16 scalars per block [n] -> their little-endian bytes [n, 2]."""
    return values.astype("<f2").view(np.uint8).reshape(-1, 2)


def _pack_nibbles(low: np.ndarray, high: np.ndarray) -> np.ndarray:
    return (low.astype(np.uint8) & 0x0F) | (high.astype(np.uint8) << 4)


def _pack_bits_le(bits: np.ndarray) -> np.ndarray:
    """bits [n, 32] of 0/1 -> [n, 4] bytes of a little-endian u32 whose bit j is bits[:, j]."""
    word = (bits.astype(np.uint64) << np.arange(32, dtype=np.uint64)).sum(axis=1).astype("<u4")
    return word.view(np.uint8).reshape(-1, 4)


def _pack_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """6-bit sc, m [n, 8] -> the 12-byte Q4_K/Q5_K scale field [n, 12].

    bytes 0-3: sc[0..3] in bits 0-5, bits 4-5 of sc[4..7] in bits 6-7; bytes 4-7: the same for m;
    bytes 8-11: low nibble = sc[4..7] bits 0-3, high nibble = m[4..7] bits 0-3.
    """
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    out = np.zeros((sc.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = (sc[:, 0:4] & 0x3F) | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = (mn[:, 0:4] & 0x3F) | ((mn[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((mn[:, 4:8] & 0x0F) << 4)
    return out


def _pack_nibble_planes(q: np.ndarray) -> np.ndarray:
    """Low 4 bits of q [n, 256] (8 sub-blocks of 32) -> qs [n, 128]: byte l of 32-byte group g holds sub-block 2g in
    its low nibble and sub-block 2g+1 in its high nibble."""
    sub = q.reshape(-1, 8, 32)
    return _pack_nibbles(sub[:, 0::2], sub[:, 1::2]).reshape(-1, 128)


def encode(type_name: str, shape: tuple[int, int] | tuple[int], rng: np.random.Generator, scale: float
           ) -> tuple[np.ndarray, QTYPE | None, np.ndarray]:
    """Random weights of roughly `scale` magnitude in `type_name`.

    Returns (payload for GGUFWriter.add_tensor, raw_dtype for it, expected float64 values of `shape`).
    """
    n_el = int(np.prod(shape))
    if type_name == "F32":
        vals = (rng.standard_normal(shape) * scale).astype(np.float32)
        return vals, None, vals.astype(np.float64)
    if type_name == "F16":
        vals = (rng.standard_normal(shape) * scale).astype(np.float16)
        return vals, None, vals.astype(np.float64)
    if type_name == "BF16":
        f32 = (rng.standard_normal(shape) * scale).astype(np.float32)
        top = (f32.view(np.uint32) >> 16).astype("<u2")  # a bf16 is the top half of an fp32
        expected = (top.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
        payload = top.view(np.uint8).reshape(*shape[:-1], shape[-1] * 2)
        return payload, QTYPE.BF16, expected

    bs = BLOCK[type_name]
    if shape[-1] % bs:
        raise ValueError(f"{type_name} needs rows that are a multiple of {bs}, got shape {shape}")
    nb = n_el // bs
    u = rng.uniform(0.6, 1.4, nb)  # per-block scale jitter so blocks differ
    if type_name == "Q8_0":
        q = rng.integers(-127, 128, (nb, 32))
        d = _f16(scale / 73.0 * u)  # std of U{-127..127} is ~73
        x = d.astype(np.float64)[:, None] * q
        blocks = np.concatenate([_f16_bytes(d), q.astype(np.int8).view(np.uint8)], axis=1)
    elif type_name in ("Q4_0", "Q4_1"):
        q = rng.integers(0, 16, (nb, 32))
        d = _f16(scale / 4.6 * u)
        qs = _pack_nibbles(q[:, :16], q[:, 16:])
        if type_name == "Q4_0":
            x = d.astype(np.float64)[:, None] * (q - 8)
            blocks = np.concatenate([_f16_bytes(d), qs], axis=1)
        else:
            m = _f16(-d.astype(np.float64) * rng.uniform(6.0, 9.0, nb))
            x = d.astype(np.float64)[:, None] * q + m.astype(np.float64)[:, None]
            blocks = np.concatenate([_f16_bytes(d), _f16_bytes(m), qs], axis=1)
    elif type_name in ("Q5_0", "Q5_1"):
        q = rng.integers(0, 32, (nb, 32))
        d = _f16(scale / 9.2 * u)
        qh = _pack_bits_le(q >> 4)
        qs = _pack_nibbles(q[:, :16] & 0x0F, q[:, 16:] & 0x0F)
        if type_name == "Q5_0":
            x = d.astype(np.float64)[:, None] * (q - 16)
            blocks = np.concatenate([_f16_bytes(d), qh, qs], axis=1)
        else:
            m = _f16(-d.astype(np.float64) * rng.uniform(13.0, 18.0, nb))
            x = d.astype(np.float64)[:, None] * q + m.astype(np.float64)[:, None]
            blocks = np.concatenate([_f16_bytes(d), _f16_bytes(m), qh, qs], axis=1)
    elif type_name in ("Q4_K", "Q5_K"):
        levels = 16 if type_name == "Q4_K" else 32
        q = rng.integers(0, levels, (nb, 256))
        sc = rng.integers(1, 64, (nb, 8))  # full 6-bit range so the high-bit packing is exercised
        # m ~ sc with dmin ~ d * (levels - 1) / 2 keeps each sub-block roughly centred (dmin * m ~ mid-code value)
        mn = np.clip(sc + rng.integers(-3, 4, (nb, 8)), 0, 63)
        d = _f16(scale / (36.7 * (levels - 1) / 3.4) * u)  # 36.7: rms of sc; (levels - 1) / 3.4: std of the code
        dmin = _f16(d.astype(np.float64) * (levels - 1) / 2 * rng.uniform(0.9, 1.1, nb))
        step = (d.astype(np.float64)[:, None] * sc).repeat(32, axis=1)  # [nb, 256]
        offset = (dmin.astype(np.float64)[:, None] * mn).repeat(32, axis=1)
        x = step * q - offset
        parts = [_f16_bytes(d), _f16_bytes(dmin), _pack_k_scales(sc, mn)]
        if type_name == "Q5_K":
            hi = (q >> 4).reshape(nb, 8, 32)  # bit 4 of sub-block s -> bit s of qh[l]
            parts.append((hi.astype(np.uint8) << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1).astype(np.uint8))
        parts.append(_pack_nibble_planes(q & 0x0F))
        blocks = np.concatenate(parts, axis=1)
    elif type_name == "Q6_K":
        q = rng.integers(0, 64, (nb, 256))
        sc = rng.integers(8, 64, (nb, 16)) * rng.choice([-1, 1], (nb, 16))  # int8 scales, both signs
        d = _f16(scale / (36.0 * 18.5) * u)
        x = (d.astype(np.float64)[:, None] * sc).repeat(16, axis=1) * (q - 32)
        # Each half of 128 values: value l + 32 k (k = 0..3, l = 0..31) keeps its low nibble in ql[l + 32 (k % 2)]
        # (k < 2: low nibble, else high nibble) and its top two bits in bits 2k..2k+1 of qh[l].
        ql = np.zeros((nb, 128), dtype=np.uint8)
        qh = np.zeros((nb, 64), dtype=np.uint8)
        for half in range(2):
            h = q[:, 128 * half : 128 * (half + 1)].reshape(nb, 4, 32)
            lo, hi2 = (h & 0x0F).astype(np.uint8), (h >> 4).astype(np.uint8)
            ql[:, 64 * half : 64 * half + 32] = lo[:, 0] | (lo[:, 2] << 4)
            ql[:, 64 * half + 32 : 64 * half + 64] = lo[:, 1] | (lo[:, 3] << 4)
            qh[:, 32 * half : 32 * half + 32] = hi2[:, 0] | (hi2[:, 1] << 2) | (hi2[:, 2] << 4) | (hi2[:, 3] << 6)
        blocks = np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8), _f16_bytes(d)], axis=1)
    else:
        raise ValueError(f"no encoder for tensor type {type_name}")
    rows = n_el // shape[-1]
    payload = np.ascontiguousarray(blocks.astype(np.uint8)).reshape(rows, -1)
    return payload, QTYPE[type_name], x.reshape(shape)


@dataclass(frozen=True)
class TinySpec:
    """A tiny llama/qwen2 model; `types` maps a tensor name (or a suffix such as 'ffn_down.weight') to its type."""

    arch: str
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    vocab: int
    n_layers: int = 2
    tied: bool = True
    qkv_bias: bool = False
    types: dict[str, str] = field(default_factory=dict)
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    rope_linear_factor: float | None = None
    write_rope_dim: bool = False
    context_length: int = 512

    @property
    def d_model(self) -> int:
        return self.n_heads * self.head_dim

    def type_of(self, name: str) -> str:
        if name in self.types:
            return self.types[name]
        suffix = name.split(".", 2)[-1] if name.startswith("blk.") else name
        return self.types.get(suffix, "F32")

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """numpy shapes ([out, in] for matrices) of every tensor the model needs."""
        d, f, hq, hkv, hd = self.d_model, self.d_ff, self.n_heads, self.n_kv_heads, self.head_dim
        shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (self.vocab, d), "output_norm.weight": (d,)}
        if not self.tied:
            shapes["output.weight"] = (self.vocab, d)
        for i in range(self.n_layers):
            p = f"blk.{i}."
            shapes |= {
                p + "attn_norm.weight": (d,), p + "attn_q.weight": (hq * hd, d), p + "attn_k.weight": (hkv * hd, d),
                p + "attn_v.weight": (hkv * hd, d), p + "attn_output.weight": (d, hq * hd), p + "ffn_norm.weight": (d,),
                p + "ffn_gate.weight": (f, d), p + "ffn_up.weight": (f, d), p + "ffn_down.weight": (d, f),
            }
            if self.qkv_bias:
                shapes |= {p + "attn_q.bias": (hq * hd,), p + "attn_k.bias": (hkv * hd,), p + "attn_v.bias": (hkv * hd,)}
        return shapes


def _scale_for(name: str, spec: TinySpec) -> float:
    if name.endswith("norm.weight"):
        return 0.0  # norms are 1 + noise, see below
    if name.endswith(".bias"):
        return 0.3
    if name in ("token_embd.weight", "output.weight"):
        return 0.25
    fan_in = spec.tensor_shapes()[name][-1]
    return 1.2 / np.sqrt(fan_in)


def make_weights(spec: TinySpec, seed: int) -> dict[str, tuple[np.ndarray, QTYPE | None, np.ndarray]]:
    """name -> (payload, raw_dtype, expected float64 values) for every tensor of `spec`."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in spec.tensor_shapes().items():
        if name.endswith("norm.weight"):
            vals = (1.0 + 0.2 * rng.standard_normal(shape)).astype(np.float32)
            out[name] = (vals, None, vals.astype(np.float64))
        else:
            out[name] = encode(spec.type_of(name), shape, rng, _scale_for(name, spec))
    return out


def write_gguf(path: Path, arch: str, metadata: dict[str, int | float | str],
               tensors: dict[str, tuple[np.ndarray, QTYPE | None]]) -> Path:
    """Write a GGUF with the given arch-relative metadata ('block_count' -> '{arch}.block_count') and tensors."""
    writer = gguf.GGUFWriter(str(path), arch)  # writes general.architecture itself
    for key, value in metadata.items():
        full = key if key.startswith("general.") else f"{arch}.{key}"
        if isinstance(value, str):
            writer.add_string(full, value)
        elif isinstance(value, int):
            writer.add_uint32(full, value)
        else:
            writer.add_float32(full, float(value))
    for name, (payload, raw_dtype) in tensors.items():
        writer.add_tensor(name, payload, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def spec_metadata(spec: TinySpec) -> dict[str, int | float | str]:
    md: dict[str, int | float | str] = {
        "general.name": f"tiny-{spec.arch}",
        "block_count": spec.n_layers,
        "context_length": spec.context_length,
        "embedding_length": spec.d_model,
        "feed_forward_length": spec.d_ff,
        "attention.head_count": spec.n_heads,
        "attention.head_count_kv": spec.n_kv_heads,
        "rope.freq_base": spec.rope_theta,
        "attention.layer_norm_rms_epsilon": spec.rms_eps,
    }
    if spec.write_rope_dim:
        md["rope.dimension_count"] = spec.head_dim
    if spec.rope_linear_factor is not None:
        md["rope.scaling.type"] = "linear"
        md["rope.scaling.factor"] = spec.rope_linear_factor
    return md


def write_tiny_model(path: Path, spec: TinySpec, seed: int = 0, *, arch_override: str | None = None,
                     drop: tuple[str, ...] = (), type_override: dict[str, tuple[np.ndarray, QTYPE]] | None = None
                     ) -> dict[str, np.ndarray]:
    """Write `spec` as a GGUF; return name -> expected float64 values. `drop`, `arch_override` and `type_override`
    (name -> (payload, raw type)) produce deliberately broken files."""
    weights = make_weights(spec, seed)
    tensors = {n: (p, t) for n, (p, t, _) in weights.items() if n not in drop}
    tensors |= type_override or {}
    write_gguf(path, arch_override or spec.arch, spec_metadata(spec), tensors)
    return {n: e for n, (_, _, e) in weights.items()}
