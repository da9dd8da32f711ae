"""Per-kernel and per-layer times of one decode step from a chrome trace that `bench/tpot.py --kernel-profile F`
wrote (F's stem + .<mode>.<context>.<batch>.trace.json; gzipped as .json.gz is read too): which kernels the captured step spends its time in, and
how long each layer's sparse part holds the main chain.

Steps are split at the vocabulary GEMM (the one kernel per step whose name matches --head, default cuBLAS's
256x8 tile that the 8B shape's logits use); the step after the first one is shown. Per layer: the time from the
end of append_token (the layer's K/V written, retrieval may start) to the start of combine (both parts merged),
which is what the retrieval chain adds to the layer, and the layer period (append_token to append_token). With the
early block choice the layer's block_attention runs twice: the fetch (stage 1) on the early stream during the
previous layer's MLP and the attention (stage 2) right after append_token.

  python research/trace_layers.py bench/results/tpot_trace_h200_7a25f73_early{0,1}.json.gz \
      bench/results/tpot_trace_h200_886a969_broadcast.json.gz --out bench/results/tpot_trace_layers_h200.json
"""
from __future__ import annotations

import argparse
import gzip
import json
import statistics
from pathlib import Path


def step_kernels(trace: dict, head: str) -> list[dict]:
    """The kernels of the second step in the trace, in start order."""
    kernels = sorted((e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "kernel"),
                     key=lambda e: e["ts"])
    if head == "longest":  # the vocabulary product is the step's longest kernel (gemv_kernels' runs unnamed)
        longest = max(e["dur"] for e in kernels)
        heads = [i for i, e in enumerate(kernels) if e["dur"] >= 0.6 * longest]
    else:
        heads = [i for i, e in enumerate(kernels) if head in e["name"]]
    if len(heads) < 2:
        raise SystemExit(f"fewer than two kernels named like {head!r}: not a trace of two whole steps")
    return kernels[heads[0] + 1: heads[1] + 1]


def analyse(step: list[dict]) -> dict:
    by_name: dict[str, list[float]] = {}
    for e in step:
        name = e["name"][:48]
        if "gemv" in name:  # one kernel for several weights: told apart by their grids
            name = f"{name} grid {e['args']['grid'][0]}"
        by_name.setdefault(name, []).append(e["dur"])
    appends = [e for e in step if "_append_token" in e["name"]]
    combines = [e for e in step if "_combine" in e["name"]]
    chain = [c["ts"] - (a["ts"] + a["dur"]) for a, c in zip(appends, combines)]
    periods = [b["ts"] - a["ts"] for a, b in zip(appends, appends[1:])]
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in step)
    busy, (lo, hi) = 0.0, spans[0]
    for s0, s1 in spans[1:]:  # the union of kernel intervals on all streams
        if s0 > hi:
            busy, lo, hi = busy + hi - lo, s0, s1
        else:
            hi = max(hi, s1)
    busy += hi - lo
    return {
        "busy_us": busy,
        "step_us": step[-1]["ts"] + step[-1]["dur"] - step[0]["ts"],
        "kernels": {n: {"count": len(v), "median_us": statistics.median(v), "sum_us": sum(v)}
                    for n, v in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))},
        "retrieval_chain_us": chain,
        "layer_period_us": periods,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--head", default="256x8", help="a name part of the one vocabulary GEMM per step, or 'longest' "
                    "(the step's longest kernel: with gemv_kernels the vocabulary is an unnamed _gemv_kernel)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    results = {}
    for path in args.traces:
        raw = gzip.decompress(Path(path).read_bytes()) if path.endswith(".gz") else Path(path).read_bytes()
        r = analyse(step_kernels(json.loads(raw), args.head))
        results[Path(path).name] = r
        print(f"== {Path(path).name}: step {r['step_us']:.0f} us (GPU span, profiled), some kernel running "
              f"{r['busy_us']:.0f} us")
        print(f"   retrieval chain per layer: median {statistics.median(r['retrieval_chain_us']):.1f} us, "
              f"sum {sum(r['retrieval_chain_us']):.0f} us; layer period median "
              f"{statistics.median(r['layer_period_us']):.1f} us, sum {sum(r['layer_period_us']):.0f} us")
        for name, k in list(r["kernels"].items())[:16]:
            print(f"   {name:<60} n={k['count']:>3} median {k['median_us']:6.1f} us  sum {k['sum_us']:7.1f} us")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
