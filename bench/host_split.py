"""Where the host time of a graphed device-selection decode step goes (CUDA only).

A step of `fluxion-gpu` is host work, one graph launch, and a wait for the device. Host work before the launch
(the step's inputs, DeviceGraphedDecode.begin/prepare) leaves the GPU idle; host work after it (end(): the previous
step's host-store appends, planning the next step) overlaps the device. This wraps those calls with timers (no
cProfile, so the times are the real ones) over a run of steps of bench/tpot.py's random-weight model and prints the
mean per step of each, nested calls indented.

    python bench/host_split.py --shape llama3.1-8b --context 32768 --batch 1 --steps 30 --out host_split.json
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tpot  # noqa: E402 (the model, plan and fill of the TPOT benchmark)

from fluxion_lite import decode_graphs, device_graph, native, sparse_attention  # noqa: E402

# (owner, method, label): labels indented by two spaces are calls made inside the unindented one above them
TIMED: list[tuple[Any, str, str]] = [
    (decode_graphs.DecodeGraphs, "forward", "DecodeGraphs.forward"),
    (decode_graphs._GraphSet, "run", "GraphSet.run"),
    (sparse_attention.SparseAttention, "decode_hooks", "decode_hooks"),
    (device_graph.DeviceGraphedDecode, "prepare", "  prepare"),
    (device_graph.DeviceGraphedDecode, "begin", "begin"),
    (device_graph.DeviceGraphedDecode, "_load_tables", "  _load_tables"),
    (device_graph.DeviceGraphedDecode, "_load_pins", "  _load_pins"),
    (device_graph.DeviceGraphedDecode, "_load_tasks", "  _load_tasks"),
    (torch.cuda.CUDAGraph, "replay", "graph replay (launch)"),
    (device_graph.DeviceGraphedDecode, "end", "end"),
    (device_graph.DeviceGraphedDecode, "flush_appends", "  flush_appends"),
    (device_graph.DeviceGraphedDecode, "_plan_next", "  _plan_next"),
    (torch.cuda.Stream, "synchronize", "  stream sync (device running)"),
]


def install_timers(acc: dict[str, float]) -> None:
    def wrap(orig: Callable[..., Any], label: str) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return orig(*args, **kwargs)
            finally:
                acc[label] += time.perf_counter() - t
        return timed

    for owner, name, label in TIMED:
        setattr(owner, name, wrap(getattr(owner, name), label))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama3.1-8b", choices=list(tpot.SHAPES))
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--plan-source", default="models/qwen2.5-coder-0.5b.plan.json")
    ap.add_argument("--out", default=None, help="JSON path")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("host_split.py: needs CUDA (the graphed device-selection step runs only there)")
    acc: dict[str, float] = collections.defaultdict(float)
    install_timers(acc)
    dev = torch.device("cuda")
    native.set_threads(max(1, native.physical_cores() - 1))  # as bench/tpot.py on CUDA
    model = tpot.random_model(args.shape, dev, torch.bfloat16)
    plan = tpot.borrowed_plan(model.cfg, Path(args.plan_source))
    attn = tpot.new_attention(model, "fluxion-gpu", args.context, args.batch, plan)
    for i in range(6):  # graphs captured, caches warm
        tpot.decode_step(model, attn, args.batch, 5, args.context + i)
    torch.cuda.synchronize()
    acc.clear()
    walls = []
    for i in range(args.steps):
        t = time.perf_counter()
        tpot.decode_step(model, attn, args.batch, 5, args.context + 6 + i)
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t)
    walls.sort()
    per_step = {label: 1000 * acc[label] / args.steps for _, _, label in TIMED}
    step_ms = 1000 * walls[len(walls) // 2]
    print(f"{args.shape} context {args.context} batch {args.batch}: step median {step_ms:.3f} ms "
          f"({args.steps} steps); mean per step:")
    for label, ms in per_step.items():
        print(f"  {label:<34}{ms:8.3f} ms")
    if args.out:
        Path(args.out).write_text(json.dumps({
            "shape": args.shape, "context": args.context, "batch": args.batch, "steps": args.steps,
            "machine": torch.cuda.get_device_name(dev), "commit": tpot.commit_label(), "command": "python " + " ".join(sys.argv), "step_median_ms": step_ms,
            "mean_ms_per_step": {label.strip(): ms for label, ms in per_step.items()}}, indent=1))


if __name__ == "__main__":
    main()
