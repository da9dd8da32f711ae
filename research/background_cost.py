"""What the unread-background term (plan.background, native.background) costs a decode step on the CPU path, next to
the top-k and the sparse attention it follows.

Per context length: one host store of --layers layers holding one sequence of random bf16 K/V (the model's KV shape,
value sums kept), random fp32 queries; per layer call, one retrieval task per KV group at block size --g and budget
--budget (sink 16 and window 64 excluded), as the shipped 0.5b plan's retrieval groups read. Times the median of
--repeats calls (layers rotating, so the reads come from memory, not cache) of:
  topk        native.group_topk over the 16-token summaries of every block (the scan the term repeats)
  attention   native.sparse_attention over the selected blocks
  background  native.background over what the selection left unread (16-token summaries + value sums)
and prints ms per call, the term over topk + attention, and the bytes each reads. Writes JSON with --out.

Usage: python research/background_cost.py [--lengths 4096 8192 16384 32768] [--kv-heads 2 --group 7 --head-dim 64]
                                       [--threads 2] [--out bench/results/background_cost_vm.json]
"""
from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # the product benchmarks they build on
sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels import timed  # noqa: E402  (scripts import each other by name)
from ruler_paired import write_out  # noqa: E402

from fluxion_lite.hostkv import native  # noqa: E402
from fluxion_lite.hostkv.store import HostKVStore  # noqa: E402


def one_length(args: argparse.Namespace, n: int) -> dict[str, float]:
    hkv, r, d, g = args.kv_heads, args.group, args.head_dim, args.g
    store = HostKVStore(args.layers, hkv, d, dtype=torch.bfloat16, max_seqs=1, page_tokens=256,
                        initial_pages_per_seq=-(-n // 256), value_sums=True)
    slot = store.allocate()
    gen = torch.Generator().manual_seed(n)
    for layer in range(args.layers):
        for s in range(0, n, 4096):
            m = min(4096, n - s)
            store.append(layer, slot, torch.randn(m, hkv, d, generator=gen).bfloat16(),
                         torch.randn(m, hkv, d, generator=gen).bfloat16())
    q = torch.randn(1, hkv * r, d, generator=gen).numpy()
    k = int(np.ceil(args.budget * n / g))
    tasks = native.make_tasks(slot, 0, np.arange(hkv), g, k, exclude=[(0, 16), (n - 64, n)])
    sel = [native.group_topk(store.view(layer), q, tasks) for layer in range(args.layers)]
    scale = d**-0.5
    at = {"i": 0}

    def layer() -> int:
        at["i"] = (at["i"] + 1) % args.layers
        return at["i"]

    def topk() -> None:
        native.group_topk(store.view(layer()), q, tasks)

    def attention() -> None:
        i = layer()
        native.sparse_attention(store.view(i), q, tasks, sel[i][0], sel[i][2], scale)

    def background() -> None:
        i = layer()
        native.background(store.view(i), q, tasks, sel[i][0], sel[i][2], scale)

    t = {name: timed(fn, args.repeats) for name, fn in
         (("topk", topk), ("attention", attention), ("background", background))}
    selected = int(sel[0][2].sum()) * g
    return {"tokens": n, "k_blocks": k,
            **{f"{name}_ms": s * 1e3 for name, s in t.items()},
            "background_over_topk_attention": t["background"] / (t["topk"] + t["attention"]),
            # bytes per call: K+V of the selected tokens; the 16-token summaries (min, max, 16-bit); the value sums
            "attention_bytes": selected * d * 2 * 2,
            "summary_bytes": hkv * -(-n // 16) * 2 * d * 2,
            "value_sum_bytes": hkv * -(-n // 128) * d * 4}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--group", type=int, default=7, help="query heads per KV head")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=8, help="layers of the store (calls rotate over them)")
    ap.add_argument("--g", type=int, default=16)
    ap.add_argument("--budget", type=float, default=0.05)
    ap.add_argument("--threads", type=int, default=None, help="native pool size (default: physical cores)")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.threads:
        native.set_threads(args.threads)
    rows = [one_length(args, n) for n in args.lengths]
    print(f"{platform.node()}: {native.get_threads()} threads, {native.get_simd()}, Hkv {args.kv_heads} x r "
          f"{args.group} x D {args.head_dim}, g {args.g}, budget {args.budget:g}; ms per layer call (median of "
          f"{args.repeats})")
    print(f"{'tokens':>7} {'topk':>8} {'attention':>10} {'background':>11} {'bg / (topk+attn)':>17} "
          f"{'KV read KiB':>12} {'summaries KiB':>14} {'value sums KiB':>15}")
    for r in rows:
        print(f"{r['tokens']:>7} {r['topk_ms']:8.3f} {r['attention_ms']:10.3f} {r['background_ms']:11.3f} "
              f"{r['background_over_topk_attention']:17.2f} {r['attention_bytes'] / 1024:12.0f} "
              f"{r['summary_bytes'] / 1024:14.0f} {r['value_sum_bytes'] / 1024:15.0f}")
    write_out(args.out, {"machine": platform.node(), "threads": native.get_threads(), "simd": native.get_simd(),
                         "args": {k: v for k, v in vars(args).items() if k != "out"}, "rows": rows})


if __name__ == "__main__":
    main()
