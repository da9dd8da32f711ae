"""RULER-style accuracy of each attention mode on the same generated samples.

For every target length, samples are generated once (fluxion_lite.offline.ruler, fixed seeds, the model's tokenizer and chat
template) and every mode answers the same prompts greedily. Scored by substring match; prints a task x mode accuracy
table and a per-mode summary (mean accuracy, mean fraction of the KV read per decode step, fraction of streaming KV
groups, seconds per sample) and writes bench/results/ruler_<model>_<length>.json.

Cost on a 2-core CPU: qwen2.5-coder-0.5b prefills ~300-600 tokens/s, so one 4K sample is ~10 s and the full
13 tasks x 20 samples x 3 modes at 4K is ~2-3 hours; smoke-test with --samples 1 --tasks a few --lengths 1024.

Usage: python bench/ruler.py --model qwen2.5-coder-0.5b --lengths 4096 --samples 20 \
           --modes full fixed fluxion --tasks all
"""
from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from fluxion_lite.engine.engine import Engine
from fluxion_lite.errors import FluxionError, RequestError
from fluxion_lite.offline.ruler import TASKS, PromptRenderer, Sample, chat_prompt, generate_sample, plain_prompt, score_output
from fluxion_lite.engine.sampling import SamplingParams


def load_engine(
    model: str, mode: str, max_context: int, prefill_chunk: int, device: str
) -> tuple[Engine | None, str]:
    """(the engine for one mode, "") or (None, why) when this build or model does not offer the mode."""
    try:
        engine = Engine(model, attention=mode, device=device, max_context=max_context, prefill_chunk=prefill_chunk,
                        prefix_cache_entries=0)
        return engine, ""
    except RequestError as exc:
        print(f"[skip] mode {mode!r}: {exc}", file=sys.stderr)
        return None, str(exc)


def prompt_renderer(engine: Engine, use_chat: bool) -> PromptRenderer:
    """The model's chat template when it has one (instruct models), else plain text."""
    tok = engine.tokenizer
    assert tok is not None
    if use_chat:
        try:
            tok.apply_chat_template([{"role": "user", "content": "x"}])
            return chat_prompt(tok.apply_chat_template)
        except RequestError:
            print("[info] the model has no chat template: using plain prompts", file=sys.stderr)
    return plain_prompt


