"""Which prefill numerics agree best with llama.cpp: teacher-forced top-1 of our quantized-weight path (the CPU
default) against llama-cpp-python on the same GGUF, with the prefill products (rows > PREFILL_ROWS) computed as

  bf16    the default where the CPU has native bf16: dequantized weights and the activations rounded to bf16
  fp32    the dequantized weights and the activations as fp32
  q8      fp32 GEMM over activations quantized per block to 8 bits first (round(x / d) * d, d = amax / 127 per
          32 elements, or per 256 for the K types), as llama.cpp and our decode kernels quantize them
  w2      two bf16 GEMMs: the activations in bf16 against the weights split into bf16 high and low parts
  x2      two bf16 GEMMs: the activations split into bf16 high and low parts against the weights in bf16
  x3      three bf16 GEMMs: both split, every product but low x low
  bf16v   bf16 for the layers, fp32 for the vocabulary product (the only prefill product whose error reaches a
          logit directly, and one that serving never runs on more than a chunk's last rows)
  bf16vN  as bf16v, and fp32 for the last N layers' products too (bf16v1, bf16v2, ...)

Usage: python research/parity_prefill_numerics.py [--models smollm2-135m qwen2.5-coder-0.5b] [--tokens 2048]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from parity import teacher_forced_parity  # noqa: E402

from fluxion_lite.engine.engine import Engine  # noqa: E402
from fluxion_lite.hostkv import quant  # noqa: E402
from fluxion_lite.hub.resolve import resolve_model  # noqa: E402
from fluxion_lite.model import quantized  # noqa: E402
from fluxion_lite.offline.eval_text import essay_text  # noqa: E402
from fluxion_lite.offline.llamacpp_peer import load_peer, teacher_forced_logits as peer_logits  # noqa: E402

K_TYPES = {"Q4_K", "Q5_K", "Q6_K"}
FLOAT_TYPES = {"F32", "F16", "BF16"}


def fake_q8(x: torch.Tensor, block: int) -> torch.Tensor:
    """x [T, k] with each block of `block` elements quantized to int8 at d = amax / 127 and back (fp32)."""
    t, k = x.shape
    xb = x.view(t, k // block, block)
    d = xb.abs().amax(-1, keepdim=True) / 127.0
    q = torch.where(d > 0, torch.round(xb / torch.where(d > 0, d, 1.0)), 0.0)
    return (q * d).view(t, k)


ORIGINAL_CALL = quantized.QuantLinear.__call__


def patched_call(mode: str, model: object):  # type: ignore[no-untyped-def]
    original = ORIGINAL_CALL
    precise = {id(model.output_mm)}  # type: ignore[attr-defined]
    if mode.startswith("bf16v") and mode != "bf16v":
        for lw in model.layers[-int(mode[5:]):]:  # type: ignore[attr-defined]
            precise |= {id(lw.wqkv), id(lw.wo), id(lw.w_gate_up), id(lw.w_down)}

    def call(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[no-untyped-def]
        x = x.float().contiguous()
        if x.shape[0] <= quantized.PREFILL_ROWS or mode == "bf16" or (mode.startswith("bf16v") and
                                                                       id(self) not in precise):
            return original(self, x, bias)
        w = self.dense(self.scratch.take(self.n_out * self.k))  # [n_out, k] fp32
        if mode == "q8":
            ys = []
            at = 0
            for p in self.parts:  # each part quantizes x as its own weight type's kernel does
                tname = quant.TYPE_NAMES[quant.type_id(p.wtype)]
                block = 256 if tname in K_TYPES else 32
                xin = x if tname in FLOAT_TYPES else fake_q8(x, block)
                ys.append(torch.nn.functional.linear(xin, w[at : at + p.n_out]))
                at += p.n_out
            y = torch.cat(ys, dim=1)
        elif mode == "w2":  # activations bf16, weights as bf16 hi + lo (two bf16 GEMMs)
            w_hi = w.to(torch.bfloat16)
            w_lo = (w - w_hi.float()).to(torch.bfloat16)
            xb = x.to(torch.bfloat16)
            y = torch.nn.functional.linear(xb, w_hi).float() + torch.nn.functional.linear(xb, w_lo).float()
        elif mode == "x2":  # activations as bf16 hi + lo, weights bf16 (two bf16 GEMMs)
            x_hi = x.to(torch.bfloat16)
            x_lo = (x - x_hi.float()).to(torch.bfloat16)
            wb = w.to(torch.bfloat16)
            y = torch.nn.functional.linear(x_hi, wb).float() + torch.nn.functional.linear(x_lo, wb).float()
        elif mode == "x3":  # both split into bf16 high and low parts; the lo x lo product left out (three GEMMs)
            x_hi = x.to(torch.bfloat16)
            x_lo = (x - x_hi.float()).to(torch.bfloat16)
            w_hi = w.to(torch.bfloat16)
            w_lo = (w - w_hi.float()).to(torch.bfloat16)
            lin = torch.nn.functional.linear
            y = lin(x_hi, w_hi).float() + lin(x_hi, w_lo).float() + lin(x_lo, w_hi).float()
        else:
            y = torch.nn.functional.linear(x, w)
        if bias is not None:
            y += bias
        return y

    return call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "qwen2.5-coder-0.5b"])
    ap.add_argument("--modes", nargs="+", default=["bf16", "fp32", "q8"])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out: dict[str, dict[str, object]] = {}
    for name in args.models:
        peer = load_peer(resolve_model(name, pull_missing=False), n_ctx=args.tokens + 64)
        engine = Engine(name, attention="full", prefix_cache_entries=0)
        assert engine.tokenizer is not None
        tokens = engine.tokenizer.encode(essay_text(), add_special=True)[: args.tokens]
        ref = np.asarray(peer_logits(peer, tokens))
        out[name] = {}
        for mode in args.modes:
            quantized.QuantLinear.__call__ = patched_call(mode, engine.model)  # type: ignore[method-assign]
            res, _ = teacher_forced_parity(engine, ref, tokens)
            out[name][mode] = res
            print(f"{name:<22}{mode:>6} top1 {res['top1_agreement']:.4f}  at gap>=0.5 {res['top1_agreement_confident']:.4f}"
                  f"  {res['seconds_ours']:.1f} s", flush=True)
        del engine, peer
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
