"""Quality vs bytes: uniform top-k plans (the `fixed` family) against calibrated per-group plans at several epsilons.

Teacher-forced decode over essay text (same procedure as bench/fidelity.py): KL(full || plan) and top-1 agreement,
next to the mean fraction of the KV read per step (sink and window included) and the bytes touched incl. summaries.

Usage: python research/policy_sweep.py --model smollm2-135m --context 2048 --positions 32 --epsilons 0.01 0.02 0.05
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # the product benchmarks they build on
from fidelity import compare, decode_logprobs  # noqa: E402

from fluxion_lite.engine.engine import DTYPES, Engine, make_attention  # noqa: E402
from fluxion_lite.offline.eval_text import essay_text  # noqa: E402
from fluxion_lite.plan.cost import plan_bytes_fraction  # noqa: E402
from fluxion_lite.plan.selector import load_labels, select_plan  # noqa: E402
from fluxion_lite.plan.sparse_plan import SparsePlan  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--positions", type=int, default=32)
    ap.add_argument("--text-offset", type=int, default=200_000, help="held out from calibration text (starts at 0)")
    ap.add_argument("--labels", default=None, help="default models/<model>.calib.json")
    ap.add_argument("--epsilons", nargs="+", type=float, default=[0.01, 0.02, 0.05, 0.1])
    ap.add_argument("--budgets", nargs="+", type=float, default=[0.02, 0.05, 0.10])
    ap.add_argument("--sink", type=int, default=16)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--out", default=None)
    ap.add_argument("--tokens", default=None, help="token ids (JSON) of the text, for a machine without the "
                    "tokenizer: write them with bench/fidelity.py --export-tokens --text-offset ...")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    eng = Engine(args.model, attention="full", max_context=args.context + 1, prefix_cache_entries=0, device=args.device,
                 dtype=args.dtype, load_tokenizer=args.tokens is None)
    cfg = eng.config
    if args.tokens:
        tokens = json.loads(Path(args.tokens).read_text())[: args.context]
    else:
        assert eng.tokenizer is not None
        text = essay_text()[args.text_offset : args.text_offset + args.context * 8]
        tokens = eng.tokenizer.encode(text)[: args.context]
    if len(tokens) < args.context:
        sys.exit(f"error: the text has only {len(tokens)} tokens, --context is {args.context}")
    labels, meta = load_labels(Path(args.labels or f"models/{args.model}.calib.json"))
    plans: list[tuple[str, SparsePlan]] = [
        (f"uniform g16 b={b:g}", SparsePlan.uniform(cfg.n_layers, cfg.n_kv_heads, 16, b, args.sink, args.window))
        for b in args.budgets
    ]
    plans += [(f"calibrated eps={e:g}", select_plan(labels, cfg.n_layers, cfg.n_kv_heads, e, args.context, args.sink,
                                                    args.window, cfg.head_dim)) for e in args.epsilons]
    chunk = 8192 if args.device.startswith("cuda") else 512
    ref = decode_logprobs(eng.model, eng.attn, tokens, args.positions, chunk)
    next_tokens = tokens[len(tokens) - args.positions + 1 :]
    rows = []
    print(f"{args.model} context {args.context}, {args.positions} decode positions, machine {platform.node()}")
    print(f"{'plan':<24}{'KL':>8}{'top1':>7}{'KV read':>9}{'touched':>9}{'stream':>8}")
    for name, plan in plans:
        attn = make_attention("fluxion", cfg, DTYPES[args.dtype], torch.device(args.device), 2, args.model, plan=plan)
        res = compare(ref, decode_logprobs(eng.model, attn, tokens, args.positions, chunk), next_tokens)
        kv_frac = attn.stats()["kv_read_fraction"]
        _, touched = plan_bytes_fraction(plan, args.context, cfg.head_dim)
        row = {"plan": name, **res, "kv_read_fraction": kv_frac, "touched_fraction_model": touched,
               "streaming_fraction": plan.streaming_fraction}
        rows.append(row)
        print(f"{name:<24}{res['kl_mean']:>8.4f}{res['top1_agreement']:>7.2f}{kv_frac:>9.3f}{touched:>9.3f}"
              f"{plan.streaming_fraction:>8.2f}")
    out = Path(args.out or f"bench/results/policy_sweep_{args.model}_{args.context}.json")
    out.write_text(json.dumps({"model": args.model, "context": args.context, "positions": args.positions,
                               "calibration": meta, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
