"""Block choice of the fused device step: torch.topk vs device_topk.select_top, device time per call.

Rows of Quest scores like the decode step's (B rows x Hkv groups x NB blocks, PIN_SHARE pinned at PINNED_SCORE, sink and
window blocks -inf), k = 5% of the blocks. Each variant is captured in a CUDA graph of 32 calls (one per layer, as
in the decode graph) and replayed; the table gives microseconds per call (median of the replays) and the ratio.
"reuse" adds the reuse cache's bookkeeping (reuse_cache.py): the calls alternate between two score tensors whose
choices overlap (the second is the first plus noise), so some blocks hit and some miss, as in decode.
  python research/topk_select.py [--blocks 2048 4096 8192] [--batches 1 4 8 16] [--hkv 8] [--out F]
Prints a table and writes --out (default bench/results/topk_select_<device>.json). CUDA only.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import torch

from fluxion_lite.sparse.device import topk as device_topk
from fluxion_lite.sparse.device.summaries import PINNED_SCORE
from fluxion_lite.sparse.device.reuse_cache import DeviceReuseCache

LAYERS = 32  # calls per captured graph
PIN_SHARE = 0.0375  # pinned blocks: three quarters of a 5% budget (pin_pool.py), so a quarter is chosen per step


def scores_like_decode(b: int, hkv: int, nb: int, gen: torch.Generator) -> torch.Tensor:
    s = torch.randn(b, hkv, nb, generator=gen) * 40.0
    s[..., :1] = float("-inf")  # sink and window blocks are not eligible
    s[..., -4:] = float("-inf")
    pinned = torch.rand(b, hkv, nb, generator=gen) < PIN_SHARE
    return torch.where(pinned, torch.full_like(s, PINNED_SCORE), s)


def time_graph(fn: object, reps: int) -> float:
    """Microseconds per call: a graph of LAYERS calls, replayed reps times, median."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()  # type: ignore[operator]  # compile and warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(LAYERS):
            fn()  # type: ignore[operator]
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / LAYERS)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, nargs="+", default=[2048, 4096, 8192])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available() or device_topk.triton is None:
        sys.exit("research/topk_select.py needs CUDA and Triton")
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    rows = []
    print(f"{'blocks':>7} {'B':>3} {'k':>5} {'torch.topk us':>14} {'select_top us':>14} {'ratio':>6} "
          f"{'+reuse us':>10} {'hits':>5}")
    for nb in args.blocks:
        for b in args.batches:
            width = math.ceil(0.05 * nb)
            scores = scores_like_decode(b, args.hkv, nb, gen).to(dev)
            # the next step's scores: the same blocks, a little noise, so most choices repeat (not pinned ones)
            noisy = torch.randn(scores.shape, generator=gen).to(dev) * 8.0
            scores2 = torch.where(scores == PINNED_SCORE, scores, scores + noisy)
            k_row = torch.full((b, args.hkv), width, dtype=torch.long, device=dev)
            ids = torch.empty(b, args.hkv, width, dtype=torch.long, device=dev)
            vals = torch.empty(b, args.hkv, width, dtype=torch.float32, device=dev)
            t_torch = time_graph(lambda: scores.topk(width, dim=-1), args.reps)
            t_select = time_graph(lambda: device_topk.select_top(scores, k_row, ids, vals), args.reps)
            top = scores.topk(width, dim=-1)  # same blocks (random scores: ties only among pinned blocks)
            same = bool(torch.equal(top.values.sort(-1).values, vals.sort(-1).values))
            cache = DeviceReuseCache(1, args.hkv, 16, 128, torch.bfloat16, dev)
            assert cache.ensure(b, nb, (width,))
            cache.start_step(("bench",))
            views = cache.views(0, width)
            turn = [0]

            def with_reuse() -> None:
                turn[0] ^= 1  # alternate at capture: the graph's calls alternate too
                device_topk.select_top(scores2 if turn[0] else scores, k_row, ids, vals, views)

            t_reuse = time_graph(with_reuse, args.reps)
            chosen = int((vals > float("-inf")).sum() - (vals == PINNED_SCORE).sum())
            hits_share = int(views.hit[: b * args.hkv * width].sum()) / max(chosen, 1)  # the last call's hits
            rows.append({"blocks": nb, "batch": b, "hkv": args.hkv, "k": width, "torch_topk_us": t_torch,
                         "select_top_us": t_select, "select_top_reuse_us": t_reuse, "reuse_hit_share": hits_share,
                         "same_scores": same})
            print(f"{nb:>7} {b:>3} {width:>5} {t_torch:>14.2f} {t_select:>14.2f} {t_torch / t_select:>5.2f}x "
                  f"{t_reuse:>10.2f} {hits_share:>5.2f}" + ("" if same else "  MISMATCH"))
    out = args.out or (Path(__file__).parent / "results"
                       / f"topk_select_{torch.cuda.get_device_name().split()[-1].lower()}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "layers_per_graph": LAYERS,
                               "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
