"""Derive a policy-variant plan from a model's shipped static plan, for RULER / fidelity experiments.

The shipped plan keeps its streaming / retrieval split (unless --streaming-budget turns the streaming groups into
retrieval ones); every retrieval group can get another block size and a scaled budget (raised to a floor first, if
asked); flags left out keep the base plan's values. Feed the result to `bench/ruler_split.py answer --plan FILE`
(runs as mode fluxion@<file stem>).

  python research/plan_variant.py --model qwen2.5-coder-0.5b --g 16 --budget-scale 0.6 --scoring per-head \
      --pin-fraction 0.5 --out /tmp/g16x06.plan.json
  python research/plan_variant.py --base models/qwen2.5-coder-0.5b.plan.json --pin-fraction 0.5 --pin-span 2 \
      --out /tmp/span2.plan.json
  python research/plan_variant.py --base models/qwen2.5-coder-0.5b.plan.json --pin-fraction 0.75 --pin-span 3 \
      --short-scale 1.8 --short-tokens 8192 --out /tmp/short.plan.json
  python research/plan_variant.py --base models/qwen2.5-coder-0.5b.plan.json --min-budget 0.02 --budget-scale 0.95 \
      --out /tmp/floor.plan.json
  python research/plan_variant.py --base bench/results/plans/shipped_a62cb96.plan.json --streaming-budget 0.02 \
      --long-only --budget-scale 0.9 --short-scale 1.8888888888888888 --out /tmp/long_only.plan.json
  python research/plan_variant.py --base models/qwen2.5-coder-1.5b.plan.json --budget-curve 4096:1.65 16384:1 \
      --read-target 8192:0.097 32768:0.048 --out /tmp/curve.plan.json
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from importlib.resources import files
from pathlib import Path

from fluxion_lite.hostkv import native
from fluxion_lite.errors import ModelFileError
from fluxion_lite.plan.recipe import variant, with_curve
from fluxion_lite.plan.sparse_plan import (BACKGROUNDS, GRANULARITIES, MAX_PIN_SPAN, MAX_PIN_SPAN_TOKENS, SparsePlan,
                                      check_curve, check_short)


def knots(values: list[str] | None, flag: str) -> dict[int, float]:
    """TOKENS:VALUE pairs of a command-line flag as {tokens: value}; exits naming the flag on a malformed one."""
    out: dict[int, float] = {}
    for item in values or []:
        tokens, sep, value = item.partition(":")
        try:
            if not sep or int(tokens) <= 0 or int(tokens) in out:
                raise ValueError
            out[int(tokens)] = float(value)
        except ValueError:
            sys.exit(f"error: {flag}: expected distinct TOKENS:VALUE pairs with TOKENS > 0 (got {item!r})")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b", help="catalog name whose shipped plan is the base")
    ap.add_argument("--base", default=None, help="start from this plan file instead of the shipped one")
    ap.add_argument("--g", type=int, default=None, choices=GRANULARITIES, help="block size for every retrieval group")
    ap.add_argument("--budget-scale", type=float, default=1.0, help="multiply every retrieval budget by this")
    ap.add_argument("--min-budget", type=float, default=0.0,
                    help="raise every retrieval budget below this to it, before --budget-scale (with a scale < 1: "
                         "reads moved from the widest groups to the narrowest)")
    # Unset pin / scoring flags keep the base plan's values (as --sink and --short-scale do): a variant of the
    # shipped plan that changes only its budgets must not silently drop its pins.
    ap.add_argument("--scoring", default=None, choices=native.SCORINGS,
                    help="top-k block scoring (default: the base plan's)")
    ap.add_argument("--pin-fraction", type=float, default=None,
                    help="share of each retrieval budget pinned at prefill end by the prompt's last tokens "
                         "(default: the base plan's)")
    ap.add_argument("--obs-window", type=int, default=None,
                    help="prompt tokens whose attention picks the pins (default: the base plan's)")
    ap.add_argument("--pin-span", type=int, default=None,
                    help="each block pinned by mass brings its pin_span - 1 successors, within the same pin count "
                         "(default: the base plan's)")
    ap.add_argument("--pin-span-tokens", type=int, default=None,
                    help="pin spans in tokens: a group of block size g pins ceil(this / g) blocks per span (0: "
                         "--pin-span blocks for every g; default: the base plan's)")
    ap.add_argument("--pin-decay", type=float, default=None,
                    help="a successor scores this x its predecessor's mass (1: before any lighter block; default: "
                         "the base plan's)")
    ap.add_argument("--pin-stride", type=float, default=None,
                    help="share of the pins spread evenly over the context instead of picked by mass (default: the "
                         "base plan's)")
    ap.add_argument("--pin-min-blocks", type=int, default=None,
                    help="groups with fewer blocks than this (at the context at hand) pin none (default: the base "
                         "plan's)")
    ap.add_argument("--pin-consensus", type=float, default=None,
                    help="share of each group's pin mass taken from all retrieval groups' normalised mean, so a "
                         "needle some groups found is pinned by the others too (default: the base plan's)")
    ap.add_argument("--short-scale", type=float, default=None,
                    help="retrieval budgets x this up to --short-tokens of context, x1 from twice that on, linear in "
                         "log2(context) between (>= 1; default: the base plan's, 1 = off)")
    ap.add_argument("--short-tokens", type=int, default=None,
                    help="context up to which --short-scale applies in full (> 0; default: the base plan's)")
    ap.add_argument("--budget-curve", nargs="+", default=None, metavar="TOKENS:SCALE",
                    help="retrieval budgets x SCALE at TOKENS of context, linear in log2(context) between the knots, "
                         "flat outside (SparsePlan.budget_curve; replaces the short scale; default: the base plan's)")
    ap.add_argument("--read-target", nargs="+", default=None, metavar="TOKENS:FRACTION",
                    help="add a --budget-curve knot at TOKENS whose scale makes the predicted KV read there "
                         "(sink and window included) FRACTION, e.g. 8192:0.097 (policy.scale_for_read)")
    ap.add_argument("--sink", type=int, default=None, help="sink tokens (default: the base plan's)")
    ap.add_argument("--window", type=int, default=None,
                    help="recent-window tokens (default: the base plan's); the prompt's question sits in the window "
                         "at the first decode step and leaves it as the answer grows")
    ap.add_argument("--streaming-budget", type=float, default=None,
                    help="turn every streaming group into a retrieval group with this budget (then x --budget-scale): "
                         "do the groups that never read past sink + window cost the long-context answers?")
    ap.add_argument("--long-only", action="store_true",
                    help="with --streaming-budget: the turned groups stay streaming up to the short-context tokens and "
                         "retrieve from twice that on (linear in log2 of the context between)")
    ap.add_argument("--long-exact-stream", action="store_true", default=None,
                    help="long-only groups stream through the exact sink and window up to the short-context tokens, "
                         "not their block size's aligned ones (default: the base plan's choice)")
    ap.add_argument("--background", default=None, choices=BACKGROUNDS,
                    help="the unread-background term (SparsePlan.background; default: the base plan's)")
    ap.add_argument("--out", required=True, help="where to write the variant plan (.plan.json)")
    args = ap.parse_args()
    if args.sink is not None and args.sink < 1:
        sys.exit("error: --sink must be >= 1")
    if args.window is not None and args.window < 1:
        sys.exit("error: --window must be >= 1")
    if args.budget_scale <= 0:
        sys.exit("error: --budget-scale must be > 0")
    if args.streaming_budget is not None and not 0.0 < args.streaming_budget <= 1.0:
        sys.exit("error: --streaming-budget must be in (0, 1]")
    if args.long_only and args.streaming_budget is None:
        sys.exit("error: --long-only needs --streaming-budget (the budget the turned groups get at long contexts)")
    if not 0.0 <= args.min_budget <= 1.0:
        sys.exit("error: --min-budget must be in [0, 1]")
    # flags left out (None) keep the base plan's values: variant() fills them in, so only given values are checked
    if args.pin_fraction is not None and not 0.0 <= args.pin_fraction <= 1.0:
        sys.exit("error: --pin-fraction must be in [0, 1]")
    if args.obs_window is not None and args.obs_window < 1:
        sys.exit("error: --obs-window must be >= 1")
    if args.pin_span is not None and not 1 <= args.pin_span <= MAX_PIN_SPAN:
        sys.exit(f"error: --pin-span must be in [1, {MAX_PIN_SPAN}]")
    if args.pin_span_tokens is not None and not 0 <= args.pin_span_tokens <= MAX_PIN_SPAN_TOKENS:
        sys.exit(f"error: --pin-span-tokens must be in [0, {MAX_PIN_SPAN_TOKENS}]")
    if args.pin_decay is not None and not 0.0 < args.pin_decay <= 1.0:
        sys.exit("error: --pin-decay must be in (0, 1]")
    if args.pin_stride is not None and not 0.0 <= args.pin_stride <= 1.0:
        sys.exit("error: --pin-stride must be in [0, 1]")
    if args.pin_consensus is not None and not 0.0 <= args.pin_consensus <= 1.0:
        sys.exit("error: --pin-consensus must be in [0, 1]")
    if args.pin_min_blocks is not None and args.pin_min_blocks < 0:
        sys.exit("error: --pin-min-blocks must be >= 0")
    try:
        check_short(1.0 if args.short_scale is None else args.short_scale,
                    8192 if args.short_tokens is None else args.short_tokens)
    except ValueError as exc:
        sys.exit(f"error: --{str(exc).replace('_', '-')}")
    curve, targets = knots(args.budget_curve, "--budget-curve"), knots(args.read_target, "--read-target")
    if set(curve) & set(targets):
        sys.exit("error: --read-target: a length given a scale by --budget-curve too")
    if any(not 0.0 < f <= 1.0 for f in targets.values()):
        sys.exit("error: --read-target: each FRACTION must be in (0, 1]")
    if curve:
        try:
            check_curve(sorted(curve.items()))
        except ValueError as exc:
            sys.exit(f"error: --{str(exc).replace('_', '-')}")
    base_path = Path(args.base) if args.base else Path(str(files("fluxion_lite.models"))) / f"{args.model}.plan.json"
    try:
        base = SparsePlan.load(base_path)
    except ModelFileError as exc:
        sys.exit(f"error: --base: {exc}")
    out = variant(base, args.g, args.budget_scale, args.scoring, args.pin_fraction, args.obs_window, args.pin_span,
                  args.pin_decay, args.short_scale, args.short_tokens, args.sink, args.min_budget,
                  args.window, args.streaming_budget, args.long_only, args.pin_span_tokens, args.long_exact_stream,
                  args.pin_stride, args.pin_min_blocks, args.pin_consensus)
    if curve or targets:
        try:
            out = with_curve(out, curve, targets)
        except ValueError as exc:
            sys.exit(f"error: --read-target: {exc}")
    if args.background is not None and args.background != out.background:
        out = replace(out, background=args.background, source=f"{out.source}; background {args.background}")
    out.save(Path(args.out))
    print(out.explain())  # with the predicted reads at 4K-32K
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
