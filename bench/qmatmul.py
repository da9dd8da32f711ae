"""Quantized-weight products (fluxion_lite/hostkv/quant.py, native/fx_quant*.c) against torch fp32 matmul of the same
shape, per GGUF weight type: ms per call and GB/s of weight read, next to this machine's read bandwidth on the same
thread pool (native.read_bandwidth_probe).

Shapes: qwen2.5-0.5b's decode products (q 896x896, k/v 128x896, gate/up 4864x896, down 896x4864, output
151936x896); the K types only where k is a multiple of 256 (down: 4864 = 19 x 256; llama.cpp's Q4_K_M files store
the 896-column tensors of this model as Q5_0/Q8_0 for that reason).  Every call reads a different copy of the weight,
the copies together over --cold-mib (default 1 GiB, past the last-level cache), so the numbers are memory reads; the
same for torch's fp32 weights (F.linear, with torch's threads set to --threads and to 1: on a loaded machine torch's
OpenMP barrier can wait whole time slices for a descheduled thread; "vs best" compares with the faster of the two).
The types go one at a time; each round times a pass of torch (--threads), one of torch (1 thread) and one of the type
(torch's passes cut to about --torch-pass-s seconds, going on where the last one stopped), so that the type and
its torch times see the same load on a shared machine; the medians over --rounds are reported.  The native calls go through cffi directly (about 0.5 us each, included); the Python wrapper's own cost per
call (QuantWeight.matmul) is reported once.  The weights are random bytes with valid fp16 scales (the values do not
change the speed).

Prints a table, writes bench/results/qmatmul-<host>.json.
Usage: python bench/qmatmul.py [--threads 2] [--m 1] [--types Q4_0,Q8_0,...] [--shapes q,down] [--rounds 5]
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fluxion_lite.hostkv import native, quant  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = {"q": (896, 896), "k/v": (128, 896), "gate/up": (4864, 896), "down": (896, 4864), "output": (151936, 896)}
TYPES = ["F32", "F16", "BF16", "Q8_0", "Q5_1", "Q5_0", "Q4_1", "Q4_0", "Q6_K", "Q5_K", "Q4_K"]
# byte offsets of each block's fp16 scale fields (native/fluxion.h's table)
F16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2),
              "Q5_K": (0, 2), "Q6_K": (208,)}


def weight_bytes(name: str, n_out: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """One matrix of the type as the file's bytes: random, with every fp16 scale a normal value (no NaN/inf)."""
    tid = quant.TYPE_IDS[name]
    nbytes = n_out * quant.row_bytes(tid, k)
    if name in ("F32", "F16", "BF16"):
        v = rng.standard_normal(nbytes // (4 if name == "F32" else 2), dtype=np.float32) * 0.02
        if name == "F32":
            return v.view(np.uint8)
        if name == "F16":
            return v.astype(np.float16).view(np.uint8)
        return (v.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    w = np.frombuffer(bytearray(rng.bytes(nbytes)), np.uint8)
    blocks = w.reshape(-1, quant.block_bytes(tid))
    scale = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    for off in F16_FIELDS[name]:
        blocks[:, off:off + 2] = scale
    return w


def pass_seconds(call, n: int) -> float:
    """Seconds per call of one pass call(0) .. call(n - 1)."""
    t0 = time.perf_counter()
    for i in range(n):
        call(i)
    return (time.perf_counter() - t0) / n


def copies_of(nbytes: int, args: argparse.Namespace) -> int:
    return max(2, min(args.max_copies, math.ceil(args.cold_mib * 2**20 / nbytes)))


class TorchBaseline:
    """torch fp32 x @ W^T for one shape (what model.py runs for an fp32 weight), over its own copies."""

    def __init__(self, n_out: int, k: int, m: int, args: argparse.Namespace) -> None:
        self.nbytes = n_out * k * 4
        self.copies = copies_of(self.nbytes, args)
        self.w = torch.randn(self.copies, n_out, k) * 0.02
        self.x = torch.randn(m, k)

    def call(self, i: int) -> None:
        F.linear(self.x, self.w[i])


class NativeCase:
    """quant's native product for one (type, shape) over copies of a random weight, called through cffi."""

    def __init__(self, name: str, n_out: int, k: int, m: int, args: argparse.Namespace,
                 rng: np.random.Generator) -> None:
        self.tid, self.n_out, self.k = quant.TYPE_IDS[name], n_out, k
        self.one = weight_bytes(name, n_out, k, rng)
        self.nbytes = self.one.nbytes
        self.copies = copies_of(self.nbytes, args)
        self.big = np.empty((self.copies, self.nbytes), np.uint8)
        self.big[:] = self.one
        base = quant.ffi.cast("uint8_t *", quant.ffi.from_buffer("uint8_t[]", self.big))
        self.ptrs = [base + i * self.nbytes for i in range(self.copies)]
        self.x = torch.randn(m, k)
        self.y = torch.empty(m, n_out)
        need = int(quant.lib.fx_qmatmul_workspace(self.tid, m, k))
        self.work = np.empty(max(need, 1), np.uint8)
        self.rest = (quant.ffi.cast("float *", self.x.data_ptr()), m, quant.ffi.cast("float *", self.y.data_ptr()),
                     quant.ffi.from_buffer("uint8_t[]", self.work), need)

    def call(self, i: int) -> None:
        quant.lib.fx_qmatmul(self.tid, self.ptrs[i], self.n_out, self.k, *self.rest)

    def rel_err(self) -> float | None:
        """max |y - x @ (dequantized W)^T| / max |that| (the 8-bit activations' error), for matrices up to 16M."""
        if self.n_out * self.k > 1 << 24:
            return None
        ref = self.x @ torch.from_numpy(quant.dequantize(self.tid, self.one, self.k)).T
        self.call(0)
        return float((self.y - ref).abs().max() / ref.abs().max())


class Rotating:
    """Passes of calls over a case's copies, each pass going on where the last one stopped (so that a pass shorter than
    all the copies still reads none that was read recently)."""

    def __init__(self, call, copies: int) -> None:
        self.call, self.copies, self.pos = call, copies, 0

    def run(self, n: int) -> float:
        """Seconds per call of n calls."""
        t0 = time.perf_counter()
        for _ in range(n):
            self.call(self.pos)
            self.pos = (self.pos + 1) % self.copies
        return (time.perf_counter() - t0) / n


def bench_shape(sname: str, args: argparse.Namespace, rng: np.random.Generator) -> Iterator[dict]:
    """Every type of the shape, one at a time (one type's copies in memory), each round timing a pass of torch with
    --threads, one with 1 thread, then one of the type: the type's row carries the torch times of its own rounds."""
    n_out, k = SHAPES[sname]
    base = TorchBaseline(n_out, k, args.m, args)
    tr = Rotating(base.call, base.copies)
    est = tr.run(min(base.copies, 20))  # torch's passes: all its copies, or about --torch-pass-s seconds of calls
    n_torch = max(10, min(base.copies, int(args.torch_pass_s / est)))
    rows = []
    for name in [n for n in args.types.split(",") if k % quant.block_size(n) == 0]:
        case = NativeCase(name, n_out, k, args.m, args, rng)
        run = Rotating(case.call, case.copies)
        run.run(case.copies)  # warm-up
        times: dict[str, list[float]] = {"torch": [], "torch1": [], "native": []}
        for _ in range(args.rounds):
            times["torch"].append(tr.run(n_torch))
            torch.set_num_threads(1)
            times["torch1"].append(tr.run(n_torch))
            torch.set_num_threads(args.threads)
            times["native"].append(run.run(case.copies))
        med = {key: statistics.median(v) for key, v in times.items()}
        sec, tbest = med["native"], min(med["torch"], med["torch1"])
        rows.append({"shape": sname, "n_out": n_out, "k": k, "m": args.m, "type": name, "ms": sec * 1e3,
                     "GBps": case.nbytes / sec / 1e9, "weight_bytes": case.nbytes, "copies": case.copies,
                     "torch_fp32_ms": med["torch"] * 1e3, "torch_fp32_1thread_ms": med["torch1"] * 1e3,
                     "torch_fp32_bytes": base.nbytes, "torch_calls_per_pass": n_torch,
                     "speedup_vs_torch_fp32": med["torch"] / sec, "speedup_vs_best_torch_fp32": tbest / sec,
                     "rel_err_vs_dequantized_fp32": case.rel_err()})
        yield rows[-1]
        del case, run


def wrapper_overhead_us(rounds: int) -> dict:
    """Microseconds per call of QuantWeight.matmul and of the bare cffi call on a tiny matrix (the fixed costs)."""
    rng = np.random.default_rng(0)
    qw = quant.QuantWeight("Q8_0", weight_bytes("Q8_0", 16, 64, rng), 16, 64)
    x, out = torch.randn(1, 64), torch.empty(1, 16)
    need = int(quant.lib.fx_qmatmul_workspace(8, 1, 64))
    work = np.empty(need, np.uint8)
    a = (8, qw.ptr, 16, 64, quant.ffi.cast("float *", x.data_ptr()), 1, quant.ffi.cast("float *", out.data_ptr()),
         quant.ffi.from_buffer("uint8_t[]", work), need)
    py = statistics.median(pass_seconds(lambda i: qw.matmul(x, out), 2000) for _ in range(rounds))
    c = statistics.median(pass_seconds(lambda i: quant.lib.fx_qmatmul(*a), 2000) for _ in range(rounds))
    return {"QuantWeight.matmul_us": py * 1e6, "cffi_call_us": c * 1e6}


def read_bandwidth_gbps() -> float:
    probe = np.ones(1 << 28, np.uint8)  # 256 MiB
    native.read_bandwidth_probe(probe, 1)
    read = []
    for _ in range(3):
        t0 = time.perf_counter()
        native.read_bandwidth_probe(probe, 2)
        read.append(2 * probe.nbytes / (time.perf_counter() - t0) / 1e9)
    return statistics.median(read)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--m", type=int, default=1, help="rows of x (1: decode)")
    p.add_argument("--types", default=",".join(TYPES))
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--cold-mib", type=float, default=1024, help="copies of each weight to at least this much")
    p.add_argument("--max-copies", type=int, default=20000)
    p.add_argument("--torch-pass-s", type=float, default=1.0, help="torch passes stop after about this long")
    p.add_argument("--simd", default="auto")
    p.add_argument("--out", default=None)
    args = p.parse_args()

    native.set_threads(args.threads)
    native.set_simd(args.simd)
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    read_gbps = read_bandwidth_gbps()
    overhead = wrapper_overhead_us(args.rounds)
    print(f"threads {args.threads}, m {args.m}, simd {native.get_simd()} (vnni {quant.set_vnni(True)}), "
          f"read bandwidth {read_gbps:.1f} GB/s; per call: QuantWeight.matmul {overhead['QuantWeight.matmul_us']:.1f}"
          f" us, bare cffi call {overhead['cffi_call_us']:.2f} us (both on a 16x64 Q8_0)", flush=True)

    rows = []
    for sname in args.shapes.split(","):
        n_out, k = SHAPES[sname]
        print(f"\n{sname} {n_out}x{k} (torch fp32: {n_out * k * 4 / 1e6:.1f} MB)", flush=True)
        print(f"  {'type':<6}{'MB':>8}{'ms/call':>10}{'GB/s':>7}{'of read':>9}{'torch ms':>10}{'torch1 ms':>10}"
              f"{'vs torch':>9}{'vs best':>9}{'rel err':>9}")
        for name in args.types.split(","):
            if k % quant.block_size(name):
                print(f"  {name:<6}  n/a: k={k} is not a multiple of {quant.block_size(name)}")
        for r in bench_shape(sname, args, rng):
            r["of_read_bandwidth"] = r["GBps"] / read_gbps
            rows.append(r)
            err = r["rel_err_vs_dequantized_fp32"]
            print(f"  {r['type']:<6}{r['weight_bytes'] / 1e6:>8.2f}{r['ms']:>10.3f}{r['GBps']:>7.1f}"
                  f"{r['of_read_bandwidth']:>9.0%}{r['torch_fp32_ms']:>10.3f}{r['torch_fp32_1thread_ms']:>10.3f}"
                  f"{r['speedup_vs_torch_fp32']:>8.1f}x{r['speedup_vs_best_torch_fp32']:>8.2f}x"
                  f"{'-' if err is None else f'{err:.1e}':>9}", flush=True)

    host = platform.node() or "host"
    out = Path(args.out) if args.out else RESULTS / f"qmatmul-{host}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
               platform.processor())
    out.write_text(json.dumps({"host": host, "cpu": cpu, "torch": torch.__version__, "simd": native.get_simd(),
                               "vnni": quant.set_vnni(True), "read_GBps": read_gbps, "overhead": overhead,
                               "config": vars(args), "results": rows}, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
