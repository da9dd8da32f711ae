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
from collections import Counter
from dataclasses import replace
from importlib.resources import files
from pathlib import Path

from fluxion_lite.hostkv import native
from fluxion_lite.errors import ModelFileError
from fluxion_lite.plan.cost import scale_for_read
from fluxion_lite.plan.sparse_plan import (BACKGROUNDS, GRANULARITIES, MAX_PIN_SPAN, MAX_PIN_SPAN_TOKENS, GroupPlan,
                                      SparsePlan, check_curve, check_short)


def variant(plan: SparsePlan, g: int | None, budget_scale: float, scoring: str | None = None,
            pin_fraction: float | None = None, obs_window: int | None = None, pin_span: int | None = None,
            pin_decay: float | None = None, short_scale: float | None = None,
            short_tokens: int | None = None, sink: int | None = None, min_budget: float = 0.0,
            window: int | None = None, streaming_budget: float | None = None, long_only: bool = False,
            pin_span_tokens: int | None = None, long_exact_stream: bool | None = None,
            pin_stride: float | None = None, pin_min_blocks: int | None = None,
            pin_consensus: float | None = None) -> SparsePlan:
    """The same split with retrieval groups at block size g (None: keep), budgets raised to at least min_budget and
    then x budget_scale (capped at 1), the given block scoring, share of pinned blocks and pin span (with its
    decay), short-context budget scale (SparsePlan.budget_factor), sink and recent window; None keeps the base plan's
    value of any of these. streaming_budget: every streaming group becomes a retrieval group with this budget (before
    the scale) at the retrieval block size (g, else the base plan's most common one); long_only: a long-only one
    (GroupPlan.long_only: streaming up to short_tokens, its budget from twice that on). pin_span_tokens: pin spans
    in tokens (SparsePlan.span_for; 0 = in blocks, pin_span). long_exact_stream: long-only groups stream through the
    exact sink and window (SparsePlan.long_exact_stream). pin_stride: share of the pins spread evenly
    (SparsePlan.pin_stride); pin_min_blocks: groups with fewer blocks pin none (SparsePlan.pin_min_blocks);
    pin_consensus: share of the pin mass from all groups' mean (SparsePlan.pin_consensus). The base plan's budget
    curve stays; with_curve replaces it."""
    scoring = plan.scoring if scoring is None else scoring
    pin_fraction = plan.pin_fraction if pin_fraction is None else pin_fraction
    obs_window = plan.obs_window if obs_window is None else obs_window
    pin_span = plan.pin_span if pin_span is None else pin_span
    pin_decay = plan.pin_decay if pin_decay is None else pin_decay
    span_tokens = plan.pin_span_tokens if pin_span_tokens is None else pin_span_tokens
    long_exact = plan.long_exact_stream if long_exact_stream is None else long_exact_stream
    stride = plan.pin_stride if pin_stride is None else pin_stride
    consensus = plan.pin_consensus if pin_consensus is None else pin_consensus
    min_blocks = plan.pin_min_blocks if pin_min_blocks is None else pin_min_blocks
    sink = plan.sink if sink is None else sink
    window = plan.window if window is None else window
    short_scale = plan.short_scale if short_scale is None else short_scale
    short_tokens = plan.short_tokens if short_tokens is None else short_tokens
    sizes = Counter(gp.g for row in plan.groups for gp in row if not gp.streaming)
    g_turned = sizes.most_common(1)[0][0] if sizes else 16  # a turned streaming group's block size when g is None

    def retrieval(gp: GroupPlan) -> GroupPlan:
        if gp.streaming:
            if streaming_budget is None:
                return gp
            gp = replace(gp, streaming=False, g=g_turned, budget=streaming_budget, long_only=long_only)
        return replace(gp, g=g or gp.g, budget=min(1.0, max(gp.budget, min_budget) * budget_scale))

    rows = [[retrieval(gp) for gp in row] for row in plan.groups]
    floor = f"budgets >= {min_budget:g} then " if min_budget > 0 else "budgets "
    source = (f"{plan.source}; retrieval g={g or 'kept'}, {floor}x{budget_scale:g}, {scoring} scoring, "
              f"{pin_fraction:g} pinned"
              + (f" in spans of {span_tokens} tokens (x{pin_decay:g})" if span_tokens else
                 f" in spans of {pin_span} (x{pin_decay:g})" if pin_span != 1 else "")
              + (f", short contexts x{short_scale:g} up to {short_tokens}" if short_scale != 1.0 else "")
              + (f", sink {sink}" if sink != plan.sink else "")
              + (f", window {window}" if window != plan.window else "")
              + (f", streaming groups retrieve at {streaming_budget:g}" if streaming_budget is not None else "")
              + (f" from {2 * short_tokens} tokens on (long-only)" if streaming_budget is not None and long_only
                 else "")
              + (", long-only groups stream exactly" if long_exact and not plan.long_exact_stream else "")
              + (f", {stride:g} of the pins spread evenly" if stride != plan.pin_stride else "")
              + (f", pin consensus {consensus:g}" if consensus != plan.pin_consensus else "")
              + (f", no pins below {min_blocks} blocks" if min_blocks != plan.pin_min_blocks else ""))
    return SparsePlan(sink, window, rows, source, pin_fraction, obs_window, scoring, pin_span, pin_decay,
                      short_scale, short_tokens, span_tokens, long_exact, stride, min_blocks, plan.budget_curve,
                      consensus)


def with_curve(plan: SparsePlan, curve: dict[int, float], targets: dict[int, float]) -> SparsePlan:
    """The plan with the budget curve of the knots `curve` ({tokens: scale}) plus, for each {tokens: read} of
    `targets`, a knot whose scale makes the predicted read there that (policy.scale_for_read: solved at its own
    length, where the curve's factor is that knot's scale alone). The curve replaces the short scale; short_tokens
    stays (the long-only groups' ramp). ValueError when a target cannot be reached."""
    knots = dict(curve) | {n: scale_for_read(plan, n, f) for n, f in targets.items()}
    text = " ".join(f"x{s:.4g}@{n}" for n, s in sorted(knots.items()))
    return replace(plan, short_scale=1.0, budget_curve=tuple(sorted(knots.items())),
                   source=f"{plan.source}, budget curve {text} in place of the short scale"
                   + (" (read targets " + " ".join(f"{f:g}@{n}" for n, f in sorted(targets.items())) + ")"
                      if targets else ""))


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
