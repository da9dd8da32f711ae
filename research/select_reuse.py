"""How much of the per-step top-k that is not pinned repeats from one decode step to the next (issue 5).

The device path keeps each retrieval group's pinned blocks (pin_fraction of its budget) in GPU memory; the rest of
the selection, D_t = blocks read at step t minus the pinned blocks, is read over PCIe every step. A device-side cache
of the blocks of the last w steps would serve the part of D_t that was also chosen at one of those steps. This runs
the CPU path on real prompts (greedy), records per decode step and per (layer, KV group) the blocks read and the pins
(research/pin_trace.py's Recorder), and reports per (layer, group) with a retrieval budget and step t >= w:

  reuse_w  = |D_t ∩ (D_{t-1} ∪ ... ∪ D_{t-w})| / |D_t|   (w = 1, 2, 4: the hit rate of a cache of w steps;
                                                          w = all: every earlier step, an unbounded cache)
  cache_w  = |D_{t-1} ∪ ... ∪ D_{t-w}| / |D_t|            (the cache's size in units of one step's reads)

mean and p10 over (group, step) pairs, and the block-weighted mean (sum of hits / sum of |D_t|: the share of PCIe
blocks a cache would remove), per task and overall; plus mean |D_t|, mean pin count, and whether |D_t| stays
constant per (layer, group) across a sequence's steps. Also the hit rate of the device path's reuse cache itself
(fluxion_lite/sparse/device/reuse_cache.py's PolicyModel: the kernel's policy in plain Python) when each (layer, group) gets
C = share x the layer's widest read (its top-k width) entries, for shares POLICY_SHARES (0.5 is REUSE_SHARE).

  python research/select_reuse.py --length 4096 --samples niah_multikey_2:0 vt:0 --out-dir bench/results
  python research/select_reuse.py --length 8192 --samples qa_1:0 --essay .ruler_ids/fidelity_essay_32768.json \
      --essay-steps 96
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # the product benchmarks they build on
sys.path.insert(0, str(Path(__file__).resolve().parent))

from pin_trace import Recorder  # noqa: E402
from ruler_split import load_ids, model_tag  # noqa: E402

from fluxion_lite.engine.engine import Engine  # noqa: E402
from fluxion_lite.sparse.device.reuse_cache import PolicyModel  # noqa: E402
from fluxion_lite.engine.sampling import SamplingParams  # noqa: E402
from fluxion_lite.plan.sparse_plan import SparsePlan  # noqa: E402

WINDOWS = (1, 2, 4, 0)  # steps a cache keeps; 0: every earlier step of the sequence (an unbounded cache)
POLICY_SHARES = (0.5, 1.0)  # reuse-cache entries per (layer, group) as a share of the layer's top-k width


def wname(w: int) -> str:
    return "all" if w == 0 else str(w)


def decode(engine: Engine, rec: Recorder, ids: list[int], max_tokens: int, ignore_eos: bool) -> int:
    """One greedy request; returns the tokens generated (the recorder holds its pins and per-step reads)."""
    rec.clear()
    engine.add_request(ids, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos))
    out = 0
    while engine.has_unfinished():
        for o in engine.step():
            out += len(o.new_token_ids)
    return out


def reuse_rows(rec: Recorder, plan: SparsePlan) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Per (layer, group, step t >= 1) the non-pinned reads' reuse against the previous 1, 2, 4 steps; and per
    sequence checks: how many (layer, group) keep |D_t| and |read_t| constant, pins missing from the reads."""
    rows: list[dict[str, Any]] = []
    keys = sorted({key for step in rec.steps for key in step})
    width: dict[int, int] = defaultdict(int)  # per layer: the widest read of any group (the device top-k width)
    for step in rec.steps:
        for (layer, _), blocks in step.items():
            width[layer] = max(width[layer], len(blocks))
    constant_d = constant_read = missing_pins = 0
    d_ranges: list[int] = []
    for layer, h in keys:
        pins = rec.pins.get(layer, [])
        pin = pins[h] if h < len(pins) else set()
        reads = [step.get((layer, h)) for step in rec.steps]
        if any(r is None for r in reads):  # a group missing from some step: not a per-step series
            continue
        missing_pins += sum(len(pin - r) for r in reads)
        d = [r - pin for r in reads]
        sizes = [len(x) for x in d]
        constant_d += len(set(sizes)) == 1
        constant_read += len({len(r) for r in reads}) == 1
        d_ranges.append(max(sizes) - min(sizes))
        policies = {share: PolicyModel(max(1, int(np.ceil(share * width[layer])))) for share in POLICY_SHARES}
        policy_hits = {share: [len(m.step(sorted(r), d_t)[1]) for r, d_t in zip(reads, d)]
                       for share, m in policies.items()}  # from the first step on, as the device cache runs
        for t in range(1, len(d)):
            if not d[t]:
                continue
            row: dict[str, Any] = {"layer": layer, "group": h, "budget": plan.groups[layer][h].budget, "t": t,
                                   "d": len(d[t]), "pinned": len(pin)}
            for w in WINDOWS:
                span = w or t
                if t < span:
                    continue
                cache = set().union(*d[t - span : t])
                row[f"hit{wname(w)}"] = len(d[t] & cache)
                row[f"cache{wname(w)}"] = len(cache)
            for share in POLICY_SHARES:
                row[f"policy{share:g}"] = policy_hits[share][t]
            rows.append(row)
    checks = {"groups": len(keys), "constant_d": constant_d, "constant_read": constant_read,
              "max_d_range": max(d_ranges, default=0), "pins_not_read": missing_pins}
    return rows, checks


