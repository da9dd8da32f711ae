"""Where dense decode stops being faster than fluxion on this CPU, per model: the context of `auto`'s switch.

For each model and context: decode TPOT with `full` (the dense fp32 cache) and with `fluxion` (the host store), one
engine per model switched between the modes, greedy tokens with EOS ignored, the first decode step left out (it
chooses the pinned blocks once per request). Prints, per context, both TPOTs and the dense KV's size against the
weights' bytes, and the first context at which fluxion is faster.

Usage: python research/cpu_crossover.py --models smollm2-135m qwen2.5-coder-0.5b --contexts 512 1024 2048 4096
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from fluxion_lite.engine.engine import Engine
from fluxion_lite.engine.sampling import SamplingParams
from fluxion_lite.hostkv import native
from fluxion_lite.offline.eval_text import essay_text


def tpot(engine: Engine, tokens: list[int], n_decode: int) -> float:
    """ms per decode step, from the second decode step on."""
    engine.add_request(tokens, SamplingParams(temperature=0.0, max_tokens=n_decode, ignore_eos=True))
    stamps: list[float] = []
    while engine.has_unfinished():
        if any(out.new_token_ids for out in engine.step()):
            stamps.append(time.perf_counter())
    return 1000 * (stamps[-1] - stamps[1]) / (len(stamps) - 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
    ap.add_argument("--contexts", nargs="+", type=int, default=[512, 1024, 2048, 4096])
    ap.add_argument("--decode", type=int, default=24)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("/tmp/cpu_crossover.json"))
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
        native.set_threads(args.threads)
    rows = []
    for name in args.models:
        engine = Engine(name, attention="full", prefill_chunk=512, prefix_cache_entries=0)
        weight_bytes = engine.model_path.stat().st_size
        kv_per_token = engine.config.kv_bytes_per_token(4)  # the dense CPU cache is fp32
        ids = engine.tokenizer.encode(essay_text()[: max(args.contexts) * 8], add_special=True)
        crossover = None
        for n in args.contexts:
            times = {}
            for mode in ("full", "fluxion"):
                engine.set_attention(mode)
                times[mode] = tpot(engine, ids[:n], args.decode)
            ratio = n * kv_per_token / weight_bytes
            if crossover is None and times["fluxion"] < times["full"]:
                crossover = n
            rows.append({"model": name, "context": n, "full_ms": times["full"], "fluxion_ms": times["fluxion"],
                         "dense_kv_over_weights": ratio})
            print(f"{name:<20}{n:>7} full {times['full']:7.2f} ms  fluxion {times['fluxion']:7.2f} ms  "
                  f"dense KV / weights {ratio:5.2f}", flush=True)
        print(f"{name}: fluxion first faster at {crossover}")
        del engine
    args.out.write_text(json.dumps({"threads": native.get_threads(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
