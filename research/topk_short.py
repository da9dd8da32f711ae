"""Per-call time of native.group_topk on short decode-like tasks (few blocks per task), where the fixed cost per
task, not memory, decides, for both block scorings on the same tasks: "group" (the bound of the summed query heads)
and "per-head" (r bounds per block, the best gap to each head's own best block).  Default shape: 32 tasks (4
sequences x 8 KV heads, GQA 4, head_dim 128, bf16); the first block and the last two excluded, k from the budget.
Each call gets the next of --queries distinct random queries, as in decode: with one query repeated, the branch
predictor learns its signs, which hid a mispredicted branch per query element (the group scoring's sign split before
b445bfb: 91 vs 15 us per call of 5-block tasks here).  The two scorings alternate round by round (the machine may be
shared); prints the median of --rounds rounds of --calls calls per case and scoring, and writes JSON.

Usage: python research/topk_short.py [--threads 1] [--kv-heads 8 --group 4 --head-dim 128]
                                  [--out bench/results/topk_short-<host>.json]
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fluxion_lite.hostkv import native  # noqa: E402
from fluxion_lite.hostkv.store import HostKVStore  # noqa: E402

CASES = [(5, 1, 128), (8, 3, 128), (16, 4, 128), (128, 8, 16), (256, 16, 32), (300, 20, 16), (2048, 102, 16)]
# blocks, k, g: decode steps at short contexts, then a 32K context at g = 16 with a 5% budget


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--group", type=int, default=4, help="query heads per KV head (r)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--queries", type=int, default=50, help="distinct queries cycled through by the calls")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    native.set_threads(args.threads)
    hkv, r, d, seqs = args.kv_heads, args.group, args.head_dim, 4
    rows = []
    print(f"Hkv={hkv} r={r} D={d} bf16, {seqs} sequences, threads={args.threads}, simd={native.get_simd()}")
    print(f"{'blocks':>7}{'k':>5}{'g':>5}{'tasks':>6}{'group us':>10}{'per-head us':>12}{'ratio':>7}")
    for n_blocks, k, g in CASES:
        n = n_blocks * g
        store = HostKVStore(1, hkv, d, dtype=torch.bfloat16, max_seqs=seqs, page_tokens=256,
                            granularities=(16, 32, 64, 128))
        gen = torch.Generator().manual_seed(n)
        for _ in range(seqs):
            slot = store.allocate()
            kv = torch.randn(n, hkv, d, generator=gen).to(torch.bfloat16)
            store.append(0, slot, kv, kv)
        qs = [torch.randn(seqs, hkv * r, d, generator=gen) for _ in range(args.queries)]
        s_idx, h_idx = np.repeat(np.arange(seqs), hkv), np.tile(np.arange(hkv), seqs)
        tasks = native.make_tasks(s_idx, s_idx, h_idx, g, k, exclude=[(0, g), (n - 2 * g, n)])
        view = store.view(0)
        calls = max(5, args.calls * 300 // max(300, n_blocks))  # long tasks: fewer calls per round
        times: dict[str, list[float]] = {"group": [], "per-head": []}
        for scoring in times:
            native.group_topk(view, qs[0], tasks, scoring=scoring)  # warm-up (and workspace growth)
        for _ in range(args.rounds):
            for scoring, samples in times.items():
                t0 = time.perf_counter()
                for i in range(calls):
                    native.group_topk(view, qs[i % len(qs)], tasks, scoring=scoring)
                samples.append((time.perf_counter() - t0) / calls * 1e6)
        us_g, us_p = statistics.median(times["group"]), statistics.median(times["per-head"])
        rows.append({"blocks": n_blocks, "k": k, "g": g, "tasks": len(tasks), "us_per_call": us_g,
                     "per_head_us_per_call": us_p, "per_head_ratio": us_p / us_g,
                     "summary_MB": len(tasks) * n_blocks * 2 * d * 4 / 1e6})
        print(f"{n_blocks:>7}{k:>5}{g:>5}{len(tasks):>6}{us_g:>10.1f}{us_p:>12.1f}{us_p / us_g:>7.2f}", flush=True)
        del store
    out = Path(args.out or Path(__file__).resolve().parent / "results" / f"topk_short-{platform.node() or 'host'}.json")
    out.write_text(json.dumps({"threads": args.threads, "simd": native.get_simd(), "kv_heads": hkv, "group": r,
                               "head_dim": d, "queries": args.queries, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
