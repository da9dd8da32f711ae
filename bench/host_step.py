"""Host time of one graphed sparse decode layer (sparse_graph.GraphedDecode.host), measured on the CPU.

On CUDA a decode step is, per layer: a graph replay (dense part + prologue), host(layer) on the CPU, an epilogue
replay. At batch 1 the GPU waits for host(), so its time is the step's time (issue 5: ~0.8 ms per layer on the H200
host for ~0.23 ms of device work). This script builds the real SparseAttention backend on the CPU with the
Llama-3.1-8B attention shape (Hq 32, Hkv 8, D 128; fewer layers: the per-layer cost is what counts), fills a synthetic
context (random K/V imported as bench/tpot.py does), runs one eager decode step (prefill ends), then drives the hooks
exactly as decode_graphs._GraphSet.run does without CUDA:

    begin(chunks); prologue(0); [host(i); epilogue(i); prologue(i + 1)] for each layer; end()

and times host(layer) with perf_counter. prologue/epilogue are device work on CUDA (graph replays) and are not
counted; begin() (once per step: task tables) and end() (the last layer's host append) are reported per step.

Sides (--side): `h200` (default) reproduces the H200 host's code path: the fluxion mode has a GPU side (the zero-copy
feeder), so every layer asks the scheduler to split with placement auto; its fixed cost is set so that the split is
all-CPU, as measured on the H200 at batch 1-8 (docs/hybrid.md, GPU% 0). `cpu`: no GPU side at all (placement cpu).
The fixed mode is placement cpu either way, as on the H200.

Pins: the fluxion plan keeps its pin_fraction (the shipped plan pins 0.5 of each retrieval budget; the imported
context gets synthetic pins, bench/tpot.py), so its layers run the pinned selection; --pin-fraction overrides it
(0: no pins) to compare pinned and unpinned plans. The row records the fraction used.

Two passes per case: the timed pass (headline medians), then a pass with every native C call wrapped by a timer
(native.lib replaced by a proxy), which splits host(layer) into native time and Python glue.

Usage: python bench/host_step.py --contexts 4096 8192 32768 --batches 1 4 --threads 1 2
       python bench/host_step.py --compare BEFORE.json [...] -- AFTER.json [...]   (side by side per case)
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tpot import borrowed_plan, fill_context  # noqa: E402  (bench/ is not a package)

from fluxion_lite.hostkv import native  # noqa: E402
from fluxion_lite.model.attention import SeqChunk  # noqa: E402
from fluxion_lite.model.config import ModelConfig  # noqa: E402
from fluxion_lite.engine.engine import fixed_plan  # noqa: E402
from fluxion_lite.sparse.cost_model import measure_costs  # noqa: E402
from fluxion_lite.sparse.backend import SparseAttention  # noqa: E402

# Llama-3.1-8B's attention shape; the dense sizes only matter to ModelConfig, nothing here runs the MLP
SHAPE = dict(arch="llama", d_model=4096, d_ff=14336, n_heads=32, n_kv_heads=8, head_dim=128, vocab_size=128256,
             rope_theta=500000.0, rope_style="interleaved", qkv_bias=False)


def config(n_layers: int) -> ModelConfig:
    return ModelConfig(n_layers=n_layers, context_length=131072 + 64, rms_eps=1e-5, rope_dim=128,
                       tied_embeddings=False, **SHAPE)


class NativeTimer:
    """Stands in for native.lib: every fx_* call is timed (seconds summed per function until take())."""

    def __init__(self, lib: Any):
        self._lib = lib
        self.spent: dict[str, float] = {}
        self._wrapped: dict[str, Any] = {}

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._lib, name)
        if not name.startswith("fx_") or name in ("fx_get_threads",):
            return fn
        w = self._wrapped.get(name)
        if w is None:
            spent = self.spent

            def w(*args: Any) -> Any:
                t0 = time.perf_counter()
                rc = fn(*args)
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0
                return rc

            self._wrapped[name] = w
        return w

    def take(self) -> dict[str, float]:
        out = dict(self.spent)
        self.spent.clear()
        return out


def make_backend(mode: str, cfg: ModelConfig, batch: int, side: str, plan_source: Path,
                 pin_fraction: float | None = None) -> SparseAttention:
    dtype, dev = torch.bfloat16, torch.device("cpu")  # bf16: the H200 runs the model in bf16 (same host glue)
    if mode == "fixed":
        return SparseAttention(cfg, fixed_plan(cfg), dtype, dev, max_seqs=batch + 1, placement="cpu")
    plan = borrowed_plan(cfg, plan_source)
    if pin_fraction is not None:
        plan.pin_fraction = pin_fraction
    if side == "cpu":
        return SparseAttention(cfg, plan, dtype, dev, max_seqs=batch + 1, placement="auto", zero_copy=False)
    base = measure_costs("cpu")
    # a GPU side (zero-copy feeder) too slow to win any task: the split is all-CPU, as on the H200 at batch 1-8
    costs = replace(base, h2d_gbs=None, zero_copy=True, pcie_read_gbs=25.0, gpu_attn_gbs=None, zc_fixed_s=1.0)
    return SparseAttention(cfg, plan, dtype, dev, max_seqs=batch + 1, placement="auto", costs=costs, zero_copy=True)


def qkv_bank(cfg: ModelConfig, batch: int, n: int, seed: int) -> list[tuple[torch.Tensor, ...]]:
    """n random (q, k, v) triples in bf16: q [B, Hq, D], k, v [B, Hkv, D] (random K/V in the store: any q works)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        q = torch.randn(batch, cfg.n_heads, cfg.head_dim, generator=g).to(torch.bfloat16)
        k = torch.randn(batch, cfg.n_kv_heads, cfg.head_dim, generator=g).to(torch.bfloat16)
        v = torch.randn(batch, cfg.n_kv_heads, cfg.head_dim, generator=g).to(torch.bfloat16)
        out.append((q, k, v))
    return out


