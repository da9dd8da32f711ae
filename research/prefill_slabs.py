"""Whether a CPU prefill product should dequantize its weight in row slabs that stay in cache, each multiplied as
soon as it is made, instead of the whole matrix into one bf16 buffer and one GEMM (model/quantized.py today): the
whole-matrix way writes the bf16 weight to DRAM and reads it back once per prefill chunk.

Times one layer's gate/up (Q4_K) and down (Q6_K) products of qwen2.5-coder-1.5b at 512 rows of bf16 x, whole matrix
against slabs of 4096 / 1024 / 256 rows, median of 5, in one process (the outputs are checked against each other).

Usage: python research/prefill_slabs.py [--threads 2] [--rows 512]
"""
from __future__ import annotations

import argparse
import os
import time

import torch

from fluxion_lite.hostkv import native, quant
from fluxion_lite.model.gguf_file import GGUFFile


def product(parts: list[quant.QuantWeight], x: torch.Tensor, slab: int | None) -> torch.Tensor:
    """x [T, k] bf16 @ [W_0; W_1; ...]^T -> [T, n] bf16, dequantizing whole matrices or `slab` rows at a time."""
    n, k = sum(p.n_out for p in parts), parts[0].k
    if slab is None:
        w = torch.empty(n, k, dtype=torch.bfloat16)
        at = 0
        for p in parts:
            p.dequantize_bf16(out=w[at : at + p.n_out])
            at += p.n_out
        return torch.nn.functional.linear(x, w)
    y = torch.empty(x.shape[0], n, dtype=torch.bfloat16)
    buf = torch.empty(slab * k, dtype=torch.bfloat16)
    at = 0
    for p in parts:
        for r0 in range(0, p.n_out, slab):
            m = min(slab, p.n_out - r0)
            w = buf[: m * k].view(m, k)
            p.dequantize_bf16(row0=r0, n_rows=m, out=w)
            torch.matmul(x, w.t(), out=y[:, at + r0 : at + r0 + m])
        at += p.n_out
    return y


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--model", default=os.path.expanduser("~/.cache/fluxion-lite/models/qwen2.5-coder-1.5b.gguf"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    native.set_threads(args.threads)
    tensors = {t.name: t for t in GGUFFile(args.model).tensors}

    def weight(name: str) -> quant.QuantWeight:
        t = tensors[name]
        return quant.QuantWeight(t.type_name, t.data, t.shape[0], t.shape[1])

    cases = {"gate/up": [weight("blk.3.ffn_gate.weight"), weight("blk.3.ffn_up.weight")],
             "down": [weight("blk.3.ffn_down.weight")]}
    for name, parts in cases.items():
        x = torch.randn(args.rows, parts[0].k).to(torch.bfloat16)
        ref = product(parts, x, None).float()
        for slab in (None, 4096, 1024, 256):
            got = product(parts, x, slab).float()
            assert (got - ref).abs().max() <= 1e-2 * ref.abs().max()
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                product(parts, x, slab)
                times.append(time.perf_counter() - t0)
            print(f"{name:<8} ({parts[0].name}, {sum(p.n_out for p in parts)} x {parts[0].k}) slab {slab}: "
                  f"{sorted(times)[2] * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
