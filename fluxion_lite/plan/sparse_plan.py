"""Which KV groups attend sparsely, and how: the per-(layer, KV group) plan the sparse backend executes."""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import numpy as np

from fluxion_lite.errors import ModelFileError
from fluxion_lite.settings import Settings
from fluxion_lite.plan.cost import plan_bytes_fraction
from fluxion_lite.plan.space import GRANULARITIES

BACKGROUNDS = ("off", "retrieval", "all")  # SparsePlan.background
MAX_PIN_SPAN = 8  # a span of pinned blocks longer than this would be a dense region, not a needle's value
MAX_PIN_SPAN_TOKENS = MAX_PIN_SPAN * min(GRANULARITIES)  # pin_span_tokens: at most MAX_PIN_SPAN blocks at any g
DEFAULT_SHORT_TOKENS = 8192


def short_factor(n: np.ndarray | int, scale: float, tokens: int) -> np.ndarray:
    """The short-context multiplier of every retrieval budget at context n (tokens, any shape): `scale` up to
    `tokens`, 1 from 2 x `tokens` on, linear in log2(n) in between. A needle's answer takes about as many tokens at
    4K as at 32K, so a fixed fraction of a short context leaves it fewer blocks than a long one does."""
    n_f = np.maximum(np.asarray(n, dtype=np.float64), 1.0)
    toward_long = np.clip(np.log2(n_f / tokens), 0.0, 1.0)  # 0 at n <= tokens, 1 at n >= 2 tokens
    return 1.0 + (scale - 1.0) * (1.0 - toward_long)


def long_factor(n: np.ndarray | int, tokens: int) -> np.ndarray:
    """The multiplier of a long-only group's budget at context n (any shape): 0 up to `tokens`, 1 from 2 x `tokens`
    on, linear in log2(n) in between (short_factor's ramp, rising instead of falling)."""
    n_f = np.maximum(np.asarray(n, dtype=np.float64), 1.0)
    return np.clip(np.log2(n_f / tokens), 0.0, 1.0)


def curve_factor(n: np.ndarray | int, curve: tuple[tuple[int, float], ...]) -> np.ndarray:
    """A budget curve's multiplier at context n (any shape): each knot's scale at its tokens, linear in log2(n)
    between knots, the first knot's scale below it and the last one's above it. Reads scale with the context
    (sink and window fall from ~2% of it at 4K to 0.25% at 32K), so a read limit per length needs a factor per
    length; short_factor is the two-knot curve ((tokens, scale), (2 x tokens, 1))."""
    n_f = np.maximum(np.asarray(n, dtype=np.float64), 1.0)
    xs = np.log2(np.array([t for t, _ in curve], np.float64))
    return np.interp(np.log2(n_f), xs, np.array([s for _, s in curve], np.float64))


def check_curve(curve: object) -> None:
    """ValueError naming budget_curve unless it is a non-empty sequence of [tokens, scale] knots, tokens integers
    > 0 rising strictly, scales finite numbers > 0."""
    if not isinstance(curve, (list, tuple)) or not curve:
        raise ValueError(f"budget_curve must be a non-empty list of [tokens, scale] knots (got {curve!r})")
    last = 0
    for knot in curve:
        ok = isinstance(knot, (list, tuple)) and len(knot) == 2 and type(knot[0]) is int and knot[0] > last
        scale = knot[1] if ok else None
        if not ok or isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) \
                or scale <= 0:
            raise ValueError(f"budget_curve knots must be [tokens, scale] with integer tokens > 0 rising strictly and "
                             f"a finite scale > 0 (got {knot!r})")
        last = knot[0]


def check_short(short_scale: object, short_tokens: object) -> None:
    """ValueError naming the field unless short_scale is a finite number >= 1 and short_tokens an integer > 0."""
    if isinstance(short_scale, bool) or not isinstance(short_scale, (int, float)) or not math.isfinite(short_scale) \
            or short_scale < 1.0:
        raise ValueError(f"short_scale must be a finite number >= 1 (got {short_scale!r})")
    if type(short_tokens) is not int or short_tokens <= 0:
        raise ValueError(f"short_tokens must be an integer > 0 (got {short_tokens!r})")