def summarise(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """mean / p10 of reuse_w, block-weighted reuse_w, mean cache_w, mean |D_t| and pins over (group, step) rows."""
    out: dict[str, Any] = {"pairs": len(rows)}
    if not rows:
        return out
    out["mean_d"] = float(np.mean([r["d"] for r in rows]))
    out["mean_pinned"] = float(np.mean([r["pinned"] for r in rows]))
    for w in map(wname, WINDOWS):
        sub = [r for r in rows if f"hit{w}" in r]
        if not sub:
            continue
        ratio = np.array([r[f"hit{w}"] / r["d"] for r in sub])
        out[f"reuse{w}_mean"] = float(ratio.mean())
        out[f"reuse{w}_p10"] = float(np.percentile(ratio, 10))
        out[f"reuse{w}_weighted"] = float(sum(r[f"hit{w}"] for r in sub) / sum(r["d"] for r in sub))
        out[f"cache{w}_mean"] = float(np.mean([r[f"cache{w}"] / r["d"] for r in sub]))
    for share in POLICY_SHARES:
        key = f"policy{share:g}"
        sub = [r for r in rows if key in r]
        if sub:
            out[f"{key}_weighted"] = float(sum(r[key] for r in sub) / sum(r["d"] for r in sub))
    return out


def print_table(title: str, summaries: dict[str, dict[str, Any]]) -> None:
    print(f"\n{title}")
    head = f"{'':<18}{'pairs':>7}{'|D_t|':>7}{'pins':>6}"
    head += "".join(f"{f'r{w} mean':>10}{f'r{w} p10':>9}{f'r{w} wtd':>9}" for w in map(wname, WINDOWS))
    head += "".join(f"{f'cache{w}':>9}" for w in map(wname, WINDOWS))
    print(head)
    for name, s in summaries.items():
        if not s.get("pairs"):
            print(f"{name:<18}{0:>7}")
            continue
        line = f"{name:<18}{s['pairs']:>7}{s['mean_d']:>7.2f}{s['mean_pinned']:>6.1f}"
        for w in map(wname, WINDOWS):
            line += (f"{s[f'reuse{w}_mean']:>10.3f}{s[f'reuse{w}_p10']:>9.3f}{s[f'reuse{w}_weighted']:>9.3f}"
                     if f"reuse{w}_mean" in s else f"{'-':>10}{'-':>9}{'-':>9}")
        line += "".join(f"{s[f'cache{w}_mean']:>9.2f}" if f"cache{w}_mean" in s else f"{'-':>9}"
                        for w in map(wname, WINDOWS))
        print(line)


def show(result: dict[str, Any]) -> None:
    """Both tables of a result (per task and overall; overall per plan budget)."""
    print_table(f"non-pinned top-k reuse, length {result['length']} (rW: |D_t ∩ last W steps' D| / |D_t|, mean, p10, "
                f"block-weighted; cacheW: |union of last W steps' D| / |D_t|)",
                result["by_task"] | {"overall": result["overall"]})
    print_table("overall by plan budget", result["overall_by_budget"])
    print("\nreuse cache policy (PolicyModel), block-weighted hit rate with C = share x the layer's top-k width:")
    for name, s in (result["by_task"] | {"overall": result["overall"]}).items():
        print(f"{name:<18}" + "".join(f"  share {share:g}: {s[f'policy{share:g}_weighted']:.3f}" for share in
                                      POLICY_SHARES if f"policy{share:g}_weighted" in s))
    for r in result["records"]:
        c = r["checks"]
        print(f"{r['task']}:{r['index']}: {r['prompt_tokens']} prompt tokens, {r['steps_recorded']} decode steps; "
              f"|D_t| constant in {c['constant_d']}/{c['groups']} groups (largest change {c['max_d_range']}), "
              f"pins not read {c['pins_not_read']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", default="qwen2.5-coder-0.5b")
    ap.add_argument("--plan", default="models/qwen2.5-coder-0.5b.plan.json", help="a plan with pin_fraction > 0")
    ap.add_argument("--dir", default="/work/main/.ruler_ids", help="exported samples (ruler_split.py export)")
    ap.add_argument("--length", type=int, default=8192, help="exported RULER length (file <model>_<length>.json)")
    ap.add_argument("--samples", nargs="*", default=[], help="task:index, e.g. niah_multikey_2:0")
    ap.add_argument("--essay", default=None, help="JSON list of token ids: its first --length - --essay-steps tokens "
                                                  "are continued for --essay-steps greedy steps (EOS ignored)")
    ap.add_argument("--essay-steps", type=int, default=96)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out-dir", default="bench/results")
    ap.add_argument("--show", default=None, help="only print the tables of this result file")
    args = ap.parse_args()
    if args.show:
        try:
            show(json.loads(Path(args.show).read_text()))
        except (OSError, ValueError, KeyError) as e:
            sys.exit(f"error: --show {args.show}: not a select_reuse result ({e})")
        return

    plan = SparsePlan.load(Path(args.plan))
    if not plan.pin_fraction:
        sys.exit(f"error: {args.plan}: pin_fraction is 0, nothing is pinned")
    cases: list[tuple[str, int, list[int], int, bool]] = []  # task, index, prompt ids, max tokens, ignore EOS
    eog: frozenset[int] = frozenset()
    if args.samples:
        tag = model_tag(args.gguf)
        meta_path = Path(args.dir) / f"{tag}_{args.length}.json"
        if not meta_path.exists():
            sys.exit(f"error: --length {args.length}: no exported samples {meta_path}")
        meta, prompts = load_ids(meta_path, meta_path.with_suffix(".ids.xz"))
        eog = frozenset(meta["eog_ids"])
        where = {(s["task"], s["index"]): k for k, s in enumerate(meta["samples"])}
        for item in args.samples:
            task, _, index = item.partition(":")
            if not index.isdigit() or (task, int(index)) not in where:
                sys.exit(f"error: --samples {item!r}: no such exported sample at {args.length}")
            k = where[(task, int(index))]
            cases.append((task, int(index), prompts[k], meta["samples"][k]["max_new_tokens"], False))
    if args.essay:
        essay = json.loads(Path(args.essay).read_text())
        if not isinstance(essay, list) or not all(isinstance(t, int) for t in essay):
            sys.exit(f"error: --essay {args.essay}: expected a JSON list of token ids")
        n_prompt = args.length - args.essay_steps
        if not 0 < n_prompt <= len(essay):
            sys.exit(f"error: --essay {args.essay}: {len(essay)} tokens, --length - --essay-steps = {n_prompt} wanted")
        cases.append(("essay", 0, essay[:n_prompt], args.essay_steps, True))
    if not cases:
        sys.exit("error: nothing to run: give --samples and/or --essay")

    max_context = max(len(ids) + steps for _, _, ids, steps, _ in cases)
    engine = Engine(args.gguf, attention="full", device="cpu", dtype=args.dtype, max_batch=1, max_context=max_context,
                    prefill_chunk=1024, prefix_cache_entries=0, load_tokenizer=False)
    engine.eog_ids = eog
    engine.set_attention("fluxion", plan)
    rec = Recorder()
    by_task: dict[str, list[dict[str, Any]]] = defaultdict(list)
    records: list[dict[str, Any]] = []
    out = Path(args.out_dir) / f"select_reuse_{args.length}_vm.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    for task, index, ids, max_tokens, ignore_eos in cases:
        t0 = time.perf_counter()
        generated = decode(engine, rec, ids, max_tokens, ignore_eos)
        rows, checks = reuse_rows(rec, plan)
        by_task[task] += rows
        s = summarise(rows)
        records.append({"task": task, "index": index, "prompt_tokens": len(ids), "generated": generated,
                        "steps_recorded": len(rec.steps), "seconds": time.perf_counter() - t0, "checks": checks,
                        "summary": s, "by_budget": {str(b): summarise([r for r in rows if r["budget"] == b])
                                                    for b in sorted({r["budget"] for r in rows})}})
        print(f"{task}:{index} {len(ids)} tokens, {generated} generated, {len(rec.steps)} steps recorded, "
              f"{time.perf_counter() - t0:.0f} s; {checks['constant_d']}/{checks['groups']} groups constant |D_t| "
              f"(max range {checks['max_d_range']}), pins not read {checks['pins_not_read']}; "
              f"reuse_1 mean {s.get('reuse1_mean', float('nan')):.3f}", flush=True)
        result = {"model": args.gguf, "plan": args.plan, "length": args.length, "dtype": args.dtype,
                  "machine": "VM (CPU path)", "windows": [wname(w) for w in WINDOWS], "records": records,
                  "by_task": {t: summarise(r) for t, r in by_task.items()},
                  "overall": summarise([r for rs in by_task.values() for r in rs]),
                  "overall_by_budget": {str(b): summarise([r for rs in by_task.values() for r in rs
                                                           if r["budget"] == b])
                                        for b in sorted({r["budget"] for rs in by_task.values() for r in rs})}}
        out.write_text(json.dumps(result, indent=1))  # after every sample: a cut-short run keeps what finished
    show(result)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
