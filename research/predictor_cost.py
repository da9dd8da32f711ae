"""Online cost of the per-request plan, per layer: features (head_features.layer_features) + predictor MLP + selector.
RequestPlanner.prefill_done computes all layers' features in one head_features.prompt_features call when a
sequence's prefill ends: the last two columns ("req") time that call plus every layer's MLP + selector, divided by
the layer count; the other columns time one layer on its own (layer_features), as the planner did before.

Shapes of the three catalog models, random tensors (the cost depends on shapes only), fp32, on the CPU (one thread by
default) or with --device cuda on the GPU, where a served prefill leaves its K/V and the features run. Reports
thread CPU time (time.thread_time: the cost on an idle core; the 2-core VM is shared, so wall time there mostly
measures other people's jobs) and wall time, median over reps; on CUDA the wall time (synchronised) is the cost.
  python research/predictor_cost.py [--threads 1] [--contexts 1024 4096 16384 32768] [--device cuda]
Prints a table and writes bench/results/predictor_cost.json (predictor_cost_cuda.json with --device cuda).

Per row it also profiles one features call (torch.profiler, on the chosen device, outside the timed reps):
"aten ops" counts top-level aten ops (launch/dispatch overhead is what a short call on a GPU pays), "item" the
aten::item host syncs; on CUDA, "launches" counts kernel launches and "syncs" host-side synchronisations (the final
copy to the host is one). The first layer of a prompt also builds the selection plan (cached for the prompt's other
layers): first/later columns.
"""
from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from fluxion_lite.plan import head_features
from fluxion_lite.plan.head_features import FEATURE_QUERIES, N_FEATURES, layer_features, prompt_features
from fluxion_lite.plan.predictor import config_costs, select_groups, train

SHAPES = {  # n_layers, n_heads, n_kv_heads, head_dim, d_model
    "smollm2-135m": (30, 9, 3, 64, 576),
    "qwen2.5-coder-0.5b": (24, 14, 2, 64, 896),
    "qwen2.5-coder-1.5b": (28, 12, 2, 128, 1536),
}