class Runner:
    """A filled backend and its decode position; step() runs one hooked decode step and returns its host times."""

    def __init__(self, attn: SparseAttention, cfg: ModelConfig, batch: int, context: int):
        self.attn, self.cfg, self.batch, self.pos = attn, cfg, batch, context
        self.bank = qkv_bank(cfg, batch, 7, seed=context + batch)
        self._i = 0
        # first decode step eagerly (ends every sequence's prefill state), as DecodeGraphs does
        chunks = self.chunks()
        for layer in range(cfg.n_layers):
            q, k, v = self.next_qkv()
            attn.attend(layer, q, k, v, chunks)
        self.pos += 1

    def chunks(self) -> list[SeqChunk]:
        return [SeqChunk(b, self.pos, 1) for b in range(self.batch)]

    def next_qkv(self) -> tuple[torch.Tensor, ...]:
        self._i += 1
        return self.bank[self._i % len(self.bank)]

    def step(self, probe: NativeTimer | None = None) -> dict[str, Any]:
        chunks = self.chunks()
        hooks = self.attn.captured_decode(chunks)
        assert hooks is not None, "the step must take the graphed path"
        hooks.key(self.batch)
        t0 = time.perf_counter()
        hooks.begin(chunks)
        begin_s = time.perf_counter() - t0
        host_s, native_s = [], []
        hooks.prologue(0, *self.next_qkv())
        for layer in range(self.cfg.n_layers):
            if probe is not None:
                probe.take()
            t0 = time.perf_counter()
            hooks.host(layer)
            host_s.append(time.perf_counter() - t0)
            if probe is not None:
                native_s.append(probe.take())
            hooks.epilogue(layer)
            if layer + 1 < self.cfg.n_layers:
                hooks.prologue(layer + 1, *self.next_qkv())
        t0 = time.perf_counter()
        hooks.end()
        end_s = time.perf_counter() - t0
        self.pos += 1
        return {"begin": begin_s, "host": host_s, "end": end_s, "native": native_s}


