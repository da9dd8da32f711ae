"""Fidelity of sparse decoding: teacher-forced KL(full || mode) and top-1 agreement over long essay text.

For each mode: prefill the first N - M tokens of Paul Graham essays densely (chunks longer than one token), then feed
the next M tokens one at a time (single-token chunks are decode steps: sparse in the sparse modes) and keep each step's
logits. The `full` run of the same procedure is the reference. Per mode: mean and max KL(full || mode) over the M
positions, top-1 agreement with full, the mode's own NLL of the true next token, mean fraction of the KV read per decode
step and fraction of streaming KV groups. Prints a table and writes JSON.

The model is loaded once: sparse backends come from fluxion_lite.engine.engine.make_attention where the engine has it; an
engine without it is asked for the mode directly (one more model load), and a mode it rejects is skipped.

Usage: python bench/fidelity.py --model qwen2.5-coder-0.5b --context 4096 --positions 64 --modes full fixed fluxion
On a machine without the tokenizer: `--export-tokens ids.json` here, then `--tokens ids.json --device cuda` there.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

from fluxion_lite.model.attention import AttentionBackend, SeqChunk
from fluxion_lite.engine.engine import Engine
from fluxion_lite.errors import FluxionError
from fluxion_lite.offline.eval_text import essay_tokens
from fluxion_lite.model.transformer import Transformer
from fluxion_lite.plan.sparse_plan import SparsePlan

SEQ_ID = 0


def prefill_chunks(n: int, chunk: int) -> list[tuple[int, int]]:
    """(start, length) pieces covering [0, n), none of length 1: a 1-token chunk would count as a decode step."""
    pieces = [(s, min(chunk, n - s)) for s in range(0, n, chunk)]
    if len(pieces) > 1 and pieces[-1][1] == 1:
        (s, length), _ = pieces[-2], pieces.pop()
        pieces[-1] = (s, length + 1)
    if pieces and pieces[-1][1] == 1:
        raise ValueError("the prefix must be at least 2 tokens long")
    return pieces


def decode_logprobs(
    model: Transformer, attn: AttentionBackend, tokens: list[int], n_decode: int, chunk: int
) -> torch.Tensor:
    """Log-probabilities [n_decode, V]: row i is the prediction after token len(tokens) - n_decode + i, computed by a
    single-token decode step over the KV of everything before it."""
    n_prefix = len(tokens) - n_decode
    attn.allocate(SEQ_ID)
    try:
        for start, length in prefill_chunks(n_prefix, chunk):
            model.forward(
                torch.tensor(tokens[start : start + length]), torch.arange(start, start + length),
                [SeqChunk(SEQ_ID, start, length)], attn,
            )
        rows = []
        for pos in range(n_prefix, len(tokens)):
            logits = model.forward(torch.tensor([tokens[pos]]), torch.tensor([pos]), [SeqChunk(SEQ_ID, pos, 1)], attn)
            rows.append(torch.log_softmax(logits.float().cpu(), dim=-1))  # [1, V]
    finally:
        attn.free(SEQ_ID)
    return torch.cat(rows)


def compare(ref: torch.Tensor, test: torch.Tensor, next_tokens: list[int]) -> dict[str, float]:
    """ref, test: log-probs [M, V]; next_tokens: the true next token of the first len(next_tokens) rows."""
    kl = (ref.exp() * (ref - test)).sum(-1)  # [M]: KL(full || mode) per position, in nats
    idx = torch.tensor(next_tokens)
    nll = -test[torch.arange(len(next_tokens)), idx]
    return {
        "kl_mean": float(kl.mean()),
        "kl_max": float(kl.max()),
        "kl_p90": float(kl.quantile(0.9)),
        "top1_agreement": float((ref.argmax(-1) == test.argmax(-1)).float().mean()),
        "nll_mean": float(nll.mean()),
    }


def backend_for(mode: str, full: Engine, plan: SparsePlan | None = None) -> tuple[Transformer, AttentionBackend] | str:
    """(model, attention backend) for a mode on the one loaded model, or the reason it is unavailable. Goes through
    the engine, so `fluxion` gets the per-request predictor when --predictor is given, as in serving; `plan`
    replaces fluxion's static plan (policy variants)."""
    try:
        full.set_attention(mode, plan)
    except FluxionError as exc:
        return str(exc)
    return full.model, full.attn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--context", type=int, default=4096, help="total tokens: prefix + decoded positions")
    ap.add_argument("--positions", type=int, default=64, help="decode steps compared (the last tokens of the context)")
    ap.add_argument("--modes", nargs="+", default=["full", "fixed", "fluxion"])
    ap.add_argument("--text-offset", type=int, default=0, help="character offset into the essays")
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--predictor", action="store_true", help="fluxion plans each request with the predictor")
    ap.add_argument("--tokens", default=None, help="read the text's token ids from this JSON file (no tokenizer)")
    ap.add_argument("--export-tokens", default=None, help="write the text's token ids to this JSON file and stop")
    ap.add_argument("--plan", nargs="*", default=[], help="also run fluxion with these plan files (fluxion@<stem>)")
    ap.add_argument("--out", default=None, help="default bench/results/fidelity_<model>_<context>.json")
    args = ap.parse_args()
    if not 1 <= args.positions <= args.context - 2:
        ap.error("--positions must be in [1, context - 2]")
    # full is the reference: always first; plan variants run as fluxion@<file stem>
    runs: list[tuple[str, str, SparsePlan | None]] = [("full", "full", None)]
    runs += [(m, m, None) for m in args.modes if m != "full"]
    try:
        runs += [("fluxion", f"fluxion@{Path(p).stem}", SparsePlan.load(Path(p))) for p in args.plan]
    except FluxionError as exc:
        sys.exit(f"error: {exc}")

    try:
        full = Engine(args.model, attention="full", device=args.device, dtype=args.dtype,
                      max_context=args.context + 1, prefix_cache_entries=0, load_tokenizer=args.tokens is None,
                      predictor=args.predictor)
    except FluxionError as exc:
        sys.exit(f"error: {exc}")
    if args.tokens:  # pre-tokenised (a machine without the tokenizer): the file holds the essay's token ids
        tokens = json.loads(Path(args.tokens).read_text())[: args.context]
    else:
        assert full.tokenizer is not None
        tokens = essay_tokens(full.tokenizer, args.context, args.text_offset)
        if args.export_tokens:
            Path(args.export_tokens).write_text(json.dumps(tokens))
            print(f"wrote {len(tokens)} token ids to {args.export_tokens}")
            return
    if len(tokens) < args.context:
        sys.exit(f"error: the essay text from offset {args.text_offset} has only {len(tokens)} tokens")
    next_tokens = tokens[len(tokens) - args.positions + 1 :]  # the last row predicts past the text: no target

    result: dict[str, Any] = {
        "model": args.model, "context": args.context, "positions": args.positions, "text_offset": args.text_offset,
        "dtype": args.dtype, "machine": platform.node(), "processor": platform.processor(), "modes": {},
    }
    ref: torch.Tensor | None = None
    for mode, label, plan in runs:
        got = backend_for(mode, full, plan)
        if isinstance(got, str):
            print(f"[skip] mode {label!r}: {got}", file=sys.stderr)
            result["modes"][label] = {"skipped": got}
            continue
        model, attn = got
        reset = getattr(attn, "reset_stats", None)
        if callable(reset):
            reset()
        t0 = time.perf_counter()
        logprobs = decode_logprobs(model, attn, tokens, args.positions, args.chunk)
        seconds = time.perf_counter() - t0
        if ref is None:
            ref = logprobs
        row: dict[str, Any] = compare(ref, logprobs, next_tokens) | {"seconds": seconds}
        row |= {k: float(v) for k, v in attn.stats().items()}
        result["modes"][label] = row
        print(f"[{label}] done in {seconds:.1f} s", file=sys.stderr)

    print(f"\nfidelity of {args.model}: {args.context} tokens, last {args.positions} decoded one at a time, vs full")
    header = ["KL mean", "KL p90", "KL max", "top-1", "NLL", "KV read/step", "streaming"]
    width = max(10, *(len(label) + 2 for label in result["modes"]))
    print(f"{'mode':<{width}}" + "".join(f"{h:>{w}}" for h, w in zip(header, (9, 9, 9, 8, 8, 14, 11))))
    for mode, r in result["modes"].items():
        if "skipped" in r:
            print(f"{mode:<{width}}  skipped: {r['skipped']}")
            continue
        kv = f"{r['kv_read_fraction']:.1%}" if "kv_read_fraction" in r else "100%"
        st = f"{r['streaming_fraction']:.1%}" if "streaming_fraction" in r else "-"
        print(
            f"{mode:<{width}}{r['kl_mean']:>9.4f}{r['kl_p90']:>9.4f}{r['kl_max']:>9.4f}{r['top1_agreement']:>8.1%}"
            f"{r['nll_mean']:>8.3f}{kv:>14}{st:>11}"
        )
    out = Path(args.out or f"bench/results/fidelity_{Path(args.model).stem}_{args.context}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
