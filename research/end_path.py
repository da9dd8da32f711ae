"""Where a sparse run's own answer ends: would full attention end there too, and where did it leave full's path?

research/margin_flips.py follows full's answer and asks where the sparse model would leave it. Sparse answers that end
sooner than full's (cwe, multivalue: docs/history.md, "Sparse answers lean toward ending") end on the sparse model's
own path, which full's answer never visits. This takes the answers of an engine run of the sparse mode
(bench/ruler_split.py answer output, FILE:MODE), keeps those that end by themselves (an end-of-generation token
before the token limit), and teacher-forces full attention and the sparse mode along each (the same loop as
margin_flips: dense prefill, then one decode step per token). Per sample it records:

  end step   full's log-probability of ending where the answer ends, full's argmax and top-2 margin there, and the
             sparse mode's log-probability of ending (this run, not the engine run's device)
  leaves     the steps before the end where full's argmax is not the answer's token: where the answer left the path
             full would have taken, with full's margin there

If full ends where the sparse answer ends, the early end is a consequence of the path (the content chosen before it),
and a correction at the end token itself (a logit bias on ending) could not bring full's length back; if full would
continue there, the end is the sparse model's own.

  python research/end_path.py --gguf qwen2.5-coder-0.5b --dir .ruler_ids40 --length 4096 \\
      --answers bench/results/ruler_answers_qwen2.5-coder-0.5b_4096_h200_from0_full_fluxion_9d2eaf5.json:fluxion \\
      --tasks cwe --per-task 8 --out bench/results/end_path.json
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # the product benchmarks they build on
sys.path.insert(0, str(Path(__file__).resolve().parent))
from margin_flips import answer_steps, margins  # noqa: E402
from ruler_diverge import answer_run  # noqa: E402
from ruler_split import exported_samples, model_tag  # noqa: E402

from fluxion_lite.engine.engine import Engine  # noqa: E402
from fluxion_lite.plan.sparse_plan import SparsePlan  # noqa: E402


def ended_path(output: list[int], eog: set[int]) -> list[int] | None:
    """The answer up to and including its first end-of-generation token, or None when it never ends by itself."""
    end = next((j for j, t in enumerate(output) if t in eog), None)
    return None if end is None else output[: end + 1]


def path_record(path: list[int], full: dict[str, list], sparse: dict[str, list], eog: set[int]) -> dict[str, Any]:
    """What full and the sparse mode predicted along `path` (answer_steps' output of each, forced along it)."""
    last = len(path) - 1
    leaves = [j for j in range(last) if full["argmax"][j] != path[j]]
    return {"path": path, "full_argmax": full["argmax"],
            "full_margin": margins(full),
            "full_end_logp": full["end_logp"], "sparse_end_logp": sparse["end_logp"],
            "sparse_argmax": sparse["argmax"], "leaves": leaves,
            "full_ends_too": full["argmax"][last] in eog}


def summarise(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per group of samples: how many ends full shares, full's mean P(end) at the end step, and how many answers
    left full's path before it."""
    if not records:
        return {"samples": 0}
    end_full = np.array([r["full_end_logp"][-1] for r in records])
    end_sparse = np.array([r["sparse_end_logp"][-1] for r in records])
    return {"samples": len(records), "full_ends_too": sum(r["full_ends_too"] for r in records),
            "full_end_prob_mean": float(np.exp(end_full).mean()),
            "sparse_end_prob_mean": float(np.exp(end_sparse).mean()),
            "left_full_path_before_end": sum(bool(r["leaves"]) for r in records)}


def pick_paths(run: dict[str, Any], meta: dict[str, Any], eog: set[int], tasks: list[str] | None,
               per_task: int) -> dict[int, list[int]]:
    """The first per_task answers of each task (index order) in `run` (a ruler_split answers run) that end by
    themselves, cut after their end token, by exported-sample number."""
    paths: dict[int, list[int]] = {}
    taken: dict[str, int] = {}
    for k in run["answered"]:
        task = meta["samples"][k]["task"]
        path = ended_path(run["outputs"][k], eog)
        if (tasks is None or task in tasks) and path is not None and taken.get(task, 0) < per_task:
            paths[k] = path
            taken[task] = taken.get(task, 0) + 1
    return paths


def describe(rec: dict[str, Any], decode: Callable[[list[int]], str]) -> str:
    """One sample's line: full's and the sparse mode's P(end) at the end step, and where the answer left full's path."""
    path, last = rec["path"], len(rec["path"]) - 1
    word = "<end>" if rec["full_ends_too"] else decode([rec["full_argmax"][last]])
    left = "never left full's path"
    if rec["leaves"]:
        j = rec["leaves"][0]
        left = (f"left full's path at step {j} ({decode([path[j]])!r} where full had "
                f"{decode([rec['full_argmax'][j]])!r}, full margin {rec['full_margin'][j]:.2f}; "
                f"{len(rec['leaves'])} steps in all)")
    return (f"{rec['task']}#{rec['index']}: {len(path)} tokens; at its end full's P(end) "
            f"{np.exp(rec['full_end_logp'][last]):.3f} (argmax {word!r}, margin {rec['full_margin'][last]:.2f}), "
            f"the sparse mode's {np.exp(rec['sparse_end_logp'][last]):.3f}; {left}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", required=True, help="catalog name or GGUF path")
    ap.add_argument("--dir", default=".ruler_ids")
    ap.add_argument("--length", type=int, required=True)
    ap.add_argument("--answers", required=True, metavar="FILE:MODE",
                    help="the sparse engine run whose answers are followed")
    ap.add_argument("--mode", default="fluxion", help="the sparse mode teacher-forced along them")
    ap.add_argument("--plan", default=None, help="fluxion with this plan file instead of the shipped one")
    ap.add_argument("--tasks", nargs="*", default=None)
    ap.add_argument("--per-task", type=int, default=8, help="answers that end by themselves, per task, in index order")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--chunk", type=int, default=1024, help="prefill chunk")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    meta, prompts = exported_samples(args.dir, args.gguf, args.length)
    eog = set(meta["eog_ids"])
    paths = pick_paths(answer_run(args.answers, args.length), meta, eog, args.tasks, args.per_task)
    if not paths:
        sys.exit(f"error: no answer of {args.tasks} in {args.answers} ends by itself")
    plan = SparsePlan.load(Path(args.plan)) if args.plan else None
    engine = Engine(args.gguf, attention="full", device=args.device, dtype=args.dtype,
                    max_context=args.length + 256, prefix_cache_entries=0)
    t0 = time.perf_counter()
    with torch.no_grad():
        full = {k: answer_steps(engine.model, engine.attn, prompts[k], len(p), eog, forced=p, chunk=args.chunk)
                for k, p in paths.items()}
        print(f"full followed {len(paths)} answers  {time.perf_counter() - t0:.0f} s", flush=True)
        engine.set_attention(args.mode, plan)
        records: dict[str, list[dict[str, Any]]] = {}
        for k, p in paths.items():
            sparse = answer_steps(engine.model, engine.attn, prompts[k], len(p), eog, forced=p, chunk=args.chunk)
            s = meta["samples"][k]
            rec = path_record(p, full[k], sparse, eog) | {"task": s["task"], "index": s["index"]}
            records.setdefault(s["task"], []).append(rec)
            print(describe(rec, engine.tokenizer.decode), flush=True)
    summary = {task: summarise(recs) for task, recs in records.items()}
    summary["all"] = summarise([r for recs in records.values() for r in recs])
    label = args.mode + (f"@{Path(args.plan).stem}" if args.plan else "")
    Path(args.out).write_text(json.dumps({
        "gguf": model_tag(args.gguf), "length": args.length, "answers": args.answers, "mode": label,
        "device": args.device, "dtype": args.dtype, "machine": platform.node(), "summary": summary,
        "samples": records}))
    print(f"\n{label} answers that end by themselves, {args.gguf} at {args.length}: does full end there too?")
    print(f"{'task':<16}{'n':>4}{'full ends too':>15}{'P(end) full':>13}{'sparse':>8}{'left full path':>16}")
    for task, r in summary.items():
        print(f"{task:<16}{r['samples']:>4}{r['full_ends_too']:>15}{r['full_end_prob_mean']:>13.3f}"
              f"{r['sparse_end_prob_mean']:>8.3f}{r['left_full_path_before_end']:>16}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
