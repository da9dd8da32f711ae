"""Is a RULER gap about which words an answer holds, or how many? Scores of answers cut to their first N words.

RULER's `all` metric (cwe, fwe, multivalue, ...) counts every reference found anywhere in the output, so an answer
that keeps listing words past what the question asks for ("the 10 most common words") can only gain. Two modes
that choose the same first words but stop at different lengths then differ on the metric. This re-scores both
sides' answers cut to their first N words (the text up to the end of its N-th alphabetic word, scored with the
task's own metric) and prints, per task and cut, each side's mean answer length in words, the share of answers
shorter than the longest cut, both scores and the paired difference; then the 13-task mean difference with only
the --cut-tasks cut at each N (others as answered) and its 95% paired bootstrap interval (bench/ruler_paired.py).

Inputs are `bench/ruler_split.py score` outputs as FILE:MODE, several per side for disjoint samples (pooled).

Usage: python research/ruler_length.py \\
           --reference bench/results/ruler_qwen2.5-coder-0.5b_4096_h200_from0_full_fluxion_9d2eaf5.json:full \\
           --candidate bench/results/ruler_qwen2.5-coder-0.5b_4096_h200_from0_full_fluxion_9d2eaf5.json:fluxion \\
           --cut-tasks cwe --words 10 20 30 --out bench/results/ruler_length_4096.json
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # the product benchmarks they build on
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ruler_paired import (  # noqa: E402
    Key, bootstrap_interval, paired_by_task, pooled_records, task_mean_difference, write_out)

from fluxion_lite.offline.ruler import TASK_SPECS, score_output  # noqa: E402

WORD = re.compile(r"[A-Za-z]+")


def first_words(text: str, n: int) -> str:
    """The text up to the end of its n-th alphabetic word (all of it if it has fewer)."""
    for i, match in enumerate(WORD.finditer(text)):
        if i + 1 == n:
            return text[: match.end()]
    return text


def word_count(text: str) -> int:
    return sum(1 for _ in WORD.finditer(text))


def load_records(specs: list[str]) -> dict[Key, dict[str, Any]]:
    """Several FILE:MODE scored runs of disjoint samples -> their records by (task, index), each with its answer."""
    _, pooled = pooled_records(specs)
    for (task, index), r in pooled.items():
        if "output" not in r or "answers" not in r:
            sys.exit(f"error: {task} #{index} of {' + '.join(specs)}: records lack output / answers "
                     "(score it again with bench/ruler_split.py score)")
    return pooled


def cut_score(record: dict[str, Any], n: int | None) -> float:
    """The record's score with its answer cut to n words (None: as answered, i.e. the stored score)."""
    if n is None:
        return float(record["score"])
    return score_output(first_words(record["output"], n), record["answers"], TASK_SPECS[record["task"]].metric)


def compare(ref: dict[Key, dict[str, Any]], cand: dict[Key, dict[str, Any]], cut_tasks: list[str],
            words: list[int], resamples: int, seed: int) -> dict[str, Any]:
    common = sorted(set(ref) & set(cand))
    if not common:
        sys.exit("error: the two sides share no (task, index) sample")
    tasks = sorted({k[0] for k in common})
    longest = max(words)
    cuts: dict[int | None, str] = {None: "as answered", **{n: f"first {n} words" for n in words}}
    # every sample's (reference, candidate) score at each cut, computed once: only the cut tasks are cut
    scored = {n: {k: (cut_score(ref[k], n if k[0] in cut_tasks else None),
                      cut_score(cand[k], n if k[0] in cut_tasks else None)) for k in common} for n in cuts}
    per_task: dict[str, Any] = {}
    for task in cut_tasks:
        keys = [k for k in common if k[0] == task]
        if not keys:
            sys.exit(f"error: --cut-tasks {task}: no sample of it in both runs (tasks: {', '.join(tasks)})")
        rows = {}
        for n, label in cuts.items():
            r, c = np.array([scored[n][k] for k in keys]).T  # [n_task] each
            rows[label] = {"reference": float(r.mean()), "candidate": float(c.mean()),
                           "difference": float((c - r).mean()), "better": int((c > r).sum()),
                           "worse": int((c < r).sum())}
        ref_words = np.array([word_count(ref[k]["output"]) for k in keys])
        cand_words = np.array([word_count(cand[k]["output"]) for k in keys])
        per_task[task] = {
            "samples": len(keys), "cuts": rows,
            "reference_words": float(ref_words.mean()), "candidate_words": float(cand_words.mean()),
            f"reference_shorter_than_{longest}": float((ref_words < longest).mean()),
            f"candidate_shorter_than_{longest}": float((cand_words < longest).mean()),
        }
    overall = {}
    for n, label in cuts.items():
        arrays = paired_by_task({k: rc[0] for k, rc in scored[n].items()}, {k: rc[1] for k, rc in scored[n].items()})
        lo, hi = bootstrap_interval(arrays, resamples, seed)
        overall[label] = {"difference": task_mean_difference(arrays), "interval95": [lo, hi]}
    return {"samples": len(common), "tasks": tasks, "cut_tasks": cut_tasks, "per_task": per_task, "overall": overall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reference", required=True, nargs="+", help="FILE:MODE of scored runs (disjoint samples)")
    ap.add_argument("--candidate", required=True, nargs="+", help="FILE:MODE of scored runs of the same samples")
    ap.add_argument("--cut-tasks", nargs="+", default=["cwe"], help="tasks whose answers are cut (default: cwe)")
    ap.add_argument("--words", type=int, nargs="+", default=[10, 20, 30], help="cut points in words")
    ap.add_argument("--resamples", type=int, default=20000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    unknown = [t for t in args.cut_tasks if t not in TASK_SPECS]
    if unknown:
        sys.exit(f"error: --cut-tasks: unknown task(s) {', '.join(unknown)}")
    if any(n < 1 for n in args.words):
        sys.exit("error: --words: cut points are at least 1 word")
    if args.resamples < 100:
        sys.exit("error: --resamples: at least 100")
    ref, cand = load_records(args.reference), load_records(args.candidate)
    out = {"reference": " + ".join(args.reference), "candidate": " + ".join(args.candidate),
           **compare(ref, cand, args.cut_tasks, sorted(set(args.words)), args.resamples, args.seed)}

    print(f"candidate: {out['candidate']}\nreference: {out['reference']}")
    for task, t in out["per_task"].items():
        longest = max(args.words)
        print(f"\n{task}: {t['samples']} samples; mean words reference {t['reference_words']:.1f}, candidate "
              f"{t['candidate_words']:.1f}; under {longest} words: reference "
              f"{100 * t[f'reference_shorter_than_{longest}']:.0f}%, "
              f"candidate {100 * t[f'candidate_shorter_than_{longest}']:.0f}%")
        print(f"{'answer':>16} {'reference':>10} {'candidate':>10} {'diff':>7} {'better':>7} {'worse':>6}")
        for cut, row in t["cuts"].items():
            print(f"{cut:>16} {100 * row['reference']:10.1f} {100 * row['candidate']:10.1f} "
                  f"{100 * row['difference']:+7.1f} {row['better']:7d} {row['worse']:6d}")
    print(f"\nmean over {len(out['tasks'])} tasks, candidate minus reference, {', '.join(args.cut_tasks)} cut:")
    for cut, row in out["overall"].items():
        lo, hi = row["interval95"]
        print(f"{cut:>16} {100 * row['difference']:+7.1f}   95% interval [{100 * lo:+.1f}, {100 * hi:+.1f}]")
    write_out(args.out, out)


if __name__ == "__main__":
    main()
