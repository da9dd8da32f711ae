"""A tiny random-weight model for the forward tests: its config (make_cfg), float64 weights (random_weights), the
textbook RoPE rotation (rope_formula) and a plain unfused float64 forward (unfused_logits) that the lean forward, the
kernels and the decode paths are checked against."""
from __future__ import annotations

import math

import torch

from fluxion_lite.model.config import ModelConfig
from fluxion_lite.model.gguf_loader import tensor_shapes

F64 = torch.float64


def make_cfg(arch: str, rope_dim: int | None = None, hq: int = 6, hkv: int = 2, d: int = 16) -> ModelConfig:
    return ModelConfig(arch=arch, n_layers=2, d_model=48, d_ff=64, n_heads=hq, n_kv_heads=hkv, head_dim=d,
                       vocab_size=50, context_length=8192, rms_eps=1e-6, rope_theta=10000.0,
                       rope_dim=rope_dim or d, rope_style="neox" if arch == "qwen2" else "interleaved",
                       rope_scaling="linear", rope_scale=2.0, qkv_bias=arch == "qwen2")


def random_weights(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, scale: float = 0.3) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=F64) * scale

    scales = {"token_embd.weight": 1.0}
    return {n: 1 + rnd(*s, scale=0.1) if n.endswith("norm.weight") else rnd(*s, scale=scales.get(n, 0.3))
            for n, s in tensor_shapes(cfg).items()}


def rope_formula(x: torch.Tensor, pos: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """x: [T, H, D] float64, the textbook rotation computed per call (what the table path must equal)."""
    rd = cfg.rope_dim
    inv = cfg.rope_theta ** (-torch.arange(rd // 2, dtype=F64) * 2 / rd)
    ang = (pos.to(F64) / cfg.rope_scale)[:, None, None] * inv  # [T, 1, R/2]
    out = x.clone()
    if cfg.rope_style == "neox":
        a, b = x[..., : rd // 2], x[..., rd // 2 : rd]
        out[..., : rd // 2], out[..., rd // 2 : rd] = a * ang.cos() - b * ang.sin(), b * ang.cos() + a * ang.sin()
    else:
        a, b = x[..., 0:rd:2], x[..., 1:rd:2]
        out[..., 0:rd:2], out[..., 1:rd:2] = a * ang.cos() - b * ang.sin(), b * ang.cos() + a * ang.sin()
    return out


def unfused_logits(cfg: ModelConfig, w: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    """Logits [T, V] of one sequence from position 0: separate q/k/v/gate/up matmuls, explicit causal softmax."""
    n, hq, hkv, d = len(tokens), cfg.n_heads, cfg.n_kv_heads, cfg.head_dim

    def norm(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + cfg.rms_eps) * g

    pos = torch.arange(n)
    x = w["token_embd.weight"][tokens]
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        h = norm(x, w[p + "attn_norm.weight"])
        q, k, v = (h @ w[p + f"attn_{s}.weight"].T + (w[p + f"attn_{s}.bias"] if cfg.qkv_bias else 0) for s in "qkv")
        q = rope_formula(q.view(n, hq, d), pos, cfg)
        k = rope_formula(k.view(n, hkv, d), pos, cfg).repeat_interleave(hq // hkv, dim=1)
        v = v.view(n, hkv, d).repeat_interleave(hq // hkv, dim=1)
        s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        o = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(n, hq * d)
        x = x + o @ w[p + "attn_output.weight"].T
        h = norm(x, w[p + "ffn_norm.weight"])
        gate, up = h @ w[p + "ffn_gate.weight"].T, h @ w[p + "ffn_up.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ w[p + "ffn_down.weight"].T
    return norm(x, w["output_norm.weight"]) @ w["output.weight"].T
