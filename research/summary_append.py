"""What keeping the device block summaries up to date costs per layer: DeviceSummaries.append_chunk (a prompt chunk)
and append_tokens (one key per decoding row), timed and counted in ops.

A mixed step (a prompt chunk beside decoding rows, docs/hybrid.md) under device selection pays both in every layer,
and CPU selection pays neither; the launch count is what a host-bound step feels on the GPU, so the table gives the
aten ops each call issues that move data (views left out; torch.profiler) and on CUDA its kernel launches, beside
its median time. Cases: a chunk of whole blocks at a block start (the usual `--chunk`-token chunk), the same chunk
shifted off the block grid (a ragged start and end), and `--rows` decode keys. Run it on two trees to A/B a change
of device_select.py.

Usage: python research/summary_append.py --device cuda --chunk 8192 --rows 63 --out bench/results/summary_append.json
       python research/summary_append.py --device cpu --chunk 2048 --repeats 5
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch.profiler import ProfilerActivity, profile

from fluxion_lite.sparse.device.summaries import DeviceSummaries


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ops that only make a view (no kernel, no memory traffic)
VIEW_OPS = frozenset(f"aten::{n}" for n in ("view", "reshape", "_unsafe_view", "slice", "select", "expand", "transpose",
                                            "t", "permute", "as_strided", "unsqueeze", "squeeze", "alias", "narrow",
                                            "detach"))


def _ops(fn: Callable[[], None], device: torch.device) -> tuple[int, int]:
    """(aten ops that move data, kernel launches) of one call: the top-level aten ops Python issues, views and
    no-op dtype casts left out, and on CUDA the kernel launches."""
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        fn()
        _sync(device)
    events = prof.events()
    # an op called by another op (aten::copy_ inside aten::to) is not a separate call from Python
    top = [e for e in events if e.name.startswith("aten::") and (e.cpu_parent is None
                                                                 or not e.cpu_parent.name.startswith("aten::"))]
    # aten::to to the tensor's own dtype returns it without a copy (no child op)
    working = [e for e in top if e.name not in VIEW_OPS and (e.name != "aten::to" or e.cpu_children)]
    launches = sum(1 for e in events if e.name in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
    return len(working), launches


def _time(fn: Callable[[], None], device: torch.device, repeats: int) -> float:
    fn()  # warm-up: allocations, the first kernel loads
    _sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--chunk", type=int, default=8192, help="prompt chunk tokens")
    ap.add_argument("--rows", type=int, default=63, help="decode rows (one key each)")
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--g", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.chunk <= 5 or args.rows < 1:  # the ragged case drops 5 tokens of the chunk
        ap.error("--chunk must be above 5 and --rows at least 1")
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    hkv, d, g, n = args.kv_heads, args.head_dim, args.g, args.chunk
    gen = torch.Generator().manual_seed(0)
    ds = DeviceSummaries(1, hkv, d, g, device)
    ds.reserve(1, args.rows + 1, (3 * n) // g + 2)  # no growth inside the timed calls
    # k [n, Hkv, D]: a view of a packed [n, 3 Hkv, D] buffer, as the model's qkv split hands it over
    packed = torch.randn(n, 3 * hkv, d, generator=gen).to(device=device, dtype=dtype)
    k = packed[:, hkv : 2 * hkv]
    slots = torch.arange(args.rows, device=device)
    pos = torch.randint(0, n, (args.rows,), generator=gen).to(device)
    k_rows = torch.randn(args.rows, hkv, d, generator=gen).to(device=device, dtype=dtype)
    cases: dict[str, Callable[[], None]] = {
        f"chunk {n} at a block start": lambda: ds.append_chunk(0, args.rows, n, k),
        f"chunk {n - 5} at start +5": lambda: ds.append_chunk(0, args.rows, n + 5, k[: n - 5]),
        f"{args.rows} decode keys": lambda: ds.append_tokens(0, slots, pos, args.rows - 1, n - 1, k_rows),
    }
    rows: list[dict[str, Any]] = []
    print(f"{'case':32} {'median ms':>10} {'data ops':>9} {'launches':>9}")
    for name, fn in cases.items():
        ms = _time(fn, device, args.repeats)
        ops, launches = _ops(fn, device)
        rows.append({"case": name, "median_ms": ms, "data_ops": ops, "launches": launches})
        print(f"{name:32} {ms:10.3f} {ops:9d} {launches:9d}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    result = {"machine": platform.node(), "device": str(device), "commit": commit, "args": vars(args), "rows": rows,
              "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
