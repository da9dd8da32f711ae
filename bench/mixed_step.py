"""Where a mixed step's time goes: batch-1 decoding rows beside one prompt chunk, per block-selection place.

A prefill-heavy batch (RULER at 32K, batch 64) spends almost every step with decode rows and a prompt chunk together
(docs/hybrid.md). This bench reproduces that step alone: it fills `--batch - 1` sequences of `--context` random token
ids until they all decode, then keeps one more prompt of `--context` ids in prefill (one `--prefill-chunk` chunk per
step beside the decode rows; a new prompt follows as soon as one finishes) and times `--steps` such steps per
`--variants` entry: SELECTION[:MIXED], FLUXION_SELECTION (gpu = device-side block selection, cpu = native top-k on
the host) and, for gpu, FLUXION_MIXED_SELECT (where a mixed step's decode rows select: host, the default, or device);
`+blocking-append` appends the step's K/V to the host store before the chunk's device work, after a blocking copy
(the engine's earlier order) instead of while that work runs.
Each variant has its own engine (model loaded once per variant) and the variants take turns step by step, so a
machine whose speed drifts over minutes (shared CPUs) slows them alike: compare medians of one run.

With `--profile-steps N`, N more steps per variant run under torch.profiler: the table lists the host time inside
SparseAttention._mixed's labelled parts and the ops with the most self CPU time and the most device time (a step
whose kernels add up to far less than its wall time waits on the host). `--trace-dir` also writes each variant's
chrome trace.

Usage: python bench/mixed_step.py --gguf qwen2.5-coder-0.5b --device cuda --dtype bfloat16 --context 32768 \\
           --batch 64 --steps 16 --profile-steps 4 --variants gpu cpu --out bench/results/mixed_step.json
       python bench/mixed_step.py --gguf smollm2-135m --context 1024 --batch 4 --prefill-chunk 256 --steps 3 \
           --variants cpu
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from fluxion_lite.engine.engine import Engine
from fluxion_lite.engine.sampling import SamplingParams


def _ids(n: int, vocab: int, gen: torch.Generator) -> list[int]:
    return torch.randint(100, vocab - 100, (n,), generator=gen).tolist()  # away from special ids at either end


def _op_rows(prof: Any, key: str, limit: int) -> list[dict[str, Any]]:
    rows = []
    for e in sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)[:limit]:
        rows.append({"op": e.key, "calls": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3,
                     "device_ms": getattr(e, "self_device_time_total", 0.0) / 1e3})
    return rows


class MixedSteps:
    """Keeps one engine in the mixed-step regime: `batch - 1` decoding rows and one prompt in prefill."""

    def __init__(self, engine: Engine, context: int, batch: int, gen: torch.Generator):
        self.engine, self.context, self.batch, self.gen = engine, context, batch, gen
        self.vocab = engine.config.vocab_size
        self.kinds: list[bool] = []  # per step: mixed?

    def fill(self, decode_tokens: int) -> None:
        """batch - 1 sequences decoding (each may produce up to decode_tokens), then the first feeder prompt."""
        for _ in range(self.batch - 1):
            self.engine.add_request(_ids(self.context, self.vocab, self.gen),
                                    SamplingParams(temperature=0.0, max_tokens=decode_tokens, ignore_eos=True))
        while any(s.num_cached < len(s.prompt_ids) for s in self.engine.running) or self.engine.waiting:
            self.engine.step()
        self._feed()

    def _feed(self) -> None:
        if not self.engine.waiting and all(s.num_cached >= len(s.prompt_ids) for s in self.engine.running):
            self.engine.add_request(_ids(self.context, self.vocab, self.gen),
                                    SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))

    def step(self) -> float:
        """One step (a feeder prompt queued first if none is in prefill); its wall seconds."""
        self._feed()
        before = self.engine.step_counters.mixed_steps
        t0 = time.perf_counter()
        self.engine.step()
        dt = time.perf_counter() - t0
        self.kinds.append(self.engine.step_counters.mixed_steps > before)
        return dt


VARIANTS = ("gpu", "cpu", "gpu:host", "gpu:device")


def _variant(text: str) -> str:
    base, _, option = text.partition("+")
    if base not in VARIANTS or option not in ("", "blocking-append"):
        raise argparse.ArgumentTypeError(f"{text!r}: use one of {', '.join(VARIANTS)}, optionally +blocking-append")
    return text


def _engine(args: argparse.Namespace, variant: str) -> Engine:
    variant, _, option = variant.partition("+")
    selection, _, mixed = variant.partition(":")
    os.environ["FLUXION_SELECTION"] = selection  # both are read when the backend is made
    if mixed:
        os.environ["FLUXION_MIXED_SELECT"] = mixed
    else:
        os.environ.pop("FLUXION_MIXED_SELECT", None)
    engine = Engine(args.gguf, attention="fluxion", device=args.device, dtype=args.dtype, max_batch=args.batch,
                    max_context=args.context, prefill_chunk=args.prefill_chunk, prefix_cache_entries=0,
                    load_tokenizer=False)
    if option == "blocking-append":  # the host append before the chunk's device work, after a blocking copy
        engine.attn.overlap_chunk_append = False  # type: ignore[attr-defined]
    return engine


def _profile(mix: MixedSteps, args: argparse.Namespace, variant: str, trace_dir: Path | None) -> dict[str, Any]:
    cuda = mix.engine.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(args.profile_steps):
            mix.step()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    if trace_dir is not None:
        trace_dir.mkdir(parents=True, exist_ok=True)
        raw = trace_dir / f"mixed_step_{variant.replace(':', '_').replace('+', '_')}.json"
        prof.export_chrome_trace(str(raw))
        with open(raw, "rb") as f, gzip.open(f"{raw}.gz", "wb") as g:
            g.write(f.read())
        raw.unlink()
    return {"steps": args.profile_steps, "wall_ms_per_step": wall / args.profile_steps * 1e3,
            "labels": [{"label": e.key, "calls": e.count, "cpu_ms": e.cpu_time_total / 1e3}
                       for e in prof.key_averages() if e.key.startswith("fluxion::") and e.cpu_time_total > 0],
            "top_self_cpu": _op_rows(prof, "self_cpu_time_total", args.top),
            "top_device": _op_rows(prof, "self_device_time_total", args.top)}


def run_variants(args: argparse.Namespace) -> list[dict[str, Any]]:
    decode_tokens = args.warmup + args.steps + args.profile_steps + 2 * args.context // args.prefill_chunk + 8
    mixes: list[MixedSteps] = []
    results: list[dict[str, Any]] = []
    for variant in args.variants:
        t0 = time.perf_counter()
        engine = _engine(args, variant)
        load_s = time.perf_counter() - t0
        # prompts leave room for the tokens decoded during the run, as RULER's samples of a length do
        mix = MixedSteps(engine, args.context - decode_tokens - 8, args.batch, torch.Generator().manual_seed(args.seed))
        t0 = time.perf_counter()
        mix.fill(decode_tokens)
        results.append({"variant": variant, "load_s": load_s, "fill_s": time.perf_counter() - t0})
        mixes.append(mix)
        print(f"{variant}: loaded in {load_s:.0f} s, filled in {results[-1]['fill_s']:.0f} s", flush=True)
    walls: list[list[float]] = [[] for _ in mixes]
    for i in range(args.warmup + args.steps):  # variants take turns: drift over time hits them alike
        for mix, w in zip(mixes, walls):
            if i == args.warmup:
                mix.kinds.clear()
            dt = mix.step()
            if i >= args.warmup:
                w.append(dt)
    for r, mix, w in zip(results, mixes, walls):
        mixed = [x for x, m in zip(w, mix.kinds) if m]
        r |= {"steps": len(w), "mixed_steps": len(mixed), "median_ms": statistics.median(w) * 1e3,
              "mixed_median_ms": statistics.median(mixed) * 1e3 if mixed else None,
              "min_ms": min(w) * 1e3, "max_ms": max(w) * 1e3, "walls_ms": [x * 1e3 for x in w],
              "sparse": {k: float(v) for k, v in mix.engine.stats().sparse.items()}}
        if args.profile_steps:
            r["profile"] = _profile(mix, args, r["variant"], args.trace_dir)
    return results


def _print(results: list[dict[str, Any]]) -> None:
    print(f"{'variant':>24} {'steps':>5} {'mixed':>5} {'median ms':>9} {'mixed ms':>8} {'min':>7} {'max':>7} {'fill s':>6}")
    for r in results:
        mm = f"{r['mixed_median_ms']:8.1f}" if r["mixed_median_ms"] is not None else f"{'-':>8}"
        print(f"{r['variant']:>24} {r['steps']:5d} {r['mixed_steps']:5d} {r['median_ms']:9.1f} {mm} {r['min_ms']:7.1f} "
              f"{r['max_ms']:7.1f} {r['fill_s']:6.1f}")
    for r in results:
        p = r.get("profile")
        if not p:
            continue
        print(f"\n[{r['variant']}] profiled {p['steps']} steps: {p['wall_ms_per_step']:.1f} ms per step")
        for lab in p["labels"]:  # host time inside SparseAttention._mixed's parts, children included
            print(f"  {lab['label']:<28} {lab['cpu_ms'] / p['steps']:8.2f} ms host per step ({lab['calls'] // p['steps']} calls)")
        for title, rows in (("self CPU", p["top_self_cpu"]), ("device", p["top_device"])):
            print(f"  top by {title} time (ms per profiled step):")
            for row in rows:
                print(f"    {row['self_cpu_ms'] / p['steps']:8.2f} cpu {row['device_ms'] / p['steps']:8.2f} dev "
                      f"{row['calls'] // p['steps']:6d}x  {row['op'][:90]}")


def main() -> None:
    a = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    a.add_argument("--gguf", default="qwen2.5-coder-0.5b", help="catalog name or GGUF path")
    a.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a.add_argument("--dtype", default="bfloat16")
    a.add_argument("--context", type=int, default=32768, help="context per sequence (prompt + decoded tokens)")
    a.add_argument("--batch", type=int, default=64, help="sequences per step: batch - 1 decoding and one prompt")
    a.add_argument("--prefill-chunk", type=int, default=8192)
    a.add_argument("--variants", nargs="+", default=["gpu", "cpu"], type=_variant,
                   help="SELECTION[:MIXED][+blocking-append] (see above)")
    a.add_argument("--warmup", type=int, default=4)
    a.add_argument("--steps", type=int, default=16)
    a.add_argument("--profile-steps", type=int, default=0)
    a.add_argument("--top", type=int, default=20)
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--trace-dir", type=Path)
    a.add_argument("--out", type=Path)
    args = a.parse_args()
    if args.batch < 2 or args.steps < 1 or args.context < 4 * (args.steps + args.warmup + args.profile_steps) + 64:
        a.error("--batch must be >= 2, --steps >= 1, --context room for the prompts and the decoded tokens")
    results = run_variants(args)
    _print(results)
    if args.out:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        meta = {"machine": platform.node(), "device": args.device, "commit": commit or None,
                "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(meta | {"results": results}, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
