"""Per-call time of native.group_topk on short decode-like tasks (few blocks per task), where the fixed cost per
task, not memory, decides: 32 tasks (4 sequences x 8 KV heads, GQA 4, head_dim 128, bf16), the first block and the
last two excluded, k from the budget. Prints the median of --rounds rounds of --calls calls per case and writes JSON.

Usage: python bench/topk_short.py [--threads 1] [--out bench/results/topk_short-<host>.json]
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
from fluxion_lite import native  # noqa: E402
from fluxion_lite.host_kv import HostKVStore  # noqa: E402

CASES = [(5, 1, 128), (8, 3, 128), (16, 4, 128), (128, 8, 16), (256, 16, 32), (300, 20, 16)]  # blocks, k, g


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    native.set_threads(args.threads)
    hkv, r, d, seqs = 8, 4, 128, 4
    rows = []
    print(f"{'blocks':>7}{'k':>5}{'g':>5}{'us/call':>10}")
    for n_blocks, k, g in CASES:
        n = n_blocks * g
        store = HostKVStore(1, hkv, d, dtype=torch.bfloat16, max_seqs=seqs, page_tokens=256,
                            granularities=(16, 32, 64, 128))
        gen = torch.Generator().manual_seed(n)
        for _ in range(seqs):
            slot = store.allocate()
            kv = torch.randn(n, hkv, d, generator=gen).to(torch.bfloat16)
            store.append(0, slot, kv, kv)
        q = torch.randn(seqs, hkv * r, d, generator=gen)
        s_idx, h_idx = np.repeat(np.arange(seqs), hkv), np.tile(np.arange(hkv), seqs)
        tasks = native.make_tasks(s_idx, s_idx, h_idx, g, k, exclude=[(0, g), (n - 2 * g, n)])
        view = store.view(0)
        native.group_topk(view, q, tasks)  # warm-up
        medians = []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            for _ in range(args.calls):
                native.group_topk(view, q, tasks)
            medians.append((time.perf_counter() - t0) / args.calls * 1e6)
        us = statistics.median(medians)
        rows.append({"blocks": n_blocks, "k": k, "g": g, "tasks": len(tasks), "us_per_call": us})
        print(f"{n_blocks:>7}{k:>5}{g:>5}{us:>10.1f}")
    out = Path(args.out or Path(__file__).resolve().parent / "results" / f"topk_short-{platform.node() or 'host'}.json")
    out.write_text(json.dumps({"threads": args.threads, "simd": native.get_simd(), "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
