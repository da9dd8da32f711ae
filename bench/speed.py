"""Prefill and decode speed on this CPU, ours vs llama.cpp (llama-cpp-python) on the same GGUF, in one run.

For each model and context length N: prefill N tokens of essay text (tokens/s), then decode D tokens greedily with
EOS ignored (tokens/s, median-free: total time over D steps). Both engines use all cores and fp32/their default types.

Usage: python bench/speed.py [--models ...] [--contexts 512 4096] [--decode 32] [--out bench/results/speed.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

from fluxion_lite.engine import Engine
from fluxion_lite.eval_text import essay_text
from fluxion_lite.llamacpp_peer import last_logits, load_peer
from fluxion_lite.sampling import SamplingParams


def ours(engine: Engine, tokens: list[int], n_decode: int) -> tuple[float, float]:
    rid = engine.add_request(tokens, SamplingParams(temperature=0.0, max_tokens=n_decode, ignore_eos=True))
    stamps: list[float] = []
    t0 = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid and out.new_token_ids:
                stamps.append(time.perf_counter())
    prefill_s = stamps[0] - t0  # the first token comes out of the last prefill chunk
    decode_s = stamps[-1] - stamps[0]
    return len(tokens) / prefill_s, (len(stamps) - 1) / decode_s


def peer_speed(peer: object, tokens: list[int], n_decode: int) -> tuple[float, float]:
    peer.reset()  # type: ignore[attr-defined]
    t0 = time.perf_counter()
    peer.eval(tokens)  # type: ignore[attr-defined]
    t1 = time.perf_counter()
    for _ in range(n_decode - 1):
        logits = last_logits(peer)
        peer.eval([int(logits.argmax())])  # type: ignore[attr-defined]
    t2 = time.perf_counter()
    return len(tokens) / (t1 - t0), (n_decode - 1) / (t2 - t1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "qwen2.5-coder-0.5b"])
    ap.add_argument("--contexts", nargs="+", type=int, default=[512, 4096])
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--out", default=None, help="default bench/results/speed[_<dtype>].json")
    args = ap.parse_args()
    threads = torch.get_num_threads()
    rows = []
    print(f"machine: {platform.node()} {platform.processor()} cores={os.cpu_count()} torch threads={threads}")
    print(f"{'model':<20}{'ctx':>6}{'prefill tok/s':>15}{'llama.cpp':>11}{'ratio':>7}{'decode tok/s':>14}{'llama.cpp':>11}{'ratio':>7}")
    for name in args.models:
        engine = Engine(name, dtype=args.dtype, prefill_chunk=512, prefix_cache_entries=0)
        assert engine.tokenizer is not None
        text_ids = engine.tokenizer.encode(essay_text()[: max(args.contexts) * 8], add_special=True)
        peer = load_peer(engine.model_path, n_ctx=max(args.contexts) + args.decode + 8, n_threads=threads, logits_all=False)
        for n in args.contexts:
            tokens = text_ids[:n]
            p_ours, d_ours = ours(engine, tokens, args.decode)
            p_peer, d_peer = peer_speed(peer, tokens, args.decode)
            row = {"model": name, "context": n, "prefill_tps": p_ours, "prefill_tps_llamacpp": p_peer,
                   "decode_tps": d_ours, "decode_tps_llamacpp": d_peer}
            rows.append(row)
            print(f"{name:<20}{n:>6}{p_ours:>15.1f}{p_peer:>11.1f}{p_ours / p_peer:>7.2f}"
                  f"{d_ours:>14.1f}{d_peer:>11.1f}{d_ours / d_peer:>7.2f}")
        del peer, engine
    out = Path(args.out or ("bench/results/speed.json" if args.dtype == "float32" else f"bench/results/speed_{args.dtype}.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": platform.node(), "threads": threads, "dtype": args.dtype, "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