@dataclass(frozen=True)
class GroupPlan:
    streaming: bool  # True: sink + recent window only
    g: int = 16  # block size for top-k selection (retrieval groups)
    budget: float = 0.0  # fraction of the context selected by top-k, on top of sink + window
    # a retrieval group that attends like a streaming one (sink + window only) up to the plan's short_tokens and
    # retrieves its budget from twice that on (x long_factor in between): calibrated at 4K, where sink + window is 2%
    # of the context, a group looks streaming that at 32K (0.25%) still needs a few far blocks
    long_only: bool = False


@dataclass
class SparsePlan:
    sink: int  # first tokens always attended
    window: int  # most recent tokens always attended
    groups: list[list[GroupPlan]]  # [layer][kv_group]
    source: str = ""  # how the plan was made (for --explain and logs)
    # share of each retrieval group's block budget pinned at the end of prefill by the attention of the prompt's last
    # obs_window tokens (pinned.py); 0 = every block chosen by the per-step top-k
    pin_fraction: float = 0.0
    obs_window: int = 32
    scoring: str = "group"  # block scoring of the top-k: "group", "per-head" or "midrange" (native.SCORINGS)
    # pins come in spans: a block also scores by its pin_span - 1 predecessors' mass, x pin_decay per block back, so
    # a heavy block's successors (the value after a needle's key) are pinned too, within the same pin count;
    # pin_span 1 = the heaviest blocks alone (pinned.pick_pins)
    pin_span: int = 1
    pin_decay: float = 1.0
    # short contexts get more blocks: every retrieval budget x short_factor(n, short_scale, short_tokens), i.e.
    # x short_scale up to short_tokens, x 1 from twice that on (1 = off); long-only groups stream up to short_tokens
    short_scale: float = 1.0
    short_tokens: int = DEFAULT_SHORT_TOKENS
    # pin spans in tokens instead (0 = off, pin_span holds): a group of block size g pins ceil(pin_span_tokens / g)
    # blocks per span, so a needle's value is covered as far at g = 16 as at g = 128 (span_for)
    pin_span_tokens: int = 0
    # long-only groups stream through the exact sink and window up to short_tokens, as streaming groups do, instead
    # of their g's block-aligned ones (~80 more tokens at g = 64: read the plan did not ask for; False keeps the
    # decode steps of plans measured before the option)
    long_exact_stream: bool = False
    # share of the pins spread evenly over the context instead of picked by mass (pinned.pick_pins; 0 = none)
    pin_stride: float = 0.0
    # groups with fewer blocks than this pin none (every block chosen per step): one pinned block of two fixes a
    # small group on one place, where a multi-value answer needs each value read when it is due (0 = all groups pin)
    pin_min_blocks: int = 0
    # a budget multiplier per context length instead of short_scale: knots (tokens, scale), linear in log2 of the
    # context between them, flat outside (curve_factor); () = off. Lets each length read up to its own limit
    # (e.g. 10% at 8K, 5% at 32K), where one short scale spends less at 8K than at 4K. short_tokens still sets
    # the long-only groups' ramp.
    budget_curve: tuple[tuple[int, float], ...] = ()
    # share of each group's pin mass replaced by the mean of all retrieval groups' (normalised) masses, so a needle
    # that some groups' prompt-end attention found is pinned by the others too (pinned.consensus_masses; 0 = own)
    pin_consensus: float = 0.0
    # the unread-background term (native.background): "off"; "retrieval": each retrieval group's unread tokens
    # between sink and window become one softmax term per 128-token block (mass from the 16-token blocks' midrange
    # keys, value the block's mean value), so the softmax no longer renormalises over the read tokens alone;
    # "all": streaming groups too. Costs the host store 0.78% more bytes (fp32 value sums per 128 tokens) and,
    # per step, a scan of the 16-token summaries (docs/sparse.md).
    background: str = "off"

    def __post_init__(self) -> None:
        self._check_scales()
        self.budget_curve = tuple((int(t), float(s)) for t, s in self.budget_curve)

    def _check_scales(self) -> None:
        check_short(self.short_scale, self.short_tokens)
        if self.budget_curve:
            check_curve(self.budget_curve)
            if self.short_scale != 1.0:
                raise ValueError("give budget_curve or short_scale, not both (the curve replaces the short scale)")

    @property
    def scales_budgets(self) -> bool:
        """Whether retrieval budgets carry a context-dependent factor (budget_factor is not 1 everywhere)."""
        return self.short_scale != 1.0 or bool(self.budget_curve)

    def budget_factor(self, n: np.ndarray | int) -> np.ndarray:
        """What every retrieval budget is multiplied by at context n (tokens incl. the new one; any shape)."""
        if self.budget_curve:
            return curve_factor(n, self.budget_curve)
        return short_factor(n, self.short_scale, self.short_tokens)

    def max_budget_factor(self, lo: int, hi: int) -> float:
        """The largest budget_factor over contexts lo..hi: at an end or at a knot between (the factor is monotone
        between knots), an upper bound of every step's k in that range (device_graph sizes its buffers by it)."""
        points = [lo, hi] + [t for t, _ in self.budget_curve if lo < t < hi]
        return float(np.max(self.budget_factor(np.array(points))))

    def long_factor(self, n: np.ndarray | int) -> np.ndarray:
        """What a long-only group's budget is multiplied by at context n (0 up to short_tokens: streaming there)."""
        return long_factor(n, self.short_tokens)

    def span_for(self, g: int) -> int:
        """Blocks per pin span for a group of block size g (pinned.pick_pins)."""
        return -(-self.pin_span_tokens // g) if self.pin_span_tokens else self.pin_span

    @property
    def has_long_only(self) -> bool:
        return any(gp.long_only for row in self.groups for gp in row)

    @property
    def exact_long_rows(self) -> bool:
        """Whether a step's mask carries the extra rows of long-only groups streaming exactly (sparse_step.bias_rows):
        the plan asks for exact streaming and has long-only groups to use it."""
        return self.long_exact_stream and self.has_long_only

    def block_count(self, gp: GroupPlan, n: int) -> int:
        """Top-k blocks of a retrieval group at context n: ceil(budget x n x budget_factor(n) / g) (long_factor(n)
        for a long-only group), in the order sparse_step.retrieval_tasks computes it per step, so both round alike
        (0 for a streaming group, and for a long-only one up to short_tokens)."""
        if gp.streaming:
            return 0
        tokens = gp.budget * n
        if gp.long_only:
            tokens *= float(self.long_factor(n))
        elif self.scales_budgets:
            tokens *= float(self.budget_factor(n))
        return int(np.ceil(tokens / gp.g))

    @classmethod
    def uniform(cls, n_layers: int, n_groups: int, g: int, budget: float, sink: int, window: int) -> "SparsePlan":
        groups = [[GroupPlan(False, g, budget) for _ in range(n_groups)] for _ in range(n_layers)]
        return cls(sink, window, groups, source=f"uniform g={g} budget={budget}")

    def validate(self, n_layers: int, n_groups: int) -> None:
        if len(self.groups) != n_layers or any(len(row) != n_groups for row in self.groups):
            raise ModelFileError(f"sparse plan has shape {len(self.groups)}x? but the model has {n_layers}x{n_groups}")
        for row in self.groups:
            for gp in row:
                if not gp.streaming and (gp.g not in GRANULARITIES or not 0.0 < gp.budget <= 1.0):
                    raise ModelFileError(f"sparse plan: bad group entry {gp}")
                if gp.streaming and gp.long_only:
                    raise ModelFileError(f"sparse plan: a streaming group cannot be long_only ({gp})")
        if self.background not in BACKGROUNDS:
            raise ModelFileError(f"sparse plan: background must be one of {', '.join(BACKGROUNDS)} "
                                 f"(got {self.background!r})")
        if self.scoring not in ("group", "per-head", "midrange"):
            raise ModelFileError(f"sparse plan: scoring must be 'group', 'per-head' or 'midrange' (got {self.scoring!r})")
        if not 0.0 <= self.pin_fraction <= 1.0 or self.obs_window < 1:
            raise ModelFileError(f"sparse plan: pin_fraction must be in [0, 1] and obs_window >= 1 "
                                 f"(got {self.pin_fraction}, {self.obs_window})")
        if not 1 <= self.pin_span <= MAX_PIN_SPAN:
            raise ModelFileError(f"sparse plan: pin_span must be in [1, {MAX_PIN_SPAN}] (got {self.pin_span})")
        if not 0 <= self.pin_span_tokens <= MAX_PIN_SPAN_TOKENS:
            raise ModelFileError(f"sparse plan: pin_span_tokens must be in [0, {MAX_PIN_SPAN_TOKENS}] "
                                 f"(got {self.pin_span_tokens})")
        if not 0.0 < self.pin_decay <= 1.0:
            raise ModelFileError(f"sparse plan: pin_decay must be in (0, 1] (got {self.pin_decay})")
        if not 0.0 <= self.pin_stride <= 1.0:
            raise ModelFileError(f"sparse plan: pin_stride must be in [0, 1] (got {self.pin_stride})")
        if not 0.0 <= self.pin_consensus <= 1.0:
            raise ModelFileError(f"sparse plan: pin_consensus must be in [0, 1] (got {self.pin_consensus})")
        if type(self.pin_min_blocks) is not int or self.pin_min_blocks < 0:  # True or 2.5 are no block counts
            raise ModelFileError(f"sparse plan: pin_min_blocks must be an integer >= 0 (got {self.pin_min_blocks!r})")
        try:
            self._check_scales()
        except ValueError as exc:
            raise ModelFileError(f"sparse plan: {exc}") from exc

    def save(self, path: Path) -> None:
        data = {"sink": self.sink, "window": self.window, "source": self.source,
                "groups": [[_group_dict(gp) for gp in row] for row in self.groups]}
        if self.pin_fraction:
            data |= {"pin_fraction": self.pin_fraction, "obs_window": self.obs_window}
        if self.scoring != "group":
            data["scoring"] = self.scoring
        if self.pin_span != 1:
            data["pin_span"] = self.pin_span
        if self.pin_span_tokens:
            data["pin_span_tokens"] = self.pin_span_tokens
        if self.pin_decay != 1.0:
            data["pin_decay"] = self.pin_decay
        if self.long_exact_stream:
            data["long_exact_stream"] = True
        if self.pin_stride:
            data["pin_stride"] = self.pin_stride
        if self.pin_min_blocks:
            data["pin_min_blocks"] = self.pin_min_blocks
        if self.short_scale != 1.0 or self.has_long_only:  # long-only groups ramp up at short_tokens too
            data |= {"short_scale": self.short_scale, "short_tokens": self.short_tokens}
        if self.budget_curve:
            data["budget_curve"] = [[t, s] for t, s in self.budget_curve]
        if self.pin_consensus:
            data["pin_consensus"] = self.pin_consensus
        if self.background != "off":
            data["background"] = self.background
        path.write_text(json.dumps(data, indent=1))

    @classmethod
    def load(cls, path: Path) -> "SparsePlan":
        path = Path(path)  # a str path too: its name is the source of a plan file without one
        try:
            data = json.loads(path.read_text())
            unknown = sorted(set(data) - _PLAN_FIELDS)  # a field this version does not know would be ignored silently
            if unknown:
                raise ValueError(f"unknown field(s) {', '.join(unknown)}")
            groups = [[_group_from(gp) for gp in row] for row in data["groups"]]
            pin_span, span_tokens = data.get("pin_span", 1), data.get("pin_span_tokens", 0)
            min_blocks = data.get("pin_min_blocks", 0)
            for name, value in (("pin_span", pin_span), ("pin_span_tokens", span_tokens),
                                ("pin_min_blocks", min_blocks)):
                if type(value) is not int:  # 2.5 or "2" would otherwise be truncated or parsed silently
                    raise ValueError(f"{name} must be an integer (got {value!r})")
            long_exact = data.get("long_exact_stream", False)
            if type(long_exact) is not bool:  # "false" would be true
                raise ValueError(f"long_exact_stream must be true or false (got {long_exact!r})")
            # checked as stored (check_short in __post_init__): 8192.5 tokens or "2" must not be coerced silently
            short_scale, short_tokens = data.get("short_scale", 1.0), data.get("short_tokens", DEFAULT_SHORT_TOKENS)
            return cls(int(data["sink"]), int(data["window"]), groups, str(data.get("source", path.name)),
                       float(data.get("pin_fraction", 0.0)), int(data.get("obs_window", 32)),
                       str(data.get("scoring", "group")), pin_span,
                       float(data.get("pin_decay", 1.0)), short_scale, short_tokens, span_tokens, long_exact,
                       float(data.get("pin_stride", 0.0)), min_blocks, data.get("budget_curve", ()),
                       float(data.get("pin_consensus", 0.0)), background=str(data.get("background", "off")))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ModelFileError(f"{path}: unreadable sparse plan ({exc})") from exc

    def explain(self) -> str:
        lines = [f"sparse plan ({self.source}): sink {self.sink}, window {self.window}"]
        if self.scoring != "group":
            lines.append(f"  blocks scored per query head ({self.scoring})")
        if self.background != "off":
            lines.append("  unread tokens as one softmax term per 128-token block (midrange mass, mean value) in "
                         + ("retrieval groups" if self.background == "retrieval" else "every group"))
        if self.pin_fraction:
            lines.append(f"  {self.pin_fraction:.0%} of each retrieval budget pinned at prefill end "
                         f"(attention of the last {self.obs_window} prompt tokens"
                         + (f", spans of {self.pin_span_tokens} tokens, successors x{self.pin_decay:g})"
                            if self.pin_span_tokens else
                            f", spans of {self.pin_span} blocks, successors x{self.pin_decay:g})"
                            if self.pin_span != 1 else ")"))
            if self.pin_stride:
                lines.append(f"  {self.pin_stride:.0%} of the pins spread evenly over the context (not by mass)")
            if self.pin_min_blocks:
                lines.append(f"  groups with fewer than {self.pin_min_blocks} blocks pin none")
            if self.pin_consensus:
                lines.append(f"  {self.pin_consensus:.0%} of each group's pin mass from all groups' mean (consensus)")
        if self.short_scale != 1.0:
            lines.append(f"  short contexts: budgets x{self.short_scale:g} up to {self.short_tokens} tokens, x1 from "
                         f"{2 * self.short_tokens} on (linear in log2 of the context between)")
        if self.budget_curve:
            lines.append("  budgets by context: " + ", ".join(f"x{s:.3g} at {t}" for t, s in self.budget_curve)
                         + " (linear in log2 of the context between, flat outside)")
        if self.has_long_only:
            how = "exact" if self.long_exact_stream else "block-aligned"
            lines.append(f"  long-only groups (marked *): streaming up to {self.short_tokens} tokens "
                         f"({how} sink and window), their budget from {2 * self.short_tokens} on "
                         f"(linear in log2 of the context between)")
        lengths = (4096, 8192, 16384, 32768)
        reads = [plan_bytes_fraction(self, n, head_dim=64) for n in lengths]  # both fractions are head_dim-free
        lines.append("  predicted per decode step at " + " / ".join(f"{n // 1024}K" for n in lengths)
                     + ": KV read (sink and window included) " + " / ".join(f"{kv:.1%}" for kv, _ in reads)
                     + ", with the block summaries " + " / ".join(f"{t:.1%}" for _, t in reads))
        for i, row in enumerate(self.groups):
            ret = [gp for gp in row if not gp.streaming]
            desc = ", ".join(f"g={gp.g} b={gp.budget:.3f}" + ("*" if gp.long_only else "") for gp in ret) or "-"
            lines.append(f"  layer {i:>2}: {len(row) - len(ret)} streaming, {len(ret)} retrieval [{desc}]")
        return "\n".join(lines)

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The plan as [L, Hkv] arrays: retrieval flag, block size (1 for a streaming group), budget, long-only."""
        gs = self.groups
        return (np.array([[not gp.streaming for gp in row] for row in gs]),
                np.array([[1 if gp.streaming else gp.g for gp in row] for row in gs], np.int64),
                np.array([[gp.budget for gp in row] for row in gs], np.float64),
                np.array([[gp.long_only for gp in row] for row in gs]))

    @property
    def streaming_fraction(self) -> float:
        flat = [gp for row in self.groups for gp in row]
        return sum(gp.streaming for gp in flat) / max(1, len(flat))


def with_background_override(plan: SparsePlan, settings: Settings | None = None) -> SparsePlan:
    """The plan with the setting FLUXION_BACKGROUND (settings.background: off / retrieval / all; None: Settings.load())
    in place of its own `background`, if set. One place for the override: the backend executes it and
    engine.fluxion_selection chooses by it."""
    background = (settings if settings is not None else Settings.load()).background
    if not background:
        return plan
    return replace(plan, background=background)


def _group_dict(gp: GroupPlan) -> dict[str, object]:
    """A group's JSON entry; long_only only where set, so plans without long-only groups keep their old form."""
    d = asdict(gp)
    if not gp.long_only:
        del d["long_only"]
    return d


_PLAN_FIELDS = frozenset(f.name for f in fields(SparsePlan))  # what a plan file may hold: the plan's own fields


def _group_from(d: dict[str, object]) -> GroupPlan:
    long_only = d.get("long_only", False)
    if type(long_only) is not bool:  # "false" or 0 must not be read as a flag silently
        raise ValueError(f"long_only must be true or false (got {long_only!r})")
    return GroupPlan(**d)  # type: ignore[arg-type]
