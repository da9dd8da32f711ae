"""Parity with llama.cpp on the same GGUF (dense attention on the CPU), for each of our weight modes (--dtypes: auto,
the file's blocks, and dequantised float32), and between our modes.

1. Teacher-forced over N tokens of Paul Graham essays: top-1 agreement overall, and at positions where llama.cpp's own
   top-2 logit gap is >= 0.5 (there it must be 100%: only near-ties may flip, since llama.cpp quantises activations).
2. Greedy chat continuations (first 32 tokens) for 10 prompts: identical count; where one differs, llama.cpp's top-2 gap at
   the first differing token.

3. Between our modes: top-1 agreement of each mode's teacher-forced logits with the first mode's (float32 by default).

Usage: python bench/parity.py [--models smollm2-135m qwen2.5-coder-0.5b] [--dtypes float32 auto] [--tokens 2048]
                              [--out bench/results/parity.json]
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np

from fluxion_lite.engine.engine import Engine
from fluxion_lite.hub.resolve import resolve_model
from fluxion_lite.offline.eval_text import essay_text
from fluxion_lite.offline.llamacpp_peer import greedy_continuation, load_peer, teacher_forced_logits as peer_logits
from fluxion_lite.engine.sampling import SamplingParams
from fluxion_lite.offline.teacher_forcing import teacher_forced_logits

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Explain what a hash table is in two sentences.",
    "Give me three tips for sleeping better.",
    "Translate 'good morning' into Spanish and German.",
    "What is 17 times 23?",
    "Write a haiku about autumn leaves.",
    "Why is the sky blue?",
    "List the planets of the solar system in order.",
    "Summarise the plot of Romeo and Juliet in one sentence.",
]
GAP_THRESHOLD = 0.5


def teacher_forced_parity(engine: Engine, ref: np.ndarray, tokens: list[int]) -> tuple[dict[str, float], np.ndarray]:
    t1 = time.perf_counter()
    ours = teacher_forced_logits(engine.model, engine.attn, tokens).numpy()
    t2 = time.perf_counter()
    top2 = np.partition(ref, -2, axis=1)[:, -2:]
    gap = np.abs(top2[:, 1] - top2[:, 0])
    agree = ours.argmax(1) == ref.argmax(1)
    confident = gap >= GAP_THRESHOLD
    return {
        "tokens": len(tokens),
        "top1_agreement": float(agree.mean()),
        "confident_positions": int(confident.sum()),
        "top1_agreement_confident": float(agree[confident].mean()),
        "disagreements_confident": int((~agree[confident]).sum()),
        "max_gap_at_disagreement": float(gap[~agree].max()) if (~agree).any() else 0.0,
        "max_abs_logit_diff": float(np.abs(ours - ref).max()),
        "seconds_ours": t2 - t1,
    }, ours


def chat_parity(engine: Engine, peer: object, n_new: int = 32) -> dict[str, object]:
    assert engine.tokenizer is not None
    tok = engine.tokenizer
    rows = []
    for prompt in CHAT_PROMPTS:
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": prompt}]), add_special=True)
        ref_ids, gaps = greedy_continuation(peer, ids, n_new, tok.eog_ids)
        rid = engine.add_request(ids, SamplingParams(temperature=0.0, max_tokens=n_new))
        ours: list[int] = []
        while engine.has_unfinished():
            for out in engine.step():
                if out.request_id == rid:
                    ours.extend(out.new_token_ids)
        first_diff = next((i for i, (a, b) in enumerate(zip(ours, ref_ids)) if a != b), None)
        if first_diff is None and len(ours) != len(ref_ids):
            first_diff = min(len(ours), len(ref_ids))
        rows.append(
            {
                "prompt": prompt,
                "identical": first_diff is None,
                "first_diff": first_diff,
                "llamacpp_gap_at_first_diff": gaps[first_diff] if first_diff is not None and first_diff < len(gaps) else None,
                "ours": tok.decode(ours),
                "llamacpp": tok.decode(ref_ids),
            }
        )
    return {"identical": sum(r["identical"] for r in rows), "prompts": len(rows), "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "qwen2.5-coder-0.5b"])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "auto"], choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--out", default="bench/results/parity.json")
    args = ap.parse_args()
    results = {"machine": platform.node(), "processor": platform.processor(), "models": {}}
    print(f"{'model':<22}{'dtype':>8}{'tokens':>7}{'top1':>8}{'top1@gap>=0.5':>15}{'confident':>10}{'maxΔlogit':>10}"
          f"{'chat same':>10}{'top1 vs ' + args.dtypes[0]:>16}")
    for name in args.models:
        peer = load_peer(resolve_model(name, pull_missing=False), n_ctx=args.tokens + 64)
        per_dtype: dict[str, object] = {}
        first: np.ndarray | None = None
        tokens: list[int] = []
        ref = np.empty(0)
        for dtype in args.dtypes:
            engine = Engine(name, dtype=dtype, attention="full", prefix_cache_entries=0)
            assert engine.tokenizer is not None
            if first is None:
                tokens = engine.tokenizer.encode(essay_text()[: args.tokens * 8], add_special=True)[: args.tokens]
                ref = peer_logits(peer, tokens)  # [N, V]
            tf, ours = teacher_forced_parity(engine, ref, tokens)
            if first is None:
                first = ours
            tf[f"top1_agreement_with_{args.dtypes[0]}"] = float((ours.argmax(1) == first.argmax(1)).mean())
            chat = chat_parity(engine, peer)
            per_dtype[dtype] = {"teacher_forced": tf, "chat": chat}
            print(f"{name:<22}{dtype:>8}{tf['tokens']:>7}{tf['top1_agreement']:>8.2%}{tf['top1_agreement_confident']:>15.2%}"
                  f"{tf['confident_positions']:>10}{tf['max_abs_logit_diff']:>10.3f}{chat['identical']:>7}/{chat['prompts']}"
                  f"{tf[f'top1_agreement_with_{args.dtypes[0]}']:>16.2%}", flush=True)
            for row in chat["rows"]:
                if not row["identical"]:
                    print(f"   differs at token {row['first_diff']} (llama.cpp top-2 gap "
                          f"{row['llamacpp_gap_at_first_diff']}): {row['prompt']}")
            del engine
        results["models"][name] = per_dtype
        del peer
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
