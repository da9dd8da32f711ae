"""Where the host time of a graphed device-selection decode step goes (CUDA only).

A step of `fluxion-gpu` is host work, one graph launch, and a wait for the device. Host work before the launch
(the step's inputs, DeviceGraphedDecode.begin/prepare) leaves the GPU idle; host work after it (end(): the previous
step's host-store appends, planning the next step) overlaps the device. This wraps those calls with timers (no
cProfile, so the times are the real ones) over a run of steps of bench/tpot.py's random-weight model and prints the
mean per step of each, nested calls indented.

    python bench/host_split.py --shape llama3.1-8b --context 32768 --batch 1 --steps 30 --out host_split.json

Without CUDA (--device cpu) the same hooks run on torch CPU tensors (as tests/test_device_graph.py runs them: the
graph's segments eagerly, the zero-copy alias being host memory itself) on a model with the shape's layers and
heads but small widths, so the Python work of prepare/begin/end can be compared between commits on any machine;
the device copies are CPU copies there, and the segments' compute is not what a GPU would do.
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

from fluxion_lite.sparse import backend as sparse_attention  # noqa: E402

from fluxion_lite.model import cuda_graphs as decode_graphs

from fluxion_lite.sparse.device import capture as device_graph

from fluxion_lite.hostkv import store as host_kv

from fluxion_lite.hostkv import native
from fluxion_lite.sparse.cost_model import Costs  # noqa: E402

# (owner, method, label): labels indented by two spaces are calls made inside the unindented one above them
TIMED: list[tuple[Any, str, str]] = [
    (decode_graphs.DecodeGraphs, "forward", "DecodeGraphs.forward"),
    (decode_graphs._GraphSet, "run", "GraphSet.run"),
    (sparse_attention.SparseAttention, "captured_decode", "captured_decode"),
    (device_graph.DeviceGraphedDecode, "prepare", "  prepare"),
    (device_graph.DeviceGraphedDecode, "begin", "begin"),
    (host_kv.HostKVStore, "reserve_decode", "  reserve_decode"),
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


def cpu_setup(shape: str, context: int, batch: int, plan_source: Path) -> tuple[Any, Any]:
    """The shape's layers and heads with small widths, in fp32 on the CPU, and a filled device-selection backend
    whose "device" is torch on the CPU (zero-copy: the alias is the host store itself)."""
    small = "host-" + shape
    tpot.SHAPES[small] = {**tpot.SHAPES[shape], "d_model": 256, "d_ff": 512, "head_dim": 16, "vocab_size": 1000}
    model = tpot.random_model(small, torch.device("cpu"), torch.float32)
    model.graphs = decode_graphs.DecodeGraphs(model, capture=False)  # the graph runner's code, segments eagerly
    plan = tpot.borrowed_plan(model.cfg, plan_source)
    costs = Costs(cpu_gbs=10.0, gather_gbs=10.0, h2d_gbs=None, zero_copy=True, pcie_read_gbs=10.0)
    attn = sparse_attention.SparseAttention(model.cfg, plan, torch.float32, torch.device("cpu"), max_seqs=batch + 1,
                                            placement="gpu", selection="gpu", costs=costs, zero_copy=True)
    tpot.fill_context(attn, model.cfg, batch, context, torch.device("cpu"), seed=context + batch)
    return model, attn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama3.1-8b", choices=list(tpot.SHAPES))
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--plan-source", default="models/qwen2.5-coder-0.5b.plan.json")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default=None, help="JSON path")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("host_split.py: --device cuda needs CUDA (--device cpu runs the hooks' host work on torch CPU)")
    acc: dict[str, float] = collections.defaultdict(float)
    install_timers(acc)
    dev = torch.device(args.device)
    if dev.type == "cuda":
        native.set_threads(max(1, native.physical_cores() - 1))  # as bench/tpot.py on CUDA
        model = tpot.random_model(args.shape, dev, torch.bfloat16)
        attn = tpot.new_attention(model, "fluxion-gpu", args.context, args.batch,
                                  tpot.borrowed_plan(model.cfg, Path(args.plan_source)))
    else:
        model, attn = cpu_setup(args.shape, args.context, args.batch, Path(args.plan_source))
    for i in range(6):  # graphs captured, caches warm
        tpot.decode_step(model, attn, args.batch, 5, args.context + i)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    sync()
    acc.clear()
    walls = []
    for i in range(args.steps):
        t = time.perf_counter()
        tpot.decode_step(model, attn, args.batch, 5, args.context + 6 + i)
        sync()
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
            "device": args.device, "machine": tpot.machine_name(dev), "commit": tpot.commit_label(),
            "command": "python " + " ".join(sys.argv), "step_median_ms": step_ms,
            "mean_ms_per_step": {label.strip(): ms for label, ms in per_step.items()}}, indent=1))


if __name__ == "__main__":
    main()
