"""The forward over weights in their blocks on the GPU (model/quantized_gpu.py) against the bf16 dequantized model,
on one GGUF file: load time, peak GPU memory, host peak RSS, the batch-1 decode step (median of 40, dense KV on the
GPU, CUDA graphs as the engine uses them), and the two sides' logits (prefill rows and decode steps).

Usage (GPU host): python research/gpu_quant_check.py FILE.gguf [--blocks-only]
"""
from __future__ import annotations

import argparse
import os
import resource
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fluxion_lite.model.attention import DenseAttention, SeqChunk  # noqa: E402
from fluxion_lite.model.gguf_loader import load_gguf  # noqa: E402
from fluxion_lite.model.transformer import Transformer  # noqa: E402


def run(model: Transformer, ids: list[int], n_dec: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(logits of the prefill's last 8 rows, of n_dec decode steps, the median step in ms)."""
    cfg = model.cfg
    attn = DenseAttention(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, model.dtype, model.device)
    attn.allocate(0)
    t = len(ids)
    pre = model.forward(torch.tensor(ids), torch.arange(t), [SeqChunk(0, 0, t)], attn,
                        logit_rows=torch.arange(t - 8, t))
    outs, times, tok = [], [], ids[-1]
    for i in range(n_dec):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs.append(model.forward(torch.tensor([tok]), torch.tensor([t + i]), [SeqChunk(0, t + i, 1)], attn))
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        tok = 1000 + i
    return pre.float(), torch.cat(outs).float(), sorted(times)[len(times) // 2] * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("path")
    ap.add_argument("--blocks-only", action="store_true", help="skip the bf16 model (a file too large for it)")
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name(0)}; file {os.path.getsize(args.path) / 2**20:.0f} MiB")
    ids = list(range(100, 400))
    res = {}
    for blocks in (True,) if args.blocks_only else (True, False):
        torch.cuda.reset_peak_memory_stats()
        t0 = time.time()
        model = Transformer(load_gguf(args.path, quantized=blocks), device="cuda", dtype=torch.bfloat16)
        torch.cuda.synchronize()
        load = time.time() - t0
        res[blocks] = run(model, ids, 40)
        print(f"{'blocks' if blocks else 'bf16'}: load {load:.1f} s, GPU peak {torch.cuda.max_memory_allocated() / 2**20:.0f}"
              f" MiB, host peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB, decode step "
              f"{res[blocks][2]:.2f} ms (batch 1, {len(ids)}-token context)")
        del model
        torch.cuda.empty_cache()
    if not args.blocks_only:
        for j, name in ((0, "prefill"), (1, "decode")):
            a, b = res[True][j], res[False][j]
            rel = (a - b).norm(dim=-1) / b.norm(dim=-1)
            print(f"{name}: relative difference mean {rel.mean():.4f} max {rel.max():.4f}, top-1 agreement "
                  f"{(a.argmax(-1) == b.argmax(-1)).float().mean():.3f}")


if __name__ == "__main__":
    main()
