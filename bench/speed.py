"""Prefill and decode speed on this CPU, ours vs llama.cpp (llama-cpp-python) on the same GGUF, in one run.

For each model and context length N: prefill N tokens of essay text (tokens/s), then decode D tokens greedily with
EOS ignored (tokens/s, median-free: total time over D steps). Both engines use --threads (default: torch's thread count)
and --dtype / their default types. Decode is also reported per CPU second of this process (`cpu` columns): on a
shared machine, wall time includes waiting for a core that other work holds, CPU time does not. With --threads 1 the
CPU rate is each engine's own single-core speed; with more threads it also counts spinning workers.

Also per model: load time and the process's resident memory after loading, above its baseline after imports
(RSS, from /proc; the GGUF file's pages count once they are read: memory-mapped weights are the file's pages).

Usage: python bench/speed.py [--models ...] [--contexts 512 4096] [--decode 32] [--threads 2] [--dtype auto] [--out ...]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

from fluxion_lite.engine.engine import Engine
from fluxion_lite.hostkv import native
from fluxion_lite.offline.eval_text import essay_text
from fluxion_lite.offline.llamacpp_peer import last_logits, load_peer
from fluxion_lite.engine.sampling import SamplingParams


def ours(engine: Engine, tokens: list[int], n_decode: int) -> tuple[float, float, float]:
    """(prefill tok/s, decode tok/s, decode tok per CPU second)."""
    rid = engine.add_request(tokens, SamplingParams(temperature=0.0, max_tokens=n_decode, ignore_eos=True))
    stamps: list[float] = []
    cpu_stamps: list[float] = []
    t0 = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid and out.new_token_ids:
                stamps.append(time.perf_counter())
                cpu_stamps.append(time.process_time())
    prefill_s = stamps[0] - t0  # the first token comes out of the last prefill chunk
    decode_s = stamps[-1] - stamps[0]
    return len(tokens) / prefill_s, (len(stamps) - 1) / decode_s, (len(stamps) - 1) / (cpu_stamps[-1] - cpu_stamps[0])


def peer_speed(peer: object, tokens: list[int], n_decode: int) -> tuple[float, float, float]:
    peer.reset()  # type: ignore[attr-defined]
    t0 = time.perf_counter()
    peer.eval(tokens)  # type: ignore[attr-defined]
    t1, c1 = time.perf_counter(), time.process_time()
    for _ in range(n_decode - 1):
        logits = last_logits(peer)
        peer.eval([int(logits.argmax())])  # type: ignore[attr-defined]
    t2, c2 = time.perf_counter(), time.process_time()
    return len(tokens) / (t1 - t0), (n_decode - 1) / (t2 - t1), (n_decode - 1) / (c2 - c1)


def rss_bytes() -> int:
    """The process's resident set now (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["smollm2-135m", "qwen2.5-coder-0.5b"])
    ap.add_argument("--contexts", nargs="+", type=int, default=[512, 4096])
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="auto: the CPU default (weights kept in the file's block formats)")
    ap.add_argument("--threads", type=int, default=0, help="threads for both engines (0: torch's default)")
    ap.add_argument("--out", default=None, help="default bench/results/speed[_<dtype>].json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
        native.set_threads(args.threads)
    threads = torch.get_num_threads()
    base_rss = rss_bytes()
    rows = []
    print(f"machine: {platform.node()} {platform.processor()} cores={os.cpu_count()} torch threads={threads}")
    print(f"{'model':<20}{'ctx':>6}{'prefill tok/s':>15}{'llama.cpp':>11}{'ratio':>7}{'decode tok/s':>14}{'llama.cpp':>11}"
          f"{'ratio':>7}{'cpu':>8}{'llama.cpp':>11}{'ratio':>7}")
    for name in args.models:
        t_load = time.perf_counter()
        engine = Engine(name, dtype=args.dtype, prefill_chunk=512, prefix_cache_entries=0)
        load_s = time.perf_counter() - t_load
        load_rss = rss_bytes() - base_rss
        file_bytes = engine.model_path.stat().st_size
        print(f"{name}: loaded in {load_s:.2f} s, RSS +{load_rss / 2**20:.0f} MiB (file {file_bytes / 2**20:.0f} MiB)")
        assert engine.tokenizer is not None
        text_ids = engine.tokenizer.encode(essay_text()[: max(args.contexts) * 8], add_special=True)
        peer = load_peer(engine.model_path, n_ctx=max(args.contexts) + args.decode + 8, n_threads=threads, logits_all=False)
        for n in args.contexts:
            tokens = text_ids[:n]
            p_ours, d_ours, c_ours = ours(engine, tokens, args.decode)
            p_peer, d_peer, c_peer = peer_speed(peer, tokens, args.decode)
            row = {"model": name, "context": n, "prefill_tps": p_ours, "prefill_tps_llamacpp": p_peer,
                   "decode_tps": d_ours, "decode_tps_llamacpp": d_peer,
                   "decode_tok_per_cpu_s": c_ours, "decode_tok_per_cpu_s_llamacpp": c_peer,
                   "load_s": load_s, "load_rss_bytes": load_rss, "file_bytes": file_bytes,
                   "rss_after_bytes": rss_bytes() - base_rss}
            rows.append(row)
            print(f"{name:<20}{n:>6}{p_ours:>15.1f}{p_peer:>11.1f}{p_ours / p_peer:>7.2f}"
                  f"{d_ours:>14.1f}{d_peer:>11.1f}{d_ours / d_peer:>7.2f}{c_ours:>8.1f}{c_peer:>11.1f}{c_ours / c_peer:>7.2f}",
                  flush=True)
        del peer, engine
    out = Path(args.out or f"bench/results/speed_{args.dtype}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    out.write_text(json.dumps({"machine": platform.node(), "cpu": cpu, "threads": threads, "dtype": args.dtype,
                               "load_avg_1m_at_end": os.getloadavg()[0], "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
