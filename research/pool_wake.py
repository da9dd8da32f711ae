"""Per-call time of a decode-like native top-k after an idle gap, with the pool's default spin, with
native.wake_threads() ahead of the call, and with a spin longer than the gap (what the GPU decode step does).

Between the layers of a GPU decode step the host is idle for the device's share of a layer (0.2-1 ms). Pool
workers spin FX_SPIN_NS (200 us) and then sleep; a call that finds them asleep starts on its caller alone and the
others join late. The cases, each a median over --calls calls with a fresh query per call:

  back-to-back     calls one after another (workers always spinning): the kernel's own time
  gap              --gap-us of idle (time.sleep) before each call, default spin
  gap + wake       the same, with wake_threads() --lead-us before the call (the step wakes the pool before its D2H
                   wait)
  gap + long spin  spin raised to 4 x the gap (set_spin_us), no wake

Rounds alternate the cases (the machine may be shared). Shape: one 32K-token sequence, 8 KV heads, GQA 4, head_dim
128, bf16, g=16, 5% budget (the 8B decode shape of bench/tpot.py at batch 1).

Usage: python research/pool_wake.py [--threads N] [--gap-us 1000] [--out bench/results/pool_wake-<host>.json]
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


def pause(seconds: float) -> None:
    """Idle for `seconds` without holding a core: sleep most of it, spin-check the last part (sleep overshoots)."""
    end = time.perf_counter() + seconds
    if seconds > 200e-6:
        time.sleep(seconds - 150e-6)
    while time.perf_counter() < end:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=0, help="pool size (0: os.cpu_count())")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--gap-us", type=float, default=1000.0)
    ap.add_argument("--lead-us", type=float, default=150.0, help="wake this long before the call")
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import os
    threads = native.set_threads(args.threads or os.cpu_count() or 1)
    hkv, r, d, g, n = 8, 4, 128, 16, args.tokens
    store = HostKVStore(1, hkv, d, dtype=torch.bfloat16, max_seqs=1, page_tokens=256, granularities=(16, 32, 64, 128))
    slot = store.allocate()
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(n, hkv, d, generator=gen).to(torch.bfloat16)
    store.append(0, slot, kv, kv)
    tasks = native.make_tasks(slot, 0, np.arange(hkv), g, max(1, int(0.05 * n / g)))
    view = store.view(0)
    queries = [torch.randn(1, hkv * r, d, generator=gen) for _ in range(50)]
    gap, lead = args.gap_us * 1e-6, args.lead_us * 1e-6

    def timed(idle: float, wake: bool) -> float:
        times = []
        for i in range(args.calls):
            if idle:
                pause(idle - (lead if wake else 0.0))
                if wake:
                    native.wake_threads()
                    pause(lead)
            t0 = time.perf_counter()
            native.group_topk(view, queries[i % len(queries)], tasks)
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e6

    cases = ["back-to-back", "gap", "gap + wake", "gap + long spin"]
    per_round: dict[str, list[float]] = {c: [] for c in cases}
    for _ in range(args.rounds):
        per_round["back-to-back"].append(timed(0.0, False))
        per_round["gap"].append(timed(gap, False))
        per_round["gap + wake"].append(timed(gap, True))
        native.set_spin_us(4 * args.gap_us)
        per_round["gap + long spin"].append(timed(gap, False))
        native.set_spin_us(None)
    rows = {c: statistics.median(v) for c, v in per_round.items()}
    print(f"top-k, {n} tokens, Hkv={hkv} r={r} D={d} bf16 g={g} 5%, threads={threads}, simd={native.get_simd()}, "
          f"gap {args.gap_us:.0f} us, wake {args.lead_us:.0f} us ahead; median of {args.rounds} rounds x "
          f"{args.calls} calls")
    base = rows["back-to-back"]
    for c in cases:
        print(f"  {c:<16}{rows[c]:9.0f} us  {rows[c] / base:5.2f}x")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"host": platform.node(), "threads": threads, "tokens": n,
                                              "gap_us": args.gap_us, "lead_us": args.lead_us, "median_us": rows,
                                              "rounds_us": per_round, "command": " ".join(sys.argv)}, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
