"""Prefill and decode speed on this CPU, ours vs llama.cpp (llama-cpp-python) on the same GGUF, in one run.

For each model and context length N: prefill N tokens of essay text (tokens/s), then decode D tokens greedily with
EOS ignored (tokens/s, median-free: total time over D steps). Both engines use --threads (default: torch's thread count)
and --dtype / their default types. Decode is also reported per CPU second of this process (`cpu` columns): on a
shared machine, wall time includes waiting for a core that other work holds, CPU time does not. With --threads 1 the
CPU rate is each engine's own single-core speed; with more threads it also counts spinning workers.

Also per model: load time and the process's resident memory after loading and after each context's decode, above
its baseline after imports (RSS, from /proc; the GGUF file's pages count once they are read: memory-mapped weights
are the file's pages), next to the file's size plus that context's KV cache (fp32). Our runs come first, every
context and mode, then llama.cpp's in the same process, so the RSS columns are ours alone. --attention takes several
of our modes; each is compared with the same llama.cpp run (full attention). TPOT = 1 / decode rate.

Usage: python bench/speed.py [--models ...] [--contexts 512 4096] [--decode 32] [--threads 2] [--dtype auto]
                             [--attention full [fluxion]] [--out ...]
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
from fluxion_lite.hub.resolve import resolve_model
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
    ap.add_argument("--torch-threads", type=int, default=0,
                    help="torch's intra-op threads in our engine if not --threads (the native pool keeps --threads)")
    ap.add_argument("--attention", nargs="+", default=["full"], choices=["full", "fluxion"],
                    help="our attention modes, each against the same llama.cpp run (which is full attention)")
    ap.add_argument("--out", default=None, help="default bench/results/speed[_<dtype>].json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
        native.set_threads(args.threads)
    threads = torch.get_num_threads()
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    base_rss = rss_bytes()
    rows = []
    print(f"machine: {platform.node()} {platform.processor()} cores={os.cpu_count()} torch threads={threads}")
    print(f"{'model':<20}{'ctx':>6} {'mode':<8}{'prefill tok/s':>15}{'llama.cpp':>11}{'ratio':>7}{'TPOT ms':>10}"
          f"{'llama.cpp':>11}{'ratio':>7}{'tok/cpu-s':>8}{'llama.cpp':>11}{'ratio':>7}{'RSS MiB':>9}{'file+KV':>11}")
    for name in args.models:
        t_load = time.perf_counter()
        engine = Engine(name, dtype=args.dtype, attention=args.attention[0], prefill_chunk=512,
                        prefix_cache_entries=0)
        load_s = time.perf_counter() - t_load
        load_rss = rss_bytes() - base_rss
        file_bytes = engine.model_path.stat().st_size
        kv_per_token = engine.config.kv_bytes_per_token(4)  # the dense CPU cache is fp32
        print(f"{name}: loaded in {load_s:.2f} s, RSS +{load_rss / 2**20:.0f} MiB (file {file_bytes / 2**20:.0f} MiB)")
        assert engine.tokenizer is not None
        text_ids = engine.tokenizer.encode(essay_text()[: max(args.contexts) * 8], add_special=True)
        # ours first, every context and mode, then llama.cpp in the same process: the RSS columns are ours alone
        mine: dict[tuple[int, str], dict] = {}
        for n in args.contexts:
            for mode in args.attention:
                if engine.attention_mode != mode:
                    engine.set_attention(mode)
                p, d, c = ours(engine, text_ids[:n], args.decode)
                mine[n, mode] = {"prefill_tps": p, "decode_tps": d, "tpot_ms": 1000 / d, "decode_tok_per_cpu_s": c,
                                 "rss_after_bytes": rss_bytes() - base_rss, "kv_bytes": kv_per_token * n}
        del engine
        peer = load_peer(resolve_model(name, pull_missing=False), n_ctx=max(args.contexts) + args.decode + 8,
                         n_threads=threads,
                         logits_all=False)
        for n in args.contexts:
            p_peer, d_peer, c_peer = peer_speed(peer, text_ids[:n], args.decode)
            for mode in args.attention:
                m = mine[n, mode]
                row = {"model": name, "context": n, "attention": mode, **m, "prefill_tps_llamacpp": p_peer,
                       "decode_tps_llamacpp": d_peer, "tpot_ms_llamacpp": 1000 / d_peer,
                       "tpot_ratio": m["tpot_ms"] / (1000 / d_peer), "decode_tok_per_cpu_s_llamacpp": c_peer,
                       "load_s": load_s, "load_rss_bytes": load_rss, "file_bytes": file_bytes}
                rows.append(row)
                print(f"{name:<20}{n:>6} {mode:<8}{m['prefill_tps']:>15.1f}{p_peer:>11.1f}{m['prefill_tps'] / p_peer:>7.2f}"
                      f"{m['tpot_ms']:>10.1f}{1000 / d_peer:>11.1f}{row['tpot_ratio']:>7.2f}"
                      f"{m['decode_tok_per_cpu_s']:>8.1f}{c_peer:>11.1f}{m['decode_tok_per_cpu_s'] / c_peer:>7.2f}"
                      f"{m['rss_after_bytes'] / 2**20:>9.0f}{(file_bytes + m['kv_bytes']) / 2**20:>11.0f}", flush=True)
        del peer
    suffix = "" if args.attention == ["full"] else "_" + "_".join(args.attention)
    out = Path(args.out or f"bench/results/speed_{args.dtype}{suffix}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    out.write_text(json.dumps({"machine": platform.node(), "cpu": cpu, "threads": threads, "dtype": args.dtype,
                               "torch_threads": torch.get_num_threads(),
                               "attention": args.attention,
                               "load_avg_1m_at_end": os.getloadavg()[0], "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
