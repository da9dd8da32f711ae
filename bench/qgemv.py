"""Quantized-weight decode products (fluxion_lite/model/qgemv_kernels.py) on CUDA, per Llama-3.1-8B Q4_K_M weight
shape, at M = 1, 8, 16 rows of x: each kernel with its default tiling and a small sweep of (BLOCK_N, PE, num_warps),
against the same shape in bf16 through gemv_kernels (M = 1) and torch's matmul (every M). Prints a table (us per
call, effective GB/s of the weight bytes read, fraction of the card's peak bandwidth) and writes JSON.

Each case runs as a decode step would: `--calls` calls captured in one CUDA graph, cycling over enough copies of the
weight that they exceed L2 (at least 256 MB, so every call reads HBM), timed with CUDA events around graph replays;
the median over `--repeats` replays, divided by the calls. Weights are random blocks with finite f16 scales; before
timing, the first rows of each kernel's output are checked against the native CPU dequantizer (when the native
library is built) in float64.

Usage: python bench/qgemv.py --out bench/results/qgemv_h100.json [--m 1 8 16] [--sweep] [--peak-gbps 3350]
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from fluxion_lite.model import gemv_kernels  # noqa: E402
from fluxion_lite.model import qgemv_kernels as qk  # noqa: E402
from gemv import time_graph  # noqa: E402  (the bf16 kernels' bench: the same graph timing)

# (op, kernel kind, weight rows, k, type): the kind is qk's entry point ("silu": rows = 2F, gate then up)
LLAMA31_8B = [
    ("qkv", "plain", 6144, 4096, qk.Q4_K),
    ("o (+res)", "add", 4096, 4096, qk.Q4_K),
    ("gate/up+silu", "silu", 28672, 4096, qk.Q4_K),
    ("down (+res)", "add", 4096, 14336, qk.Q6_K),
    ("output", "plain", 128256, 4096, qk.Q6_K),
]
L2_MARGIN_BYTES = 256 << 20
PEAK_GBPS = {"H100": 3350.0, "H200": 4800.0}  # vendor HBM bandwidth (SXM)
SWEEP_M1 = list(itertools.product((8, 16), (8, 32), (4, 8)))  # (BLOCK_N, PE, num_warps)
SWEEP_MANY = list(itertools.product((4, 8, 16), (2, 4), (4,)))


def random_weight(wtype: int, n: int, k: int, seed: int) -> torch.Tensor:
    """uint8 [n, row_bytes] on the GPU: random integer parts, finite positive f16 scales (and mins)."""
    name, block, nbytes = qk.TYPES[wtype]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    blocks = torch.randint(0, 256, (n, k // block, nbytes), dtype=torch.uint8, device="cuda", generator=gen)

    def f16(lo: float, hi: float) -> torch.Tensor:
        v = torch.rand(n, k // block, 1, device="cuda", generator=gen) * (hi - lo) + lo
        return v.half().view(torch.uint8)  # [n, blocks, 2]

    if wtype == qk.Q6_K:
        blocks[:, :, 208:210] = f16(2e-4, 2e-3)
    else:
        blocks[:, :, 0:2] = f16(1e-4, 1e-3) if block == 256 else f16(1e-3, 1e-2)
        if wtype in (qk.Q4_K, qk.Q5_K, qk.Q4_1, qk.Q5_1):
            blocks[:, :, 2:4] = f16(1e-4, 1e-3) if block == 256 else f16(-0.1, 0.1)
    return blocks.view(n, -1)


def check(kind: str, x: torch.Tensor, w: qk.QuantMatrix, out: torch.Tensor, res0: torch.Tensor) -> float | None:
    """Max over the first 64 output columns of |error| / (3e-5 sum |x| |w| + 2^-8 |y|), the tests' bound (<= 1:
    within it), against the native CPU dequantizer in float64; None where the native library is not built."""
    try:
        from fluxion_lite.hostkv import quant
    except Exception:  # noqa: BLE001 - the C extension is not built on this host
        return None
    rows = 64
    idx = list(range(rows)) + ([w.n_rows // 2 + r for r in range(rows)] if kind == "silu" else [])
    w64 = torch.from_numpy(quant.dequantize(w.wtype, w.data[idx].cpu().numpy(), w.k)).double()  # [rows(, x2), K]
    x64 = x.double().cpu()
    y = x64 @ w64.T
    e = 3e-5 * (x64.abs() @ w64.abs().T)
    if kind == "silu":
        g, u, eg, eu = y[:, :rows], y[:, rows:], e[:, :rows], e[:, rows:]
        silu = g / (1.0 + torch.exp(-g))
        want, e = silu * u, 1.1 * eg * (u.abs() + eu) + silu.abs() * eu
    elif kind == "add":
        want = y + res0[:, :rows].double().cpu()
    else:
        want = y
    got = out[:, :rows].double().cpu()
    return float(((got - want).abs() / (e + want.abs() * 2.0 ** -8 + 1e-30)).max())


def case(op: str, kind: str, n: int, k: int, wtype: int, m: int, calls: int, repeats: int,
         sweep: list[qk.Tiles]) -> dict:
    rb = qk.TYPES[wtype][2] * (k // qk.TYPES[wtype][1])
    qbytes = n * rb
    copies = max(2, -(-L2_MARGIN_BYTES // qbytes))
    ws = [qk.QuantMatrix(wtype, random_weight(wtype, n, k, seed=i), n, k) for i in range(copies)]
    gen = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    f = n // 2
    res = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, generator=gen)
    res0 = res.clone()
    tiles: qk.Tiles | None = None

    def quant_call(i: int) -> torch.Tensor:
        if kind == "add":
            return qk.qgemv_add_(res, x, ws[i], tiles=tiles)
        if kind == "silu":
            return qk.qgemv_silu_mul(x, ws[i], tiles=tiles)
        return qk.qgemv(x, ws[i], tiles=tiles)

    out = quant_call(0)
    err = check(kind, x, ws[0], out, res0)
    res.copy_(res0)
    result = {"op": op, "kind": kind, "type": qk.TYPES[wtype][0], "n": n, "k": k, "m": m, "weight_bytes": qbytes,
              "copies": copies, "max_err_over_bound": err, "default_tiles": list(qk.default_tiles(wtype, m)),
              "launch_shape": list(qk.launch_shape(wtype, qk.default_tiles(wtype, m), x.dtype))}
    result["quant_us"] = time_graph(lambda i: quant_call(i), copies, calls, repeats)
    result["sweep"] = {}
    for cfg in sweep:
        tiles = cfg
        try:
            result["sweep"][",".join(map(str, cfg))] = time_graph(lambda i: quant_call(i), copies, calls, repeats)
        except Exception as exc:  # a tiling that does not compile (registers, shared memory) is skipped
            result["sweep"][",".join(map(str, cfg))] = None
            print(f"  {op} m={m} {cfg}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
    tiles = None
    timed = {c: t for c, t in result["sweep"].items() if t is not None}
    if timed:
        best = min(timed, key=timed.get)
        result["best_tiles"], result["best_us"] = [int(v) for v in best.split(",")], timed[best]
    del ws
    torch.cuda.empty_cache()

    # bf16 baselines on the same shape
    bbytes = n * k * 2
    bcopies = max(2, -(-L2_MARGIN_BYTES // bbytes)) if bbytes < (8 << 30) else 1
    wb = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(bcopies)]
    wt = [w.t() for w in wb]

    def torch_call(i: int) -> None:
        if kind == "add":
            res.addmm_(x, wt[i])
        elif kind == "silu":
            y = F.linear(x, wb[i])
            F.silu(y[:, :f]) * y[:, f:]
        else:
            F.linear(x, wb[i])

    result["bf16_bytes"] = bbytes
    result["torch_bf16_us"] = time_graph(torch_call, bcopies, calls, repeats)
    if m == 1 and gemv_kernels.triton is not None:
        def gemv_call(i: int) -> None:
            if kind == "add":
                gemv_kernels.gemv_add_(res, x, wb[i])
            elif kind == "silu":
                gemv_kernels.gemv_silu_mul(x, wb[i])
            else:
                gemv_kernels.gemv(x, wb[i])

        result["gemv_bf16_us"] = time_graph(gemv_call, bcopies, calls, repeats)
    del wb, wt
    torch.cuda.empty_cache()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON results path")
    ap.add_argument("--m", type=int, nargs="+", default=[1, 8, 16], help="rows of x (<= 16)")
    ap.add_argument("--ops", nargs="+", default=None, help="a subset of the op labels (default: all)")
    ap.add_argument("--sweep", action="store_true", help="also time SWEEP_M1 / SWEEP_MANY tilings")
    ap.add_argument("--calls", type=int, default=50, help="calls per graph replay")
    ap.add_argument("--repeats", type=int, default=30, help="graph replays timed (median)")
    ap.add_argument("--peak-gbps", type=float, default=None, help="the card's HBM GB/s (default: H100 3350, H200 4800)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench/qgemv.py needs a CUDA GPU (torch.cuda.is_available() is False); nothing was measured",
              file=sys.stderr)
        sys.exit(2)
    if qk.triton is None:
        print("bench/qgemv.py needs Triton, which is not installed", file=sys.stderr)
        sys.exit(2)
    name = torch.cuda.get_device_name()
    peak = args.peak_gbps or next((v for key, v in PEAK_GBPS.items() if key in name), None)
    if peak is None:
        sys.exit(f"unknown card {name!r}: pass --peak-gbps")
    import triton

    meta = {"device": name, "peak_gbps": peak, "torch": torch.__version__, "triton": triton.__version__,
            "calls": args.calls, "repeats": args.repeats}
    print(f"{name}, peak {peak:.0f} GB/s, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    rows = []
    hdr = (f"{'op':14s} {'type':5s} {'m':>2s} {'quant us':>9s} {'GB/s':>6s} {'peak':>5s} {'best us':>8s}"
           f" {'best tiles':>11s} {'bf16 gemv':>9s} {'bf16 torch':>10s} {'err':>6s}")
    print(hdr, flush=True)
    for (op, kind, n, k, wtype), m in itertools.product(LLAMA31_8B, args.m):
        if args.ops and op not in args.ops:
            continue
        sweep = (SWEEP_M1 if m == 1 else SWEEP_MANY) if args.sweep else []
        r = case(op, kind, n, k, wtype, m, args.calls, args.repeats, sweep)
        gbps = r["weight_bytes"] / r["quant_us"] / 1e3
        r |= {"quant_gbps": gbps, "quant_peak_fraction": gbps / peak,
              "torch_bf16_gbps": r["bf16_bytes"] / r["torch_bf16_us"] / 1e3}
        if "best_us" in r:
            r["best_peak_fraction"] = r["weight_bytes"] / r["best_us"] / 1e3 / peak
        rows.append(r)
        best = (f"{r['best_us']:8.1f} {','.join(map(str, r['best_tiles'])):>11s}" if "best_us" in r
                else f"{'-':>8s} {'-':>11s}")
        gemv_us = f"{r['gemv_bf16_us']:9.1f}" if "gemv_bf16_us" in r else f"{'-':>9s}"
        err = f"{r['max_err_over_bound']:6.2g}" if r["max_err_over_bound"] is not None else f"{'-':>6s}"
        print(f"{op:14s} {r['type']:5s} {m:2d} {r['quant_us']:9.1f} {gbps:6.0f} {gbps / peak:5.0%} {best}"
              f" {gemv_us} {r['torch_bf16_us']:10.1f} {err}", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"meta": meta, "cases": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
