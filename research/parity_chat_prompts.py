"""Our last-position logits vs llama.cpp's on tests/engine/test_parity_llamacpp.py's three chat prompts, with our exact
fp32 forward and with llama.cpp's 8-bit activation rounding emulated (parity_activation_quant.q8_round): the top-2
tokens of each, and the mean / std of the logit difference. Shows whether a greedy divergence there is llama.cpp's
rounding.

Usage: python research/parity_chat_prompts.py [--model smollm2-135m] [--out bench/results/parity_chat_prompts.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fluxion_lite.model.transformer as model_module  # noqa: E402
from fluxion_lite.engine.engine import Engine  # noqa: E402
from fluxion_lite.offline.llamacpp_peer import load_peer, teacher_forced_logits as peer_logits  # noqa: E402
from fluxion_lite.offline.teacher_forcing import teacher_forced_logits  # noqa: E402
from parity_activation_quant import q8_round  # noqa: E402

PROMPTS = ("What is the capital of France?", "List three primary colours.", "What is 12 plus 30?")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--out", default="bench/results/parity_chat_prompts.json")
    args = ap.parse_args()
    engine = Engine(args.model, attention="full", prefix_cache_entries=0)
    tok = engine.tokenizer
    assert tok is not None
    peer = load_peer(engine.model_path, n_ctx=640)
    exact = F.linear
    rows = []
    for prompt in PROMPTS:
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": prompt}]))
        ref = peer_logits(peer, ids)[-1]
        top_ref = [tok.decode([int(t)]) for t in np.argsort(ref)[::-1][:2]]
        for name, linear in (("exact fp32", exact), ("q8 activations", lambda x, w, b=None: exact(q8_round(x), w, b))):
            model_module.F.linear = linear  # the model calls F.linear through its module's F
            try:
                ours = teacher_forced_logits(engine.model, engine.attn, ids).numpy()[-1]
            finally:
                model_module.F.linear = exact
            diff = ours - ref
            row = {"prompt": prompt, "ours": name, "top2_ours": [tok.decode([int(t)]) for t in np.argsort(ours)[::-1][:2]],
                   "top2_llamacpp": top_ref, "diff_mean": float(diff.mean()), "diff_std": float(diff.std())}
            rows.append(row)
            print(f"{prompt[:30]:<30} {name:<15} ours {row['top2_ours']}  llama.cpp {top_ref}  "
                  f"diff mean {row['diff_mean']:+.3f} std {row['diff_std']:.3f}")
    Path(args.out).write_text(json.dumps({"model": args.model, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
