"""Where a sparse mode's greedy answer leaves full attention's, and whether its own top-2 margin says so beforehand.

A lost RULER answer is a greedy step where the sparse model's argmax differs from full's, after which the two
answers diverge. If those steps are the ones where the sparse model is unsure (a small gap between its two best
log-probabilities), a step below a margin threshold could be recomputed with more of the KV read, and the answer
would follow full's at the cost of the few steps escalated. This measures that, per sample:

  1. full attention answers greedily (prefill the prompt, then one decode step per token, as the engine does);
  2. the sparse mode is teacher-forced along that answer (same prefill; its decode steps read what its plan picks)
     and, per decode step, records its top-2 log-probabilities and its argmax;
  3. a flip is a decode step whose sparse argmax differs from full's token. With escalation at threshold t, a
     sample follows full's answer when every flip has a sparse margin below t; the cost is the share of decode
     steps below t.

The first answer token comes from the dense prefill in both modes and is left out. Prints per task and threshold:
decode steps, flips, samples with a flip, samples every one of whose flips the threshold catches, the share of
steps escalated, and whether the sparse mode leans toward ending the answer ("end shift": the log-odds of an
end-of-generation token under the sparse mode minus under full, mean over decode steps along full's answer);
writes JSON with every step's margins, end log-probabilities and sparse argmax. With --escalate-plan, a larger plan
is teacher-forced along the same answer too, and the summary counts the flipped samples that would follow full's
answer if each step below t took that plan's token instead (an escalation that reads more, not everything).

  python research/margin_flips.py --gguf qwen2.5-coder-0.5b --dir .ruler_ids --length 4096 --per-task 5 \\
      --mode fluxion --out bench/results/margin_flips.json
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # the product benchmarks they build on
sys.path.insert(0, str(Path(__file__).resolve().parent))
from background_mass import MASSES  # noqa: E402
from fidelity import prefill_chunks  # noqa: E402
from ruler_split import exported_samples, model_tag, picked_samples  # noqa: E402

from fluxion_lite.model.attention import AttentionBackend, DenseAttention, SeqChunk  # noqa: E402
from fluxion_lite.engine.engine import Engine  # noqa: E402
from fluxion_lite.model.transformer import Transformer  # noqa: E402
from fluxion_lite.plan.sparse_plan import SparsePlan  # noqa: E402

SEQ_ID = 0
THRESHOLDS = (0.25, 0.5, 1.0, 2.0, 3.0)


def answer_steps(model: Transformer, attn: AttentionBackend, prompt: list[int], max_new: int, eog: set[int],
                 forced: list[int] | None = None, chunk: int = 1024) -> dict[str, list]:
    """Greedy answer (or `forced`'s tokens): per output token its argmax, top-2 log-probabilities, the log-probability
    of ending there (any end-of-generation token) and the token taken. Token 0 comes from the prefill's last row, the
    rest from single-token decode steps."""
    attn.allocate(SEQ_ID)
    out: dict[str, list] = {"taken": [], "argmax": [], "top1": [], "top2": [], "end_logp": []}
    end_ids = torch.tensor(sorted(eog), dtype=torch.long)
    try:
        pieces = prefill_chunks(len(prompt), chunk)
        for i, (start, n) in enumerate(pieces):
            rows = torch.tensor([n - 1]) if i == len(pieces) - 1 else torch.empty(0, dtype=torch.long)
            logits = model.forward(torch.tensor(prompt[start : start + n]), torch.arange(start, start + n),
                                   [SeqChunk(SEQ_ID, start, n)], attn, logit_rows=rows)
        pos = len(prompt)
        limit = len(forced) if forced is not None else max_new
        for j in range(limit):
            logp = torch.log_softmax(logits[-1].float().cpu(), dim=-1)  # [V]
            top = torch.topk(logp, 2)
            token = forced[j] if forced is not None else int(top.indices[0])
            out["taken"].append(token)
            out["argmax"].append(int(top.indices[0]))
            out["top1"].append(float(top.values[0]))
            out["top2"].append(float(top.values[1]))
            out["end_logp"].append(float(torch.logsumexp(logp[end_ids], dim=0)))
            if token in eog or j == limit - 1:
                break
            logits = model.forward(torch.tensor([token]), torch.tensor([pos]), [SeqChunk(SEQ_ID, pos, 1)], attn)
            pos += 1
    finally:
        attn.free(SEQ_ID)
    return out


def margins(steps: dict[str, list]) -> list[float]:
    """Per output token of answer_steps' output, the gap between its two best log-probabilities."""
    return [a - b for a, b in zip(steps["top1"], steps["top2"])]


def _log_odds(logp: np.ndarray) -> np.ndarray:
    """log(p / (1 - p)) from log p, clipped away from p = 1 ([steps] float64)."""
    return logp - np.log(np.maximum(-np.expm1(np.minimum(logp, -1e-12)), 1e-300))


def summarise(samples: list[dict[str, Any]], thresholds: tuple[float, ...]) -> dict[str, Any]:
    """Per threshold: decode steps escalated, flips caught, samples with a flip and those whose flips are all caught."""
    margins = [np.asarray(s["sparse_margin"][1:]) for s in samples]  # decode steps only
    flips = [np.asarray(s["flip"][1:], dtype=bool) for s in samples]
    steps = sum(len(m) for m in margins)
    n_flips = int(sum(f.sum() for f in flips))
    flipped = [i for i, f in enumerate(flips) if f.any()]
    row: dict[str, Any] = {"samples": len(samples), "decode_steps": steps, "flips": n_flips,
                           "samples_flipped": len(flipped), "by_threshold": {}}
    if samples and "sparse_end_logp" in samples[0]:
        # does the sparse mode lean toward ending the answer sooner? mean log-odds shift of P(end) along full's answer
        shift = [_log_odds(np.asarray(s["sparse_end_logp"][1:])) - _log_odds(np.asarray(s["full_end_logp"][1:]))
                 for s in samples]
        row["end_log_odds_shift_mean"] = float(np.concatenate(shift).mean()) if steps else 0.0
    for t in thresholds:
        below = sum(int((m < t).sum()) for m in margins)
        caught = int(sum((f & (m < t)).sum() for m, f in zip(margins, flips)))
        rescued = sum(1 for i in flipped if bool((margins[i][flips[i]] < t).all()))
        row["by_threshold"][str(t)] = {"escalated_share": below / max(steps, 1), "flips_caught": caught,
                                       "samples_rescued": rescued}
        for name in samples[0].get("escalated", {}) if samples else []:
            # a step below t takes the larger plan's token instead: the sample follows full's answer when every
            # step's taken token (the base plan's above t, the larger plan's below) is full's
            follows = 0
            for i in flipped:
                agrees = np.asarray(samples[i]["escalated"][name][1:], dtype=bool)  # the larger plan's argmax is full's
                below_t = margins[i] < t
                follows += bool(((below_t & agrees) | (~below_t & ~flips[i])).all())
            row["by_threshold"][str(t)][f"samples_following_with_{name}"] = follows
    return row


def write(args: argparse.Namespace, label: str, by_task: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Summarise what was measured so far and write it with every step's margins to args.out."""
    summary = {task: summarise(recs, THRESHOLDS) for task, recs in by_task.items()}
    summary["all"] = summarise([r for recs in by_task.values() for r in recs], THRESHOLDS)
    Path(args.out).write_text(json.dumps({
        "gguf": model_tag(args.gguf), "length": args.length, "mode": label, "device": args.device,
        "dtype": args.dtype, "machine": platform.node(), "thresholds": list(THRESHOLDS), "summary": summary,
        "samples": by_task}))
    return summary


def full_answers_from(path: Path, meta: dict[str, Any], wanted: list[int],
                      args: argparse.Namespace) -> dict[int, dict[str, list]]:
    """Full's per-sample answers recorded by an earlier run (its 'answer', 'full_margin', 'full_end_logp'), or exit
    naming what does not match."""
    try:
        old = json.loads(path.read_text())
        by_key = {(r["task"], r["index"]): r for recs in old["samples"].values() for r in recs}
    except (OSError, ValueError, KeyError, TypeError) as e:
        sys.exit(f"error: --full-from {path}: not a margin_flips result ({e!r})")
    for field, want in (("gguf", model_tag(args.gguf)), ("length", args.length), ("device", args.device),
                        ("dtype", args.dtype)):
        if old.get(field) != want:
            sys.exit(f"error: --full-from {path}: its {field} is {old.get(field)!r}, this run's {want!r}")
    out = {}
    for k in wanted:
        s = meta["samples"][k]
        r = by_key.get((s["task"], s["index"]))
        if r is None or "full_end_logp" not in r:
            sys.exit(f"error: --full-from {path}: no {s['task']} #{s['index']} with end log-probabilities in it")
        out[k] = {"taken": r["answer"], "margin": r["full_margin"], "end_logp": r["full_end_logp"]}
    return out


def parse_simulate(spec: str) -> tuple[int, float, int | None, str]:
    """'G:BUDGET[:SUMMARY_G[:MASS]]' -> (g, budget, summary_g or None, mass), or exit naming the flag."""
    parts = spec.split(":")
    try:
        if len(parts) not in (2, 3, 4):
            raise ValueError("two to four fields")
        g, budget = int(parts[0]), float(parts[1])
        summary_g = int(parts[2]) if len(parts) >= 3 else None
        mass = parts[3] if len(parts) == 4 else "mean"
        if g < 1 or not 0.0 < budget <= 1.0 or (summary_g is not None and summary_g < 1):
            raise ValueError("G >= 1, 0 < BUDGET <= 1, SUMMARY_G >= 1")
        if mass not in MASSES:
            raise ValueError(f"MASS is one of {', '.join(MASSES)}")
    except ValueError as e:
        sys.exit(f"error: --simulate {spec!r}: use G:BUDGET[:SUMMARY_G[:MASS]] ({e})")
    return g, budget, summary_g, mass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", required=True, help="catalog name or GGUF path")
    ap.add_argument("--dir", default=".ruler_ids")
    ap.add_argument("--length", type=int, required=True)
    ap.add_argument("--mode", default="fluxion", help="the sparse mode compared with full")
    ap.add_argument("--plan", default=None, help="fluxion with this plan file instead of the shipped one")
    ap.add_argument("--tasks", nargs="*", default=None)
    ap.add_argument("--per-task", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--chunk", type=int, default=1024, help="prefill chunk")
    ap.add_argument("--escalate-plan", nargs="*", default=[],
                    help="larger plans a small-margin step would switch to: each is teacher-forced too, and the "
                         "summary counts the flipped samples that would follow full's answer with it")
    ap.add_argument("--simulate", default=None, metavar="G:BUDGET[:SUMMARY_G[:MASS]]",
                    help="instead of an engine mode: research/background_fidelity.py's simulated top-k (every group "
                         "sink + window + the top BUDGET of its G-token blocks), with the unread-background term at "
                         "summary size SUMMARY_G if given, its mass from the mean key (MASS mean, the default), "
                         "the unread tokens' true mass (oracle: exact) or from the 16-token "
                         "key min / max the top-k scans (minmax: log-normal; midrange: the midrange key)")
    ap.add_argument("--sink", type=int, default=16, help="--simulate: sink tokens")
    ap.add_argument("--window", type=int, default=64, help="--simulate: window tokens")
    ap.add_argument("--full-from", default=None, metavar="FILE",
                    help="reuse full's answers, margins and end log-probabilities from an earlier run's JSON (same "
                         "model, length, device and dtype; it must hold every sample asked for)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    simulate = parse_simulate(args.simulate) if args.simulate else None
    meta, prompts = exported_samples(args.dir, args.gguf, args.length)
    eog = set(meta["eog_ids"])
    wanted = picked_samples(meta, args.tasks, args.per_task, args.gguf)
    plan = SparsePlan.load(Path(args.plan)) if args.plan else None
    label = args.mode + (f"@{Path(args.plan).stem}" if args.plan else "")
    if simulate:
        label = (f"sim g{simulate[0]} b{simulate[1]:g}" + (f" +bg{simulate[2]}" if simulate[2] else "")
                 + (f" {simulate[3]} mass" if simulate[2] and simulate[3] != "mean" else ""))
    escalate = [(Path(p).stem.removesuffix(".plan"), SparsePlan.load(Path(p))) for p in args.escalate_plan]
    engine = Engine(args.gguf, attention="full", device=args.device, dtype=args.dtype,
                    max_context=args.length + 256, prefix_cache_entries=0, load_tokenizer=False)
    # One backend per phase, not per sample: full answers all samples first, then each plan follows them
    by_task: dict[str, list[dict[str, Any]]] = {}
    t0 = time.perf_counter()
    with torch.no_grad():
        if args.full_from:
            answers = full_answers_from(Path(args.full_from), meta, wanted, args)
            print(f"full's answers of {len(wanted)} samples from {args.full_from}", flush=True)
        else:
            answers = {}
            for k in wanted:
                got = answer_steps(engine.model, engine.attn, prompts[k], meta["samples"][k]["max_new_tokens"], eog,
                                   chunk=args.chunk)
                answers[k] = {"taken": got["taken"], "end_logp": got["end_logp"],
                              "margin": margins(got)}
            print(f"full answered {len(wanted)} samples  {time.perf_counter() - t0:.0f} s", flush=True)
        if simulate:
            from background_fidelity import SimulatedTopK  # noqa: PLC0415  (torch-only simulation, on request)

            assert isinstance(engine.attn, DenseAttention)
            sparse_attn: AttentionBackend = SimulatedTopK(engine.attn, simulate[0], simulate[1], args.sink,
                                                          args.window, simulate[2], simulate[3])
        else:
            engine.set_attention(args.mode, plan)
            sparse_attn = engine.attn
        records = {}
        for n, k in enumerate(wanted):
            s, full = meta["samples"][k], answers[k]
            sparse = answer_steps(engine.model, sparse_attn, prompts[k], s["max_new_tokens"], eog,
                                  forced=full["taken"], chunk=args.chunk)
            rec = records[k] = {
                "task": s["task"], "index": s["index"], "answer": full["taken"],
                "full_margin": full["margin"],
                "sparse_margin": margins(sparse),
                "flip": [a != b for a, b in zip(sparse["argmax"], full["taken"])], "escalated": {},
                "sparse_argmax": sparse["argmax"], "full_end_logp": full["end_logp"],
                "sparse_end_logp": sparse["end_logp"]}
            by_task.setdefault(s["task"], []).append(rec)
            first = next((j for j, f in enumerate(rec["flip"]) if f), None)
            print(f"[{n + 1}/{len(wanted)}] {s['task']}#{s['index']}: {len(rec['answer'])} tokens, "
                  f"flips {sum(rec['flip'])}, first at {first}"
                  + (f" (sparse margin {rec['sparse_margin'][first]:.2f}, full {rec['full_margin'][first]:.2f})"
                     if first is not None else "") + f"  {time.perf_counter() - t0:.0f} s", flush=True)
            summary = write(args, label, by_task)  # after every sample: a run cut short keeps what it measured
        for name, big in escalate:  # per step: does the larger plan agree with full's token?
            engine.set_attention(args.mode, big)
            for k in wanted:
                got = answer_steps(engine.model, engine.attn, prompts[k], meta["samples"][k]["max_new_tokens"], eog,
                                   forced=answers[k]["taken"], chunk=args.chunk)
                records[k]["escalated"][name] = [a == b for a, b in zip(got["argmax"], answers[k]["taken"])]
            summary = write(args, label, by_task)
            print(f"{name} followed the answers  {time.perf_counter() - t0:.0f} s", flush=True)
    print(f"\n{label} vs full, {args.gguf} at {args.length}: greedy flips and escalation by sparse top-2 margin")
    head = "".join(f"  t<{t:<4g} esc/rescued" for t in THRESHOLDS)
    print(f"{'task':<16}{'n':>4}{'steps':>7}{'flips':>7}{'flipped':>9}{'end shift':>10}{head}")
    for task, r in summary.items():
        cells = "".join(f"  {r['by_threshold'][str(t)]['escalated_share']:>9.1%}/{r['by_threshold'][str(t)]['samples_rescued']:<3d}"
                        for t in THRESHOLDS)
        print(f"{task:<16}{r['samples']:>4}{r['decode_steps']:>7}{r['flips']:>7}{r['samples_flipped']:>9}"
              f"{r['end_log_odds_shift_mean']:>+10.2f}{cells}")
    for name, _ in escalate:
        key = f"samples_following_with_{name}"
        print(f"switching to {name} below t, flipped samples that follow full's answer: " + ", ".join(
            f"t<{t:g}: {summary['all']['by_threshold'][str(t)][key]}" for t in THRESHOLDS))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