def med_us(xs: list[float]) -> float:
    return 1e6 * statistics.median(xs) if xs else 0.0


def measure(runner: Runner, steps: int, warmup: int) -> dict[str, Any]:
    n_layers = runner.cfg.n_layers
    for _ in range(warmup):
        runner.step()
    host, per_layer_step, begin, end = [], [], [], []
    for _ in range(steps):
        r = runner.step()
        host += r["host"][1:]  # layer 0 has no previous layer to append: the others are the steady state
        per_layer_step.append((r["begin"] + sum(r["host"]) + r["end"]) / n_layers)
        begin.append(r["begin"])
        end.append(r["end"])
    # breakdown pass: native calls timed through the proxy (adds ~1 us per call, so not the headline numbers)
    probe = NativeTimer(native.lib)
    native.lib = probe
    try:
        glue, nat, by_fn = [], [], {}
        for _ in range(max(5, steps // 2)):
            r = runner.step(probe)
            for h, spent in zip(r["host"][1:], r["native"][1:]):
                n = sum(spent.values())
                nat.append(n)
                glue.append(h - n)
                for k, v in spent.items():
                    by_fn.setdefault(k, []).append(v)
            probe.take()
    finally:
        native.lib = probe._lib
    samples = len(nat)
    return {"host_us": med_us(host), "host_p90_us": 1e6 * float(np.percentile(host, 90)),
            "step_host_us_per_layer": med_us(per_layer_step), "begin_us": med_us(begin), "end_us": med_us(end),
            "native_us": med_us(nat), "glue_us": med_us(glue),
            "native_by_fn_us": {k: 1e6 * sum(v) / samples for k, v in sorted(by_fn.items())}}


def tasks_per_layer(attn: SparseAttention, n_layers: int) -> float:
    """The last step's retrieval tasks per layer (GraphedDecode.tasks: one table, or before 2026-11-30 a list of
    per-layer tuples: this script also times older commits)."""
    t = attn.host_capture.tasks
    return (sum(len(x[0]) for x in t) if isinstance(t, list) else len(t)) / n_layers


def load_avg() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def compare(before: list[Path], after: list[Path]) -> None:
    """Side by side: the rows of runs before and after a change (same cases), medians in us per layer."""
    def rows(paths: list[Path]) -> tuple[dict[tuple, dict], list[str]]:
        out, notes = {}, []
        for p in paths:
            d = json.loads(p.read_text())
            notes.append(f"{p}: {d['note']} | {d.get('command') or '; '.join(d.get('commands', []))}")
            for r in d["rows"]:
                out[(r["mode"], r["context"], r["batch"], r["threads"])] = r
        return out, notes

    b, nb = rows(before)
    a, na = rows(after)
    print("\n".join(["before:"] + nb + ["after:"] + na))
    print(f"{'mode':<8}{'ctx':>6}{'B':>3}{'thr':>4} | {'host us':>15} | {'step/L us':>15} | {'glue us':>13} | "
          f"{'native us':>15} | load")
    for key in sorted(set(b) & set(a), key=lambda k: (k[3], k[1], k[2], k[0])):
        x, y = b[key], a[key]
        print(f"{key[0]:<8}{key[1]:>6}{key[2]:>3}{key[3]:>4} | {x['host_us']:>6.0f} -> {y['host_us']:>5.0f} | "
              f"{x['step_host_us_per_layer']:>6.0f} -> {y['step_host_us_per_layer']:>5.0f} | "
              f"{x['glue_us']:>5.0f} -> {y['glue_us']:>4.0f} | {x['native_us']:>6.0f} -> {y['native_us']:>5.0f} | "
              f"{x['load_avg']:.1f} / {y['load_avg']:.1f}")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--compare":  # --compare BEFORE.json [...] -- AFTER.json [...]
        args = sys.argv[2:]
        cut = args.index("--")
        compare([Path(p) for p in args[:cut]], [Path(p) for p in args[cut + 1:]])
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", nargs="+", type=int, default=[4096, 8192, 32768])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 4])
    ap.add_argument("--modes", nargs="+", default=["fluxion", "fixed"], choices=["fluxion", "fixed"])
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2], help="native pool sizes")
    ap.add_argument("--layers", type=int, default=6, help="layers of the 8B attention shape (32 in the model)")
    ap.add_argument("--steps", type=int, default=40, help="timed decode steps per case")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--side", choices=["h200", "cpu"], default="h200", help="see the module docstring")
    ap.add_argument("--plan-source", default="models/qwen2.5-coder-0.5b.plan.json")
    ap.add_argument("--pin-fraction", type=float, default=None,
                    help="fluxion: override the plan's pin_fraction (0: no pins; default: the plan's)")
    ap.add_argument("--label", default="", help="stored with the results (e.g. 'before', 'after')")
    ap.add_argument("--out", default="bench/results/host_step-vm.json")
    args = ap.parse_args()
    torch.set_num_threads(1)  # the host glue runs on one thread; torch's pool would only add waiting on 2 cores
    cfg = config(args.layers)
    commit = os.environ.get("FLUXION_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    note = (f"host(layer) of the graphed sparse step, CPU only; Llama-3.1-8B attention shape with {args.layers} "
            f"layers, bf16; side {args.side}; {platform.processor() or platform.node()}, {os.cpu_count()} CPUs, "
            f"simd {native.get_simd()}; commit {commit or '?'} {args.label}")
    print(note, flush=True)
    print("command: python " + " ".join(sys.argv), flush=True)
    hdr = (f"{'mode':<8}{'ctx':>6}{'B':>3}{'thr':>4}{'host us':>9}{'p90':>7}{'step/L':>8}{'begin':>7}{'end':>6}"
           f"{'native':>8}{'glue':>6}{'tasks':>6}{'load':>6}   native by function (us per layer)")
    print(hdr, flush=True)
    rows: list[dict[str, Any]] = []
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for context in sorted(args.contexts):
        for batch in sorted(args.batches):
            for mode in args.modes:
                attn = make_backend(mode, cfg, batch, args.side, Path(args.plan_source), args.pin_fraction)
                fill_context(attn, cfg, batch, context, torch.device("cpu"), seed=context + batch)
                runner = Runner(attn, cfg, batch, context)
                for threads in args.threads:
                    native.set_threads(threads)
                    load0 = load_avg()
                    r = measure(runner, args.steps, args.warmup)
                    tasks = tasks_per_layer(attn, cfg.n_layers)
                    row = {"mode": mode, "context": context, "batch": batch, "threads": threads,
                           "pin_fraction": attn.plan.pin_fraction, "pinned": attn.pins is not None,
                           "tasks_per_layer": tasks, "load_avg": (load0 + load_avg()) / 2,
                           "kv_read_fraction": attn.stats()["kv_read_fraction"], **r}
                    rows.append(row)
                    fns = " ".join(f"{k[3:]}={v:.0f}" for k, v in row["native_by_fn_us"].items())
                    print(f"{mode:<8}{context:>6}{batch:>3}{threads:>4}{r['host_us']:>9.1f}{r['host_p90_us']:>7.0f}"
                          f"{r['step_host_us_per_layer']:>8.1f}{r['begin_us']:>7.0f}{r['end_us']:>6.0f}"
                          f"{r['native_us']:>8.1f}{r['glue_us']:>6.1f}{tasks:>6.1f}{row['load_avg']:>6.1f}   {fns}",
                          flush=True)
                    out.write_text(json.dumps({"note": note, "commit": commit, "label": args.label,
                                               "command": "python " + " ".join(sys.argv), "rows": rows}, indent=1))
                for b in range(batch):
                    attn.free(b)
                attn.executor.close()
                del runner, attn
    print(f"wrote {out}", flush=True)


if __name__ == "__main__":
    main()
