"""Where a sparse mode's RULER answers leave the reference's: per sample it scores worse on, the first output token
that differs, and both outputs' beginnings.

Reads answer files of `bench/ruler_split.py answer` (a reference mode, usually `full`, and a candidate mode, from
the same file or two files of the same exported samples), detokenises with the GGUF's tokenizer (run it where
`score` runs), and prints one block per loss plus, per task, the losses and the median first-divergence token.
An early divergence (the first few tokens) points at what the step reads while the answer's format is decided
(instructions, the question); a late one at a needle the selection missed.

Usage: python research/ruler_diverge.py --model qwen2.5-coder-0.5b --dir .ruler_ids --length 32768 \\
           --reference bench/results/ruler_answers_qwen2.5-coder-0.5b_32768_h200.json:full \\
           --candidate bench/results/ruler_answers_qwen2.5-coder-0.5b_32768_h200_devsel_a6afbd6.json:fluxion \\
           --out bench/results/ruler_diverge_32768.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # the product benchmarks they build on
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ruler_split import model_tag  # noqa: E402


def answer_run(spec: str, length: int) -> dict[str, Any]:
    """FILE:MODE -> the ruler_split answers run of that mode at that length (outputs, answered, ...)."""
    path, sep, mode = spec.rpartition(":")
    if not sep or not path:
        sys.exit(f"error: {spec!r}: use FILE:MODE")
    try:
        runs = json.loads(Path(path).read_text())["runs"]
    except (OSError, ValueError, KeyError) as e:
        sys.exit(f"error: {path}: not a ruler_split answer file ({e})")
    found = [r for r in runs if r["mode"] == mode and r["length"] == length]
    if not found:
        have = sorted({f"{r['mode']}@{r['length']}" for r in runs})
        sys.exit(f"error: {path} has no {mode} run at {length} (has {', '.join(have)})")
    return found[0]


def answer_outputs(spec: str, length: int) -> list[list[int]]:
    """FILE:MODE -> that run's output ids per sample (the run of that mode at that length)."""
    return answer_run(spec, length)["outputs"]


def first_difference(a: list[int], b: list[int]) -> int:
    """Index of the first differing token (the shorter length if one is a prefix of the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--dir", default=".ruler_ids")
    ap.add_argument("--length", type=int, required=True)
    ap.add_argument("--reference", required=True, help="FILE:MODE, e.g. answers.json:full")
    ap.add_argument("--candidate", required=True, help="FILE:MODE, e.g. answers.json:fluxion")
    ap.add_argument("--chars", type=int, default=160, help="characters of each output to print")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    from fluxion_lite.engine.engine import _resolve
    from fluxion_lite.model.gguf_loader import read_metadata
    from fluxion_lite.offline.ruler import score_output
    from fluxion_lite.model.tokenizer import Tokenizer

    meta_path = Path(args.dir) / f"{model_tag(args.model)}_{args.length}.json"
    if not meta_path.exists():
        sys.exit(f"error: {meta_path}: no exported samples (bench/ruler_split.py export)")
    meta = json.loads(meta_path.read_text())
    ref, cand = answer_outputs(args.reference, args.length), answer_outputs(args.candidate, args.length)
    path = _resolve(args.model)
    tok = Tokenizer(path, read_metadata(path)[0])
    eog = set(meta["eog_ids"])
    losses: list[dict[str, Any]] = []
    for k, s in enumerate(meta["samples"]):
        if not ref[k] or not cand[k]:
            continue  # not answered in one of the runs
        a, b = [t for t in ref[k] if t not in eog], [t for t in cand[k] if t not in eog]
        ta, tb = tok.decode(a), tok.decode(b)
        sa, sb = score_output(ta, s["answers"], s["metric"]), score_output(tb, s["answers"], s["metric"])
        if sa <= sb:
            continue
        losses.append({"task": s["task"], "index": s["index"], "reference_score": sa, "candidate_score": sb,
                       "first_difference": first_difference(a, b), "reference_tokens": len(a),
                       "candidate_tokens": len(b), "max_new_tokens": s["max_new_tokens"],
                       "reference": ta[: args.chars], "candidate": tb[: args.chars]})
    for x in losses:
        print(f"{x['task']:>18} #{x['index']:<3} {x['reference_score']:.2f} -> {x['candidate_score']:.2f}, "
              f"first difference at output token {x['first_difference']}")
        print(f"    reference: {x['reference']!r}\n    candidate: {x['candidate']!r}")
    by_task: dict[str, list[int]] = defaultdict(list)
    for x in losses:
        by_task[x["task"]].append(x["first_difference"])
    print(f"\n{'task':>18} {'losses':>6} {'median first difference':>24}")
    for task, firsts in sorted(by_task.items()):
        print(f"{task:>18} {len(firsts):6d} {statistics.median(firsts):24.1f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"length": args.length, "reference": args.reference,
                                        "candidate": args.candidate, "losses": losses}, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
