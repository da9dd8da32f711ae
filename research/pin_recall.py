"""Which pin rule covers the answers: RULER needles' pin recall under several (pin_fraction, pin_span, pin_decay).

Pins (fluxion_lite/plan/pins.py) are picked once, at a sequence's first decode step, from the attention mass of the
prompt's last queries. A rule that pins the answer's blocks in more retrieval groups gives the decode steps the
value without the per-step top-k having to find it among look-alikes; a rule that pins only one place per group
can hold one of a multi-value answer's values and not the others. This runs each chosen exported sample's prefill
once (CPU, the plan's engine path, two tokens), keeps every retrieval group's observed mass, and then scores rules
offline with the engine's own pick_pins: per answer value, the share of pinning groups whose pins hold the block
of the value's first token ("first") and all of its blocks ("whole"); per sample the mean over values and the
worst value (a multi-value answer needs all of them). The budget per group is the plan's at the sample's length,
so every rule reads the same bytes; only which blocks are pinned changes.

Reads the pins only: the per-step top-k fills the rest of each budget and can still find what the pins miss, so
this ranks rules for the RULER run that decides (bench/ruler_split.py answer --plan), it does not replace it.

  python research/pin_recall.py --gguf qwen2.5-coder-1.5b --plan models/qwen2.5-coder-1.5b.plan.json --length 4096 \
      --tasks niah_multivalue niah_multikey_3 --per-task 5 --out bench/results/pin_recall.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # the product benchmarks they build on
sys.path.insert(0, str(Path(__file__).resolve().parent))

from pin_trace import token_span  # noqa: E402
from ruler_split import load_ids, model_tag  # noqa: E402

from fluxion_lite.plan import pins as pinned  # noqa: E402
from fluxion_lite.engine.engine import Engine  # noqa: E402
from fluxion_lite.hub.resolve import resolve_model  # noqa: E402
from fluxion_lite.model.gguf_loader import read_metadata  # noqa: E402
from fluxion_lite.engine.sampling import SamplingParams  # noqa: E402
from fluxion_lite.plan.sparse_plan import SparsePlan  # noqa: E402
from fluxion_lite.model.tokenizer import Tokenizer  # noqa: E402

Rule = tuple[float, int, float]  # (pin_fraction, pin_span, pin_decay)


def observed_masses(engine: Engine, ids: list[int]) -> tuple[dict[int, np.ndarray], int]:
    """Prefill ids and take one decode step; returns per layer the observed mass [Hkv, n_prompt] that pick_pins
    saw, and the token count n of that first decode step."""
    seen: dict[int, np.ndarray] = {}
    steps: list[int] = []
    original = pinned.PinnedBlocks.pin_by_mass

    def recording(self: pinned.PinnedBlocks, layer: int, slot: int, mass: np.ndarray, n: int) -> None:
        seen[layer] = mass.copy()
        steps.append(n)
        original(self, layer, slot, mass, n)

    pinned.PinnedBlocks.pin_by_mass = recording  # type: ignore[method-assign]
    try:
        engine.add_request(ids, SamplingParams(temperature=0.0, max_tokens=2))
        while engine.has_unfinished():
            engine.step()
    finally:
        pinned.PinnedBlocks.pin_by_mass = original  # type: ignore[method-assign]
    if not steps:
        raise RuntimeError("no pins were picked: does the plan pin (pin_fraction > 0) and did a decode step run?")
    return seen, steps[0]


def recall(plan: SparsePlan, masses: dict[int, np.ndarray], n: int, spans: list[tuple[int, int]],
           rule: Rule) -> dict[str, float]:
    """Per answer span [lo, hi): the share of pinning groups whose pins (under rule) hold its first token's block
    and all its blocks; mean and worst over the spans. The rule's settings replace the plan's (spans in blocks)."""
    fraction, span, decay = rule
    plan = replace(plan, pin_fraction=fraction, pin_span=span, pin_decay=decay, pin_span_tokens=0)
    first_hit = np.zeros(len(spans))
    whole_hit = np.zeros(len(spans))
    groups = 0
    for layer, mass in masses.items():
        for h, gp in enumerate(plan.groups[layer]):
            pins = set(pinned.group_pins(plan, gp, mass[h], n).tolist())
            if not pins:  # a group that pins nothing under this rule
                continue
            groups += 1
            for i, (lo, hi) in enumerate(spans):
                first_hit[i] += lo // gp.g in pins
                whole_hit[i] += all(b in pins for b in range(lo // gp.g, (hi - 1) // gp.g + 1))
    if not groups:
        return {"groups": 0, "first": 0.0, "first_worst": 0.0, "whole": 0.0, "whole_worst": 0.0}
    first, whole = first_hit / groups, whole_hit / groups
    return {"groups": groups, "first": float(first.mean()), "first_worst": float(first.min()),
            "whole": float(whole.mean()), "whole_worst": float(whole.min())}


def rule_key(fraction: float, span: int, decay: float, consensus: float) -> str:
    """A rule's name in the table: fraction/span/decay, and /consensus share when it is not 0 (the engine's rule)."""
    return f"{fraction:g}/{span}/{decay:g}" + (f"/c{consensus:g}" if consensus else "")


def parse_rules(fractions: list[float], spans: list[int], decays: list[float]) -> list[Rule]:
    return [(f, s, d) for f, s, d in itertools.product(fractions, spans, decays) if s > 1 or d == decays[0]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", default="qwen2.5-coder-0.5b")
    ap.add_argument("--dir", default=".ruler_ids", help="exported samples (ruler_split.py export)")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--plan", required=True, help="plan file whose groups, budgets, sink and window are used")
    ap.add_argument("--tasks", nargs="+", required=True)
    ap.add_argument("--per-task", type=int, default=5)
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.5, 0.75])
    ap.add_argument("--spans", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--decays", type=float, nargs="+", default=[1.0, 0.7, 0.5, 0.3])
    ap.add_argument("--consensus", type=float, nargs="+", default=[0.0],
                    help="shares of each group's mass replaced by all groups' normalised mean "
                         "(pinned.consensus_masses, the plan field pin_consensus; 0 = own)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    tag = model_tag(args.gguf)
    meta_path, ids_path = Path(args.dir) / f"{tag}_{args.length}.json", Path(args.dir) / f"{tag}_{args.length}.ids.xz"
    if not meta_path.exists():
        sys.exit(f"error: {meta_path}: no exported samples (bench/ruler_split.py export)")
    meta, prompts = load_ids(meta_path, ids_path)
    picks = [k for k, s in enumerate(meta["samples"]) if s["task"] in args.tasks and s["index"] < args.per_task]
    if not picks:
        sys.exit(f"error: --tasks {args.tasks}: no exported samples of these tasks at {args.length}")
    plan = SparsePlan.load(Path(args.plan))
    if not plan.pin_fraction:
        sys.exit(f"error: {args.plan}: pin_fraction is 0; the observed mass is recorded where pins are picked")
    rules = parse_rules(args.fractions, args.spans, args.decays)
    path = resolve_model(args.gguf)
    tok = Tokenizer(path, read_metadata(path)[0])
    engine = Engine(args.gguf, attention="fluxion", device="cpu", dtype=args.dtype, max_batch=1,
                    max_context=args.length + 256, prefill_chunk=1024, prefix_cache_entries=0, load_tokenizer=False)
    engine.eog_ids = frozenset(meta["eog_ids"])
    engine.set_attention("fluxion", plan)
    samples: list[dict[str, Any]] = []
    for k in picks:
        s, ids = meta["samples"][k], prompts[k]
        spans = [sp for sp in (token_span(tok, ids, a) for a in s["answers"]) if sp is not None]
        if not spans:
            print(f"{s['task']}:{s['index']}: no answer found in the prompt (not a retrieval task?); skipped")
            continue
        t0 = time.perf_counter()
        masses, n = observed_masses(engine, ids)
        mixes = {c: pinned.consensus_masses(plan, masses, n, c) for c in args.consensus}
        row = {"task": s["task"], "index": s["index"], "values": len(spans), "n": n,
               "rules": {rule_key(f, sp, d, c): recall(plan, mixes[c], n, spans, (f, sp, d))
                         for f, sp, d in rules for c in args.consensus}}
        samples.append(row)
        print(f"{s['task']}:{s['index']} ({len(spans)} values, {time.perf_counter() - t0:.0f} s)", flush=True)
    table: dict[str, dict[str, dict[str, float]]] = {}
    print(f"\n{'task':<18}{'fraction/span/decay[/consensus]':<32}{'first':>7}{'worst':>7}{'whole':>7}{'worst':>7}")
    for task in args.tasks:
        rows = [r for r in samples if r["task"] == task]
        if not rows:
            continue
        for (f, sp, d), c in itertools.product(rules, args.consensus):
            key = rule_key(f, sp, d, c)
            mean = {m: float(np.mean([r["rules"][key][m] for r in rows]))
                    for m in ("first", "first_worst", "whole", "whole_worst")}
            table.setdefault(task, {})[key] = mean
            print(f"{task:<18}{key:<32}{mean['first']:>7.3f}{mean['first_worst']:>7.3f}{mean['whole']:>7.3f}"
                  f"{mean['whole_worst']:>7.3f}")
    Path(args.out).write_text(json.dumps({"gguf": args.gguf, "plan": args.plan, "length": args.length,
                                          "dtype": args.dtype, "table": table, "samples": samples}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
