"""How concentrated the prompt-end attention is, per RULER sample: could it tell when to pin a whole budget?

Pins (pinned.py) are chosen at a sequence's first decode step from the attention mass of the prompt's last queries.
On cwe, pinning all of each budget instead of three quarters gains 6.5 points but costs the multi-needle tasks ~30
(docs/history.md, "The 4K gap is one task, cwe"). A per-request switch would need a signal that sets cwe apart.
This prints, per sample, the mean over retrieval groups of:
  top      share of the eligible blocks' mass in the blocks the plan pins (pin_fraction of the budget)
  top_all  the same for the whole budget
  entropy  of the per-block mass, normalised by log(blocks)
  eligible share of the observed mass outside sink and window
Runs the CPU path (the pins are the same on every path), one prompt at a time, two tokens each.

Usage: python research/pin_signal.py --per-task 3 [--length 4096] [--out bench/results/pin_signal_4096_vm.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # the product benchmarks they build on
sys.path.insert(0, str(Path(__file__).resolve().parent))
from ruler_split import load_ids  # noqa: E402

from fluxion_lite.plan import pins as pinned  # noqa: E402
from fluxion_lite.engine.engine import Engine  # noqa: E402
from fluxion_lite.engine.sampling import SamplingParams  # noqa: E402


def group_signal(plan: Any, gp: Any, mass: np.ndarray, n: int) -> dict[str, float]:
    """One retrieval group's numbers from its observed mass [n_prompt] (the blocks pick_pins may choose)."""
    g = gp.g
    first, last = pinned.eligible_blocks(g, n, plan.sink, plan.window)
    blocks = mass[first * g : last * g].reshape(-1, g).sum(1)  # [eligible blocks]
    total = max(float(blocks.sum()), 1e-12)
    ranked = np.sort(blocks)[::-1]
    budget = plan.block_count(gp, n)
    share = blocks / total
    return {"top": float(ranked[: int(plan.pin_fraction * budget)].sum()) / total,
            "top_all": float(ranked[:budget].sum()) / total,
            "entropy": float(-(share * np.log(share + 1e-12)).sum() / np.log(max(len(blocks), 2))),
            "eligible": total / max(float(mass.sum()), 1e-12)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--dir", default=".ruler_ids")
    ap.add_argument("--per-task", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    meta, prompts = load_ids(Path(args.dir) / f"{args.model}_{args.length}.json",
                             Path(args.dir) / f"{args.model}_{args.length}.ids.xz")
    groups: list[dict[str, float]] = []
    original = pinned.PinnedBlocks.pin_by_mass

    def recording(self: pinned.PinnedBlocks, layer: int, slot: int, mass: np.ndarray, n: int) -> None:
        for h, gp in enumerate(self.plan.groups[layer]):
            if not gp.streaming:
                groups.append(group_signal(self.plan, gp, mass[h], n))
        original(self, layer, slot, mass, n)

    pinned.PinnedBlocks.pin_by_mass = recording  # type: ignore[method-assign]
    engine = Engine(args.model, attention="fluxion", device="cpu", dtype="bfloat16", max_batch=1,
                    max_context=args.length + 256, prefix_cache_entries=0, load_tokenizer=False)
    engine.eog_ids = frozenset(meta["eog_ids"])
    rows = []
    print(f"{'task':<17}{'#':>3}{'top':>7}{'top_all':>8}{'entropy':>8}{'eligible':>9}", flush=True)
    for k, s in enumerate(meta["samples"]):
        if s["index"] >= args.per_task:
            continue
        groups.clear()
        t0 = time.perf_counter()
        engine.add_request(prompts[k], SamplingParams(temperature=0.0, max_tokens=2))  # pins at the first decode
        while engine.has_unfinished():
            engine.step()
        row = {"task": s["task"], "index": s["index"], "groups": len(groups),
               **{key: float(np.mean([x[key] for x in groups])) for key in ("top", "top_all", "entropy", "eligible")}}
        rows.append(row)
        print(f"{row['task']:<17}{row['index']:>3}{row['top']:>7.3f}{row['top_all']:>8.3f}{row['entropy']:>8.3f}"
              f"{row['eligible']:>9.3f}   ({time.perf_counter() - t0:.0f} s)", flush=True)
    out = Path(args.out or f"bench/results/pin_signal_{args.length}.json")
    machine = f"{platform.node()} ({os.cpu_count()} CPUs, CPU bf16)"
    out.write_text(json.dumps({"model": args.model, "length": args.length, "plan": engine.attn.plan.source,
                               "machine": machine,
                               "command": "python " + " ".join(sys.argv), "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
