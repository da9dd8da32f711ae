"""Is a RULER accuracy gap real? Paired comparison of two scored runs of the same samples.

Two modes answered the same exported samples (bench/ruler_split.py export: fixed seeds), so each sample gives a
paired difference of scores. This prints, per task and overall, the candidate's accuracy minus the reference's,
the samples it scored better / worse on, a 95% interval for the overall difference from a paired bootstrap
(samples resampled within each task, since the mean accuracy weighs tasks equally) and the exact two-sided sign
test on better vs worse. Issue 4 asks for `fluxion` within 1 point of `full`: the interval says whether a
measured gap of a few points can be told apart from that with 20 samples a task.

Inputs are `bench/ruler_split.py score` outputs (FILE:MODE; per-sample records), or `bench/ruler.py` ones. A side may
name several FILE:MODE runs of disjoint samples (e.g. indices 0-19 from one lease and 20-39, answered with
`ruler_split.py answer --from-index 20` from a 40-sample export, from another): their records are pooled.

Usage: python bench/ruler_paired.py \\
           --reference bench/results/ruler_qwen2.5-coder-0.5b_32768_h200.json:full \\
           --candidate bench/results/ruler_qwen2.5-coder-0.5b_32768_h200_devsel_a57155a.json:fluxion \\
           --out bench/results/ruler_paired_32768.json
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

Key = tuple[str, int]  # (task, sample index)


def load_records(spec: str) -> tuple[int, dict[Key, dict[str, Any]]]:
    """FILE:MODE -> (context length, the mode's per-sample records by (task, index)) from a scored RULER file; each
    record has at least a task, an index and a score."""
    path, sep, mode = spec.rpartition(":")
    if not sep or not path:
        sys.exit(f"error: {spec!r}: use FILE:MODE")
    try:
        data = json.loads(Path(path).read_text())
        modes = data["modes"]
        length = int(data["length"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        sys.exit(f"error: {path}: not a scored RULER file ({e})")
    if not isinstance(modes, dict) or not all(isinstance(m, dict) for m in modes.values()):
        sys.exit(f"error: {path}: not a scored RULER file (its modes are not a table of runs)")
    if mode not in modes:
        sys.exit(f"error: {path} has no mode {mode!r} (has {', '.join(sorted(modes))})")
    records = modes[mode].get("records") or []
    if not records:
        sys.exit(f"error: {path}: mode {mode!r} has no per-sample records (score it again with bench/ruler_split.py score)")
    try:
        for r in records:
            float(r["score"])
        return length, {(r["task"], int(r["index"])): r for r in records}
    except (KeyError, TypeError, ValueError) as e:
        sys.exit(f"error: {path}: mode {mode!r}: a record lacks task / index / score ({e})")


def load_scores(spec: str) -> tuple[int, dict[Key, float]]:
    """FILE:MODE -> (context length, score per (task, index)) from a scored RULER file."""
    length, records = load_records(spec)
    return length, {key: float(r["score"]) for key, r in records.items()}


def pooled_records(specs: list[str]) -> tuple[int, dict[Key, dict[str, Any]]]:
    """Several FILE:MODE runs of one side -> (length, records of all their samples); a sample in two runs is an
    error (pooling must not count it twice), as are runs at different lengths."""
    length: int | None = None
    pooled: dict[Key, dict[str, Any]] = {}
    origin: dict[Key, str] = {}
    for spec in specs:
        spec_len, records = load_records(spec)
        if length is not None and spec_len != length:
            sys.exit(f"error: {spec} is at length {spec_len}, {specs[0]} at {length}: pool runs of one length")
        length = spec_len
        for key, value in records.items():
            if key in pooled:
                sys.exit(f"error: sample {key[0]} #{key[1]} is in both {origin[key]} and {spec}: pool disjoint runs")
            pooled[key], origin[key] = value, spec
    assert length is not None  # argparse gives each side at least one spec
    return length, pooled


def pooled_scores(specs: list[str]) -> tuple[int, dict[Key, float]]:
    """pooled_records, each sample's score only."""
    length, records = pooled_records(specs)
    return length, {key: float(r["score"]) for key, r in records.items()}


def paired_by_task(ref: dict[Key, float], cand: dict[Key, float]) -> dict[str, np.ndarray]:
    """Per task, candidate minus reference score for the samples both runs scored ([n_task] float64)."""
    common = sorted(set(ref) & set(cand))
    diffs: dict[str, list[float]] = defaultdict(list)
    for key in common:
        diffs[key[0]].append(cand[key] - ref[key])
    return {task: np.asarray(d, dtype=np.float64) for task, d in diffs.items()}


def task_mean_difference(diffs: dict[str, np.ndarray]) -> float:
    """The difference of the two runs' mean accuracies, tasks weighted equally (as the RULER table averages)."""
    return float(np.mean([d.mean() for d in diffs.values()]))


def bootstrap_interval(diffs: dict[str, np.ndarray], resamples: int, seed: int,
                       level: float = 0.95) -> tuple[float, float]:
    """Percentile interval of the task-weighted mean difference, resampling samples with replacement per task."""
    rng = np.random.default_rng(seed)
    means = np.zeros(resamples)
    for d in diffs.values():
        picks = rng.integers(0, d.size, size=(resamples, d.size))  # [R, n_task]
        means += d[picks].mean(axis=1)
    means /= len(diffs)
    tail = (1.0 - level) / 2.0
    lo, hi = np.quantile(means, [tail, 1.0 - tail])
    return float(lo), float(hi)


def sign_test(better: int, worse: int) -> float:
    """Exact two-sided sign test: P(a split at least this uneven | better and worse equally likely); ties left out."""
    n = better + worse
    if n == 0:
        return 1.0
    k = min(better, worse)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2.0**n
    return min(1.0, 2.0 * tail)


def summarise(diffs: dict[str, np.ndarray], resamples: int, seed: int) -> dict[str, Any]:
    all_d = np.concatenate(list(diffs.values()))
    better, worse = int((all_d > 0).sum()), int((all_d < 0).sum())
    lo, hi = bootstrap_interval(diffs, resamples, seed)
    return {
        "samples": int(all_d.size), "difference": task_mean_difference(diffs), "interval95": [lo, hi],
        "better": better, "worse": worse, "same": int(all_d.size) - better - worse,
        "sign_test_p": sign_test(better, worse),
        "tasks": {t: {"samples": int(d.size), "difference": float(d.mean()), "better": int((d > 0).sum()),
                      "worse": int((d < 0).sum())} for t, d in sorted(diffs.items())},
    }


def write_out(path: Path | None, out: dict[str, Any]) -> None:
    """Write a result as indented JSON if a path was given (the --out of the RULER comparison and background scripts)."""
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=1))
        print(f"wrote {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reference", required=True, nargs="+",
                    help="FILE:MODE of a scored run, e.g. ruler_..._h200.json:full (several: runs of disjoint samples, pooled)")
    ap.add_argument("--candidate", required=True, nargs="+",
                    help="FILE:MODE of a scored run of the same samples (several: pooled, as --reference)")
    ap.add_argument("--resamples", type=int, default=20000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.resamples < 100:
        sys.exit("error: --resamples: at least 100")
    ref_len, ref = pooled_scores(args.reference)
    cand_len, cand = pooled_scores(args.candidate)
    if ref_len != cand_len:
        sys.exit(f"error: the runs are at different lengths ({ref_len} vs {cand_len})")
    diffs = paired_by_task(ref, cand)
    if not diffs:
        sys.exit("error: the two runs share no (task, index) sample")
    unpaired = len(set(ref) ^ set(cand))
    reference, candidate = " + ".join(args.reference), " + ".join(args.candidate)
    out = {"length": ref_len, "reference": reference, "candidate": candidate, "unpaired": unpaired,
           "resamples": args.resamples, "seed": args.seed, **summarise(diffs, args.resamples, args.seed)}

    print(f"RULER @ {ref_len}: {candidate} minus {reference} (points; paired by sample)")
    print(f"{'task':>18} {'n':>4} {'diff':>7} {'better':>7} {'worse':>6}")
    for task, t in out["tasks"].items():
        print(f"{task:>18} {t['samples']:4d} {100 * t['difference']:+7.1f} {t['better']:7d} {t['worse']:6d}")
    lo, hi = out["interval95"]
    print(f"{'all':>18} {out['samples']:4d} {100 * out['difference']:+7.1f} {out['better']:7d} {out['worse']:6d}"
          f"   95% interval [{100 * lo:+.1f}, {100 * hi:+.1f}]  sign test p = {out['sign_test_p']:.3f}"
          + (f"  ({unpaired} samples in one run only, left out)" if unpaired else ""))
    write_out(args.out, out)


if __name__ == "__main__":
    main()
