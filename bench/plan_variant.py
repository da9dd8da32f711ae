"""Derive a policy-variant plan from a model's shipped static plan, for RULER / fidelity experiments.

The shipped plan keeps its streaming / retrieval split; every retrieval group can get another block size and a
scaled budget. Feed the result to `bench/ruler_split.py answer --plan FILE` (runs as mode fluxion@<file stem>).

  python bench/plan_variant.py --model qwen2.5-coder-0.5b --g 16 --budget-scale 0.6 --out /tmp/g16x06.plan.json
"""
from __future__ import annotations

import argparse
import sys
from importlib.resources import files
from dataclasses import replace
from pathlib import Path

from fluxion_lite.policy import plan_bytes_fraction
from fluxion_lite.sparse_plan import GRANULARITIES, SparsePlan


def variant(plan: SparsePlan, g: int | None, budget_scale: float) -> SparsePlan:
    """The same split with retrieval groups at block size g (None: keep) and budgets x budget_scale (capped at 1)."""
    rows = [[gp if gp.streaming else replace(gp, g=g or gp.g, budget=min(1.0, gp.budget * budget_scale))
             for gp in row] for row in plan.groups]
    source = f"{plan.source}; retrieval g={g or 'kept'}, budgets x{budget_scale:g}"
    return SparsePlan(plan.sink, plan.window, rows, source)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b", help="catalog name whose shipped plan is the base")
    ap.add_argument("--g", type=int, default=None, choices=GRANULARITIES, help="block size for every retrieval group")
    ap.add_argument("--budget-scale", type=float, default=1.0, help="multiply every retrieval budget by this")
    ap.add_argument("--out", required=True, help="where to write the variant plan (.plan.json)")
    args = ap.parse_args()
    if args.budget_scale <= 0:
        sys.exit("error: --budget-scale must be > 0")
    base = SparsePlan.load(Path(str(files("fluxion_lite.models"))) / f"{args.model}.plan.json")
    out = variant(base, args.g, args.budget_scale)
    out.save(Path(args.out))
    print(out.explain())
    for n in (4096, 8192, 16384, 32768):  # head_dim only scales both numerator and denominator
        kv, touched = plan_bytes_fraction(out, n, head_dim=64)
        print(f"  {n:>6} tokens: predicted KV read {kv:.1%} per step, {touched:.1%} with summaries")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
