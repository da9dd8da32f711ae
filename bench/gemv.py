"""Batch-1 weight products: cuBLAS (what model.py runs without gemv_kernels) against gemv_kernels' tilings, per weight
shape of a model, on CUDA. Prints a table, writes JSON, and with --write-table the best tiling per shape into
fluxion_lite/gemv_configs.json (what gemv_kernels.config reads).

Each case runs as the decode step runs it: inside a CUDA graph of --calls calls, cycling over enough copies of the
weight that they do not fit in L2 (so every call reads HBM), timed by events over --repeats replays; the time per call
includes the gap between dependent kernels in a graph. The cuBLAS side of each op is model.py's: F.linear (+ bias),
addmm_ into the residual, F.linear then dense_kernels.silu_mul for gate/up.

Usage (H200): python bench/gemv.py --shapes llama3.1-8b qwen2.5-7b qwen2.5-coder-0.5b --write-table
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fluxion_lite.model import gemv_kernels  # noqa: E402
from fluxion_lite.model import dense_kernels

# (d_model, q/k/v rows, Hq D, d_ff, vocabulary, q/k/v bias)
MODELS = {
    "llama3.1-8b": (4096, 6144, 4096, 14336, 128256, False),
    "qwen2.5-7b": (3584, 4608, 3584, 18944, 152064, True),
    "qwen2.5-coder-0.5b": (896, 1152, 896, 4864, 151936, True),
}
BLOCK_N = (2, 4, 8, 16)
BLOCK_K = (256, 512, 1024)
WARPS = (4, 8)
L2_MARGIN_BYTES = 256 << 20  # copies of a weight up to at least this much, so that no call hits L2


def ops_of(name: str) -> list[tuple[str, str, int, int, bool]]:
    """(op label, kind, n, k, bias) for each weight product of one decode layer plus the vocabulary."""
    d, qkv, hqd, ff, vocab, bias = MODELS[name]
    return [("qkv", "plain", qkv, d, bias), ("q-ahead", "plain", hqd, d, bias), ("o (+res)", "add", d, hqd, False),
            ("gate/up+silu", "silu", ff, d, False), ("down (+res)", "add", d, ff, False),
            ("vocab", "plain", vocab, d, False)]


def time_graph(fn: Callable[[int], None], copies: int, calls: int, repeats: int) -> float:
    """Median us per call of fn(i) (i cycles over the weight copies) captured as one graph of `calls` calls."""
    for i in range(3):  # compile, warm
        fn(i % copies)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i % copies)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    del graph
    return statistics.median(times)


def case(kind: str, n: int, k: int, with_bias: bool, dtype: torch.dtype, calls: int, repeats: int,
         configs: list[tuple[int, int, int]]) -> dict:
    rows = 2 * n if kind == "silu" else n
    nbytes = rows * k * dtype.itemsize
    copies = max(2, -(-L2_MARGIN_BYTES // nbytes))
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    ws = [torch.randn(rows, k, device="cuda", dtype=dtype, generator=gen) / k**0.5 for _ in range(copies)]
    x = torch.randn(1, k, device="cuda", dtype=dtype, generator=gen)
    bias = torch.randn(rows, device="cuda", dtype=dtype, generator=gen) if with_bias else None
    res = torch.randn(1, n, device="cuda", dtype=dtype, generator=gen)
    w_t = [w.t() for w in ws]

    def cublas(i: int) -> None:
        if kind == "add":
            res.addmm_(x, w_t[i])
        elif kind == "silu":
            dense_kernels.silu_mul(F.linear(x, ws[i]))
        else:
            F.linear(x, ws[i], bias)

    tiles: tuple[int, int, int] | None = None  # the tiling under test (the kernels' `tiles`: FLUXION_GEMV_CONFIG)

    def kernel(i: int) -> None:
        if kind == "add":
            gemv_kernels.gemv_add_(res, x, ws[i], tiles=tiles)
        elif kind == "silu":
            gemv_kernels.gemv_silu_mul(x, ws[i], tiles=tiles)
        else:
            gemv_kernels.gemv(x, ws[i], bias, tiles=tiles)

    # the two agree (one check per case; tests/kernels/test_gemv_kernels.py holds the float64 references)
    if kind == "add":
        res0 = res.clone()
        cublas(0)
        want = res.clone()
        res.copy_(res0)
        kernel(0)
        err = float((res.float() - want.float()).abs().max() / want.float().abs().max())
        res.copy_(res0)
    else:
        a = dense_kernels.silu_mul(F.linear(x, ws[0])) if kind == "silu" else F.linear(x, ws[0], bias)
        b = gemv_kernels.gemv_silu_mul(x, ws[0]) if kind == "silu" else gemv_kernels.gemv(x, ws[0], bias)
        err = float((a.float() - b.float()).abs().max() / a.float().abs().max())
    out = {"kind": kind, "n": n, "k": k, "bytes": nbytes, "max_rel_diff": err,
           "cublas_us": time_graph(cublas, copies, calls, repeats), "configs": {}}
    for cfg in configs:
        tiles = cfg
        try:
            out["configs"][",".join(map(str, cfg))] = time_graph(kernel, copies, calls, repeats)
        except Exception as exc:  # a tiling that does not compile (registers, shared memory) is skipped, not fatal
            out["configs"][",".join(map(str, cfg))] = None
            print(f"  {kind} {n}x{k} {cfg}: {type(exc).__name__}: {str(exc)[:100]}", flush=True)
    timed = {c: t for c, t in out["configs"].items() if t is not None}
    best = min(timed, key=timed.get)
    out |= {"best": [int(v) for v in best.split(",")], "best_us": timed[best],
            "default_us": timed.get(",".join(map(str, gemv_kernels.DEFAULT_CONFIG)))}
    return out


def write_table(rows: list[dict], meta: dict) -> None:
    """The fastest tiling per (kernel, weight shape) into gemv_kernels.TABLE, one line per entry. The residual-add
    products run the plain kernel, so they share its key; where two ops share a shape the faster tiling wins."""
    best: dict[str, tuple[list[int], float]] = {}
    for r in rows:
        key = f"{'silu' if r['kind'] == 'silu' else 'plain'}:{r['n']}x{r['k']}"
        if key not in best or r["best_us"] < best[key][1]:
            best[key] = (r["best"], r["best_us"])
    entries = ",\n".join(f'  "{key}": {json.dumps(cfg)}' for key, (cfg, _) in sorted(best.items()))
    measured = json.dumps(meta | {"by": "bench/gemv.py"})
    gemv_kernels.TABLE.write_text(f'{{\n "measured": {measured},\n "configs": {{\n{entries}\n }}\n}}\n')
    print(f"wrote {gemv_kernels.TABLE}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["llama3.1-8b"], choices=list(MODELS))
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--calls", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out", default="bench/results/gemv.json")
    ap.add_argument("--write-table", action="store_true", help="write the best tilings to gemv_kernels.TABLE")
    ap.add_argument("--table-from", default=None, help="only rewrite the table from this earlier --out JSON")
    args = ap.parse_args()
    if args.table_from:  # no GPU needed: the sweep's rows are in the file
        saved = json.loads(Path(args.table_from).read_text())
        write_table(saved["rows"], saved["meta"])
        return
    if not torch.cuda.is_available() or gemv_kernels.triton is None:
        sys.exit("error: bench/gemv.py needs CUDA and Triton")
    dtype = getattr(torch, args.dtype)
    configs = list(itertools.product(BLOCK_N, BLOCK_K, WARPS))
    rows = []
    print(f"{'model':20} {'op':14} {'weight':>13} {'MB':>7} {'cuBLAS us':>10} {'best us':>8} {'best tiling':>12} "
          f"{'speedup':>8} {'TB/s':>6}", flush=True)
    for name in args.shapes:
        for label, kind, n, k, bias in ops_of(name):
            r = case(kind, n, k, bias, dtype, args.calls, args.repeats, configs)
            r |= {"model": name, "op": label}
            rows.append(r)
            print(f"{name:20} {label:14} {f'{n}x{k}':>13} {r['bytes'] / 1e6:7.1f} {r['cublas_us']:10.2f} "
                  f"{r['best_us']:8.2f} {','.join(map(str, r['best'])):>12} {r['cublas_us'] / r['best_us']:7.2f}x "
                  f"{r['bytes'] / r['best_us'] / 1e6:6.2f}  (diff {r['max_rel_diff']:.1e})", flush=True)
    meta = {"device": torch.cuda.get_device_name(), "dtype": args.dtype, "calls": args.calls,
            "repeats": args.repeats, "torch": torch.__version__}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {args.out}")
    if args.write_table:
        write_table(rows, meta)


if __name__ == "__main__":
    main()