def build_samples(engine: Engine, tasks: list[str], length: int, n: int, seed: int, use_chat: bool) -> list[Sample]:
    tok = engine.tokenizer
    assert tok is not None
    render = prompt_renderer(engine, use_chat)
    count = lambda text: len(tok.encode(text, add_special=True))  # noqa: E731
    t0 = time.perf_counter()
    samples = [generate_sample(t, length, i, count, render, seed) for t in tasks for i in range(n)]
    print(f"generated {len(samples)} samples at {length} tokens in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return samples


def run_sample(engine: Engine, sample: Sample) -> dict[str, Any]:
    """Greedy answer for one sample; per-sample sparse counters where the backend can reset them."""
    assert engine.tokenizer is not None
    ids = engine.tokenizer.encode(sample.prompt, add_special=True)
    reset = getattr(engine.attn, "reset_stats", None)
    if callable(reset):
        reset()
    t0 = time.perf_counter()
    rid = engine.add_request(ids, SamplingParams(temperature=0.0, max_tokens=sample.max_new_tokens))
    text: list[str] = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid:
                text.append(out.new_text)
    output = "".join(text)
    return {
        "task": sample.task,
        "index": sample.index,
        "seed": sample.seed,
        "prompt_tokens": len(ids),
        "score": score_output(output, sample.answers, sample.metric),
        "output": output,
        "answers": list(sample.answers),
        "seconds": time.perf_counter() - t0,
        "sparse": dict(engine.stats().sparse),
    }


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _mean_counter(records: list[dict[str, Any]], key: str) -> float | None:
    """Mean of a sparse counter over the records that have it (none for dense attention)."""
    return _mean([r["sparse"][key] for r in records if key in r["sparse"]])


def summarise(records: list[dict[str, Any]], tasks: list[str]) -> dict[str, Any]:
    per_task: dict[str, Any] = {}
    for task in tasks:
        rows = [r for r in records if r["task"] == task]
        per_task[task] = {
            "accuracy": _mean([r["score"] for r in rows]),
            "samples": len(rows),
            "kv_read_fraction": _mean_counter(rows, "kv_read_fraction"),
            "streaming_fraction": _mean_counter(rows, "streaming_fraction"),
            "seconds_per_sample": _mean([r["seconds"] for r in rows]),
        }
    accs = [v["accuracy"] for v in per_task.values() if v["accuracy"] is not None]
    return {
        "mean_accuracy": _mean(accs),  # RULER's average: tasks weigh equally
        "samples": len(records),
        "kv_read_fraction": _mean_counter(records, "kv_read_fraction"),
        "streaming_fraction": _mean_counter(records, "streaming_fraction"),
        "seconds_per_sample": _mean([r["seconds"] for r in records]),
        "tasks": per_task,
    }


def _fmt(x: float | None, pct: bool = True) -> str:
    if x is None:
        return "-"
    return f"{x:.1%}" if pct else f"{x:.1f}"


def print_tables(length: int, tasks: list[str], modes: dict[str, Any]) -> None:
    ran = [m for m, r in modes.items() if "skipped" not in r]
    w = max([10] + [len(m) + 2 for m in modes])  # column width: mode names such as "fluxion+predictor" fit
    print(f"\nRULER @ {length} tokens: accuracy (substring match), samples per task")
    print(f"{'task':<18}" + "".join(f"{m:>{w}}" for m in ran) + f"{'n':>5}")
    for task in tasks:
        n = modes[ran[0]]["tasks"][task]["samples"] if ran else 0
        print(f"{task:<18}" + "".join(f"{_fmt(modes[m]['tasks'][task]['accuracy']):>{w}}" for m in ran) + f"{n:>5}")
    print(f"\n{'mode':<{w}}{'accuracy':>10}{'samples':>9}{'KV read/step':>14}{'streaming':>11}{'s/sample':>10}")
    for mode, r in modes.items():
        if "skipped" in r:
            print(f"{mode:<{w}}  skipped: {r['skipped']}")
            continue
        print(
            f"{mode:<{w}}{_fmt(r['mean_accuracy']):>10}{r['samples']:>9}{_fmt(r['kv_read_fraction']):>14}"
            f"{_fmt(r['streaming_fraction']):>11}{_fmt(r['seconds_per_sample'], pct=False):>10}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096])
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--modes", nargs="+", default=["full", "fixed", "fluxion"])
    ap.add_argument("--tasks", nargs="+", default=["all"], help=f"'all' or some of: {' '.join(TASKS)}")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--plain", action="store_true", help="plain prompts even if the model has a chat template")
    ap.add_argument("--out-dir", default="bench/results")
    args = ap.parse_args()
    tasks = list(TASKS) if args.tasks == ["all"] else args.tasks
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        ap.error(f"unknown task(s) {', '.join(unknown)}; known: {', '.join(TASKS)}")
    if args.samples < 1:
        ap.error("--samples must be >= 1")
    model_tag = Path(args.model).stem if args.model.endswith(".gguf") else Path(args.model).name
    results: dict[int, dict[str, Any]] = {
        length: {
            "model": args.model, "length": length, "samples_per_task": args.samples, "seed": args.seed,
            "tasks": tasks, "machine": platform.node(), "processor": platform.processor(), "modes": {},
        }
        for length in args.lengths
    }
    samples: dict[int, list[Sample]] = {}
    for mode in args.modes:
        engine, why = load_engine(args.model, mode, max(args.lengths), args.prefill_chunk, args.device)
        if engine is None:
            for length in args.lengths:
                results[length]["modes"][mode] = {"skipped": why}
            continue
        for length in args.lengths:
            if length not in samples:  # generated once, with the first engine's tokenizer: every mode sees the same
                try:
                    samples[length] = build_samples(engine, tasks, length, args.samples, args.seed, not args.plain)
                except FluxionError as exc:
                    sys.exit(f"error: {exc}")
            records = []
            for k, sample in enumerate(samples[length], 1):
                rec = run_sample(engine, sample)
                records.append(rec)
                print(
                    f"[{mode} {length}] {k}/{len(samples[length])} {sample.task}#{sample.index} "
                    f"score {rec['score']:.2f} {rec['seconds']:.1f} s  -> {rec['output'][:60]!r}",
                    file=sys.stderr,
                )
            results[length]["modes"][mode] = summarise(records, tasks) | {"records": records}
            _write(results[length], args.out_dir, model_tag, length)
        del engine
        gc.collect()
    for length in args.lengths:
        print_tables(length, tasks, results[length]["modes"])
        print(f"wrote {_write(results[length], args.out_dir, model_tag, length)}")


def _write(result: dict[str, Any], out_dir: str, model_tag: str, length: int) -> Path:
    path = Path(out_dir) / f"ruler_{model_tag}_{length}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    return path


if __name__ == "__main__":
    main()
