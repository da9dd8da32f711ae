"""Llama / Qwen2 decoder forward in torch, over a packed batch of sequence chunks.

Pure tensor code: weights come from the GGUF loader, K/V storage and attention from an AttentionBackend, so the dense and
the hybrid sparse paths share every other line.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .attention import AttentionBackend, SeqChunk
from .config import ModelConfig
from .gguf_loader import GGUFModel


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor  # [d]
    wqkv: torch.Tensor  # [(Hq + 2 Hkv) D, d]: one matmul for q, k and v
    bqkv: torch.Tensor | None  # [(Hq + 2 Hkv) D] (qwen2)
    wo: torch.Tensor  # [d, Hq D]
    ffn_norm: torch.Tensor  # [d]
    w_gate_up: torch.Tensor  # [2 F, d]: gate and up in one matmul
    w_down: torch.Tensor  # [d, F]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


class RotaryEmbedding:
    def __init__(self, cfg: ModelConfig, device: torch.device):
        half = cfg.rope_dim // 2
        exponents = torch.arange(half, dtype=torch.float64, device=device) * 2 / cfg.rope_dim
        self.inv_freq = (1.0 / (cfg.rope_theta**exponents)).float()  # [D/2]
        self.style, self.rope_dim, self.scale = cfg.rope_style, cfg.rope_dim, cfg.rope_scale

    def __call__(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [T, H, D], positions: [T] -> x rotated by each token's position."""
        angles = (positions.float() / self.scale)[:, None] * self.inv_freq[None, :]  # [T, D/2]
        cos, sin = angles.cos()[:, None, :].to(x.dtype), angles.sin()[:, None, :].to(x.dtype)  # [T, 1, D/2]
        rot, rest = x[..., : self.rope_dim], x[..., self.rope_dim :]
        if self.style == "neox":  # pairs (i, i + D/2)
            a, b = rot.chunk(2, dim=-1)
            rotated = torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)
        else:  # interleaved pairs (2i, 2i + 1)
            a, b = rot[..., 0::2], rot[..., 1::2]
            rotated = torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2)
        return torch.cat((rotated, rest), dim=-1) if rest.shape[-1] else rotated


class Transformer:
    def __init__(self, gguf_model: GGUFModel, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32):
        self.cfg = cfg = gguf_model.config
        self.device, self.dtype = torch.device(device), dtype
        t = gguf_model.tensors

        def w(name: str) -> torch.Tensor:
            return t[name].to(device=self.device, dtype=dtype)

        self.embed = w("token_embd.weight")  # [V, d]
        self.output = self.embed if cfg.tied_embeddings else w("output.weight")  # [V, d]
        self.output_norm = w("output_norm.weight")
        self.layers: list[LayerWeights] = []
        for i in range(cfg.n_layers):
            p = f"blk.{i}."
            bias = None
            if cfg.qkv_bias:
                bias = torch.cat([w(p + "attn_q.bias"), w(p + "attn_k.bias"), w(p + "attn_v.bias")])
            self.layers.append(
                LayerWeights(
                    attn_norm=w(p + "attn_norm.weight"),
                    wqkv=torch.cat([w(p + "attn_q.weight"), w(p + "attn_k.weight"), w(p + "attn_v.weight")]),
                    bqkv=bias,
                    wo=w(p + "attn_output.weight"),
                    ffn_norm=w(p + "ffn_norm.weight"),
                    w_gate_up=torch.cat([w(p + "ffn_gate.weight"), w(p + "ffn_up.weight")]),
                    w_down=w(p + "ffn_down.weight"),
                )
            )
        self.rope = RotaryEmbedding(cfg, self.device)

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        chunks: list[SeqChunk],
        attn: AttentionBackend,
        logit_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens, positions: [T] packed over `chunks`. Returns logits [R, V] (fp32) for the rows in logit_rows
        (default: the last token of every chunk)."""
        cfg = self.cfg
        hq, hkv, d = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        tokens, positions = tokens.to(self.device), positions.to(self.device)
        x = self.embed[tokens]  # [T, d]
        n_tok = x.shape[0]
        for i, lw in enumerate(self.layers):
            h = rms_norm(x, lw.attn_norm, cfg.rms_eps)
            qkv = F.linear(h, lw.wqkv, lw.bqkv)  # [T, (Hq + 2 Hkv) D]
            q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
            q = self.rope(q.view(n_tok, hq, d), positions)  # [T, Hq, D]
            k = self.rope(k.view(n_tok, hkv, d), positions)  # [T, Hkv, D]
            o = attn.attend(i, q, k, v.reshape(n_tok, hkv, d), chunks)  # [T, Hq, D]
            x = x + F.linear(o.reshape(n_tok, hq * d), lw.wo)
            h = rms_norm(x, lw.ffn_norm, cfg.rms_eps)
            gate, up = F.linear(h, lw.w_gate_up).chunk(2, dim=-1)  # [T, F] each
            x = x + F.linear(F.silu(gate) * up, lw.w_down)
        if logit_rows is None:
            ends = torch.tensor([c.length for c in chunks]).cumsum(0) - 1
            logit_rows = ends.to(self.device)
        x = rms_norm(x[logit_rows.to(self.device)], self.output_norm, cfg.rms_eps)
        return F.linear(x, self.output).float()  # [R, V]
