"""Do several sparse runs lose the same RULER samples? Overlap of per-sample losses against one reference.

bench/ruler_paired.py compares one candidate with a reference. When several policy variants (window, budget, floor)
all trail the reference by about the same amount, the question is whether they lose the *same* samples: if a
larger budget loses the very samples a smaller one loses, the gap is not a budget question. This counts, for each
sample both runs scored, in how many of the N candidates it scored worse (and better) than the reference, prints
the histogram per task and the samples lost (won) by every candidate, and writes JSON.

Inputs are `bench/ruler_split.py score` outputs as FILE:MODE (the same as ruler_paired.py).

Usage: python research/ruler_overlap.py \
           --reference bench/results/ruler_qwen2.5-coder-0.5b_32768_h200.json:full \
           --candidate bench/results/ruler_qwen2.5-coder-0.5b_32768_h200_devsel_a57155a.json:fluxion \
                       bench/results/ruler_qwen2.5-coder-0.5b_32768_h200_diag_short32k_4544318.json:fluxion@diag_short32k.plan \
           --out bench/results/ruler_overlap_32768.json
"""
from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # the product benchmarks they build on
sys.path.insert(0, str(Path(__file__).resolve().parent))
from ruler_paired import Key, load_scores, write_out  # noqa: E402  (scripts import each other by name)


def overlap(ref: dict[Key, float], cands: list[dict[Key, float]]) -> dict[str, Any]:
    """Per sample scored by the reference and every candidate: how many candidates did worse / better."""
    common = sorted(set(ref).intersection(*cands))
    worse = {k: sum(c[k] < ref[k] for c in cands) for k in common}
    better = {k: sum(c[k] > ref[k] for c in cands) for k in common}
    n = len(cands)
    tasks: dict[str, dict[str, Any]] = {}
    for task in sorted({k[0] for k in common}):
        keys = [k for k in common if k[0] == task]
        tasks[task] = {
            "samples": len(keys),
            # lost_by[i]: samples that exactly i of the candidates scored worse on (i = 0..n)
            "lost_by": [sum(worse[k] == i for k in keys) for i in range(n + 1)],
            "won_by": [sum(better[k] == i for k in keys) for i in range(n + 1)],
        }
    return {
        "samples": len(common), "candidates": n,
        "lost_by": [sum(v == i for v in worse.values()) for i in range(n + 1)],
        "won_by": [sum(v == i for v in better.values()) for i in range(n + 1)],
        "lost_by_all": [list(k) for k in common if worse[k] == n],
        "won_by_all": [list(k) for k in common if better[k] == n],
        "tasks": tasks,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reference", required=True, help="FILE:MODE of a scored run, e.g. ruler_..._h200.json:full")
    ap.add_argument("--candidate", required=True, nargs="+", help="FILE:MODE of scored runs of the same samples")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    ref_len, ref = load_scores(args.reference)
    cands = []
    for spec in args.candidate:
        length, scores = load_scores(spec)
        if length != ref_len:
            sys.exit(f"error: {spec}: length {length}, the reference's is {ref_len}")
        cands.append(scores)
    out = overlap(ref, cands)
    if out["samples"] == 0:
        sys.exit("error: no (task, index) sample is scored in the reference and every candidate")
    out = {"length": ref_len, "reference": args.reference, "candidate": args.candidate} | out

    n = out["candidates"]
    print(f"RULER @ {ref_len}: samples scored worse / better than {args.reference} by k of {n} candidates")
    head = " ".join(f"{k:>4}" for k in range(1, n + 1))
    print(f"{'task':>18} {'n':>4}  worse by k: {head}   better by k: {head}")
    rows = list(out["tasks"].items()) + [("all", out)]
    for task, t in rows:
        lost = " ".join(f"{v:4d}" for v in t["lost_by"][1:])
        won = " ".join(f"{v:4d}" for v in t["won_by"][1:])
        print(f"{task:>18} {t['samples']:4d}  {'':12}{lost}   {'':13}{won}")
    lost_all = Counter(k[0] for k in out["lost_by_all"])
    print(f"worse in all {n}: {len(out['lost_by_all'])} samples ("
          + ", ".join(f"{t} {c}" for t, c in sorted(lost_all.items())) + f"); better in all {n}: "
          f"{len(out['won_by_all'])}")
    write_out(args.out, out)


if __name__ == "__main__":
    main()