def op_profile(call: Callable[[], object], device: torch.device) -> dict[str, int | None]:
    """Top-level aten ops, aten::item calls and (CUDA) kernel launches and host syncs of one call."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        call()
    events = prof.events()
    names = [e.name for e in events]
    top = [e for e in events if e.name.startswith("aten::")
           and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))]
    cuda = device.type == "cuda"
    return {"aten_ops": len(top), "item_calls": names.count("aten::item"),
            "kernel_launches": sum("LaunchKernel" in x for x in names) if cuda else None,
            "host_syncs": sum(x.endswith("Synchronize") for x in names) if cuda else None}


def layer_inputs(shape: tuple[int, int, int, int, int], n: int, seed: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random q [Q, Hkv, r, D], keys, values [Hkv, n, D] and W_o [d_model, Hq*D] of one layer of the shape."""
    _, hq, hkv, d, dm = shape
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(FEATURE_QUERIES, hkv, hq // hkv, d, generator=gen).to(device)
    keys = torch.randn(hkv, n, d, generator=gen).to(device)
    values = torch.randn(hkv, n, d, generator=gen).to(device)
    return q, keys, values, torch.randn(dm, hq * d, generator=gen).to(device)


def time_layer(shape: tuple[int, int, int, int, int], n: int, pred: object, reps: int,
               device: torch.device) -> tuple[float, float, float, dict[str, int | None], dict[str, int | None]]:
    n_layers, _, hkv, d, _ = shape
    q, keys, values, wo = layer_inputs(shape, n, 0, device)
    layer_features(q, keys, values, wo, 3, n_layers, 16, 64)  # warm-up (CUDA: kernels, allocator)
    head_features._selection_plan.cache_clear()  # profile a prompt's first layer, then a later one
    first = op_profile(lambda: layer_features(q, keys, values, wo, 3, n_layers, 16, 64), device)
    later = op_profile(lambda: layer_features(q, keys, values, wo, 3, n_layers, 16, 64), device)
    costs = config_costs(n, 16, 64, d)
    pred.weights["prior"] = np.full((n_layers, hkv, 21), 0.05, np.float32)  # type: ignore[attr-defined]
    feat_s, pred_s, wall_s = [], [], []
    for _ in range(reps):
        w0, t0 = time.perf_counter(), time.thread_time()
        f = layer_features(q, keys, values, wo, 3, n_layers, 16, 64).numpy()  # on the host: synchronised
        t1 = time.thread_time()
        p, err = pred.predict_layer(f, 3)  # type: ignore[attr-defined]
        select_groups(p, err, costs, 0.1)
        t2, w2 = time.thread_time(), time.perf_counter()
        feat_s.append(t1 - t0)
        pred_s.append(t2 - t1)
        wall_s.append(w2 - w0)
    return float(np.median(feat_s)), float(np.median(pred_s)), float(np.median(wall_s)), first, later


def time_request(shape: tuple[int, int, int, int, int], n: int, pred: object, reps: int,
                 device: torch.device) -> tuple[float, float]:
    """What RequestPlanner.prefill_done does once per request: every layer's features in one prompt_features call
    (layers batched), then the MLP and selector per layer. Returns (thread CPU ms, wall ms) per layer, medians.
    The layers share one set of random tensors (the cost depends on shapes only; prompt_features copies them
    into its batches anyway)."""
    n_layers, d = shape[0], shape[3]
    q, keys, values, wo = layer_inputs(shape, n, 1, device)
    layers = list(range(n_layers))
    costs = config_costs(n, 16, 64, d)

    def call() -> None:
        feats = prompt_features([q] * n_layers, [keys] * n_layers, [values] * n_layers, [wo] * n_layers, layers,
                                n_layers, 16, 64)
        for layer, f in zip(layers, feats):
            select_groups(*pred.predict_layer(f.numpy(), layer), costs, 0.1)  # type: ignore[attr-defined]

    call()  # warm-up
    cpu_s, wall_s = [], []
    for _ in range(reps):
        w0, t0 = time.perf_counter(), time.thread_time()
        call()
        cpu_s.append(time.thread_time() - t0)
        wall_s.append(time.perf_counter() - w0)
    return 1e3 * float(np.median(cpu_s)) / n_layers, 1e3 * float(np.median(wall_s)) / n_layers


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = ap.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    e = rng.uniform(0, 1, (64, 21)).astype(np.float32)
    pred = train(rng.standard_normal((64, N_FEATURES)).astype(np.float32), e, e, epsilon=0.1, epochs=1,
                 prior_table=np.full((30, 3, 21), 0.05))  # weights do not change the cost
    rows = []
    print(f"{'model':<20} {'context':>8} {'features ms':>12} {'MLP+select ms':>14} {'total ms/layer':>15}"
          f" {'wall ms':>8} {'aten ops first/later':>21} {'item':>5} {'launches':>9} {'syncs':>6}"
          f" {'req cpu ms/L':>12} {'req wall ms/L':>13}")
    for name, shape in SHAPES.items():
        for n in args.contexts:
            f, p, w, first, later = time_layer(shape, n, pred, args.reps, device)
            req_cpu, req_wall = time_request(shape, n, pred, args.reps, device)
            rows.append({"model": name, "context": n, "features_cpu_ms": 1e3 * f, "predict_select_cpu_ms": 1e3 * p,
                         "total_cpu_ms": 1e3 * (f + p), "total_wall_ms": 1e3 * w,
                         "request_cpu_ms_per_layer": req_cpu, "request_wall_ms_per_layer": req_wall,
                         "features_profile_first_layer": first, "features_profile_later_layer": later})
            print(f"{name:<20} {n:>8} {1e3 * f:>12.3f} {1e3 * p:>14.3f} {1e3 * (f + p):>15.3f} {1e3 * w:>8.2f}"
                  f" {str(first['aten_ops']) + '/' + str(later['aten_ops']):>21} {later['item_calls']:>5}"
                  f" {_opt(first['kernel_launches'], later['kernel_launches']):>9}"
                  f" {_opt(first['host_syncs'], later['host_syncs']):>6} {req_cpu:>12.3f} {req_wall:>13.3f}")
    later_ops = sorted({r["features_profile_later_layer"]["aten_ops"] for r in rows})
    first_ops = sorted({r["features_profile_first_layer"]["aten_ops"] for r in rows})
    print(f"aten ops per call (features, torch.profiler on {device}): {later_ops} on a prompt's later layers, "
          f"{first_ops} on its first")
    name = "predictor_cost.json" if device.type == "cpu" else f"predictor_cost_{device.type}.json"
    out = Path(__file__).parent / "results" / name
    out.write_text(json.dumps({"threads": args.threads, "device": str(device), "rows": rows}, indent=1))
    print(f"wrote {out}")


def _opt(first: int | None, later: int | None) -> str:
    return "-" if first is None else f"{first}/{later}"


if __name__ == "__main__":
    main()
