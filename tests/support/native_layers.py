"""Random decoder layers for the native layer and decode-step tests: quantized weights of chosen types with their
float64 (dequantized) twins, RoPE table rows laid out as the model's table, and the layer's float64 reference
(native/fluxion.h, "DECODER LAYER")."""
from __future__ import annotations

import math

import numpy as np
import torch

import native_quant_reference as ref
from fluxion_lite.hostkv import quant
from fluxion_lite.hostkv.layer import LayerSpec, NativeLayer

QUANT_MIXES = {  # a llama.cpp Q4_K_M-like mix, and the 32-block types
    "k-mix": dict(q=12, k=12, v=14, o=12, gate=12, up=12, down=14),
    "q5-q8": dict(q=6, k=6, v=8, o=6, gate=6, up=6, down=8),
    "q4-q5_1": dict(q=2, k=3, v=7, o=2, gate=3, up=2, down=7),
}


def make_layer(rng: np.random.Generator, spec: LayerSpec, types: dict[str, int], bias: bool
               ) -> tuple[NativeLayer, dict[str, np.ndarray]]:
    """A NativeLayer over random weights of the given types, and its parts in float64 (weights dequantized)."""
    hq, hkv = spec.n_heads * spec.head_dim, spec.n_kv_heads * spec.head_dim
    shapes = {"q": (hq, spec.d), "k": (hkv, spec.d), "v": (hkv, spec.d), "o": (spec.d, hq),
              "gate": (spec.ffn, spec.d), "up": (spec.ffn, spec.d), "down": (spec.d, spec.ffn)}
    weights, f64 = {}, {}
    for name, (n_out, k) in shapes.items():
        tid = types[name]
        raw = ref.random_matrix(tid, n_out, k, rng)
        if ref.TYPES[tid][0] == "F32":  # unit-scale random floats: shrink so activations stay O(1)
            raw = (raw.view(np.float32) * np.float32(1 / math.sqrt(k))).view(np.uint8)
        weights[name] = quant.QuantWeight(tid, np.ascontiguousarray(raw), n_out, k)
        f64[name] = weights[name].dequantize().astype(np.float64)  # exact: dequantize is bit for bit
    f64["attn_norm"] = 1.0 + 0.1 * rng.standard_normal(spec.d)
    f64["ffn_norm"] = 1.0 + 0.1 * rng.standard_normal(spec.d)
    f64["bias"] = 0.1 * rng.standard_normal(hq + 2 * hkv) if bias else None
    layer = NativeLayer(spec, torch.from_numpy(f64["attn_norm"]).float(), torch.from_numpy(f64["ffn_norm"]).float(),
                        None if f64["bias"] is None else torch.from_numpy(f64["bias"]).float(),
                        **{name: weights[name] for name in shapes})
    return layer, f64


def rope_rows(rng: np.random.Generator, m: int, R: int) -> torch.Tensor:
    """[m, 2, R] rows like the model's table: cos, and sin with the sign of each pair's first member."""
    ang = rng.uniform(0, 2 * math.pi, (m, R))
    return torch.from_numpy(np.stack([np.cos(ang), np.sin(ang) * rng.choice([-1.0, 1.0], (m, R))], 1)).float()


def product(f64: dict, name: str, x: np.ndarray) -> np.ndarray:
    return x @ f64[name].T


def rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def rope_ref(x: np.ndarray, n_heads: int, spec: LayerSpec, cs: np.ndarray) -> np.ndarray:
    """x [m, n_heads * D]; cs [m, 2, R] (cos, sin_signed) -> rotated copy (fluxion.h's formula)."""
    m, R, D = x.shape[0], spec.rope_dim, spec.head_dim
    out = x.copy().reshape(m, n_heads, D)
    i = np.arange(R)
    pair = (i + R // 2) % R if spec.rope_neox else i ^ 1
    rot = out[:, :, :R].copy()
    out[:, :, :R] = rot * cs[:, None, 0, :] + rot[:, :, pair] * cs[:, None, 1, :]
    return out.reshape(m, -1)


def layer_ref(spec: LayerSpec, f64: dict, x: np.ndarray, cs: np.ndarray, o: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    hq = spec.n_heads * spec.head_dim
    h = rms(x, f64["attn_norm"], spec.eps)
    qkv = np.concatenate([product(f64, n, h) for n in ("q", "k", "v")], axis=1)
    if f64["bias"] is not None:
        qkv = qkv + f64["bias"]
    if spec.rope_dim:
        qk = rope_ref(qkv[:, : hq + spec.n_kv_heads * spec.head_dim], spec.n_heads + spec.n_kv_heads, spec, cs)
        qkv = np.concatenate([qk, qkv[:, qk.shape[1]:]], axis=1)
    x2 = x + product(f64, "o", o)
    h2 = rms(x2, f64["ffn_norm"], spec.eps)
    g, u = product(f64, "gate", h2), product(f64, "up", h2)
    x2 = x2 + product(f64, "down", g / (1 + np.exp(-g)) * u)
    return qkv, x2
