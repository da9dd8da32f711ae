"""Shaping a selector's plan: the steps that made the shipped plans from their calibrations, as code.

`variant` changes a plan's block sizes, budgets, pins, short-context scale and streaming groups; `with_curve` gives
it a budget curve. research/plan_variant.py is their command line (models/README.md lists the shipped plans'
steps). `first_use_recipe` is what a plan calibrated on first use gets (plan/auto_plan.py): the two steps that made
the shipped qwen2.5-coder-0.5b plan from its selector plan, so a model without a shipped plan is shaped the way the
one plan tuned on these models was (qwen2.5-coder-1.5b, whose own plan was tuned further, is the held-out check:
docs/sparse.md).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import replace

from fluxion_lite.plan.cost import scale_for_read
from fluxion_lite.plan.sparse_plan import GroupPlan, SparsePlan

# the shipped qwen2.5-coder-0.5b plan's steps (models/README.md), for a calibration at `context` tokens:
RECIPE_G = 16  # every retrieval group at one block size (also what the GPU's device step needs)
RECIPE_BUDGET_SCALE = 0.6 * 0.9  # the selector's budgets x0.6, then x0.9 with the long-only groups
RECIPE_PINS, RECIPE_PIN_SPAN = 0.75, 3  # three quarters of each budget pinned at prefill end, spans of 3 blocks
RECIPE_SHORT_SCALE = 1.7 / 0.9  # budgets back to ~x1 of the selector's up to twice the calibration context
RECIPE_STREAMING_BUDGET = 0.02  # streaming groups retrieve 2% (x0.9) from four times the calibration context on


def first_use_recipe(plan: SparsePlan, context: int) -> SparsePlan:
    """The selector's plan for a calibration at `context` tokens, shaped as the shipped 0.5b plan was: retrieval
    groups at g = 16 with three quarters of their budget pinned, budgets as selected up to ~2x the calibration
    context and x0.54 from ~4x on, where the streaming groups retrieve 1.8% (long-only)."""
    staged = request_recipe(plan, context, pin_fraction=RECIPE_PINS)
    return variant(staged, None, 0.9, streaming_budget=RECIPE_STREAMING_BUDGET, long_only=True,
                   short_scale=RECIPE_SHORT_SCALE)


def request_recipe(plan: SparsePlan, context: int, pin_fraction: float = 0.0) -> SparsePlan:
    """The recipe's first step (a request's own plan at its epsilon: engine.py): g = 16, budgets as selected up to
    ~2x the calibration context and x0.6 from ~4x on. A request's own plan reads no pins and keeps its groups'
    split (no long-only groups): pins and long-only ramps belong to the static plan of the whole batch."""
    short_tokens = 2 * context - 128  # the 0.5b's 8,064 for its 4,096-token calibration
    return variant(plan, RECIPE_G, 0.6, pin_fraction=pin_fraction, pin_span=RECIPE_PIN_SPAN, short_scale=1.7,
                   short_tokens=short_tokens)


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
