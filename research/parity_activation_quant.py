"""Does llama.cpp's 8-bit activation quantisation explain our remaining top-1 disagreements with it?

Teacher-forced top-1 agreement with llama.cpp on essay text, for our exact fp32 forward and for the same forward with
every matmul input rounded like llama.cpp's Q8 activations (blocks of 32, scale = max|x| / 127 stored as fp16).

Usage: python research/parity_activation_quant.py [--model smollm2-135m] [--tokens 1024]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import fluxion_lite.model.transformer as model_module
from fluxion_lite.engine.engine import Engine
from fluxion_lite.offline.eval_text import essay_text
from fluxion_lite.offline.llamacpp_peer import load_peer, teacher_forced_logits as peer_logits
from fluxion_lite.offline.teacher_forcing import teacher_forced_logits


def q8_round(x: torch.Tensor) -> torch.Tensor:
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // 32, 32)
    scale = (blocks.abs().amax(-1, keepdim=True) / 127).half().float()
    q = torch.where(scale > 0, torch.round(blocks / scale.clamp(min=1e-30)), torch.zeros_like(blocks))
    return (q * scale).reshape(x.shape)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--out", default="bench/results/parity_activation_quant.json")
    args = ap.parse_args()
    engine = Engine(args.model, attention="full", prefix_cache_entries=0)
    assert engine.tokenizer is not None
    tokens = engine.tokenizer.encode(essay_text()[: args.tokens * 12])[: args.tokens]
    ref = peer_logits(load_peer(engine.model_path, n_ctx=args.tokens + 64), tokens)
    top2 = np.partition(ref, -2, axis=1)[:, -2:]
    confident = np.abs(top2[:, 1] - top2[:, 0]) >= 0.5
    rows = {}
    exact_linear = F.linear
    for name, linear in (("exact fp32", exact_linear), ("q8 activations", lambda x, w, b=None: exact_linear(q8_round(x), w, b))):
        model_module.F.linear = linear  # the model calls F.linear through its module's F
        try:
            ours = teacher_forced_logits(engine.model, engine.attn, tokens).numpy()
        finally:
            model_module.F.linear = exact_linear
        agree = ours.argmax(1) == ref.argmax(1)
        rows[name] = {"top1": float(agree.mean()), "top1_confident": float(agree[confident].mean()),
                      "mean_abs_logit_diff": float(np.abs(ours - ref).mean())}
        print(f"{name:<16} top-1 {agree.mean():.2%}  at gap>=0.5 {agree[confident].mean():.2%}  "
              f"mean |Δlogit| {rows[name]['mean_abs_logit_diff']:.3f}")
    Path(args.out).write_text(json.dumps({"model": args.model, "tokens": len(tokens), "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
