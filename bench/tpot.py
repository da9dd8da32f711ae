"""Time per output token (TPOT) at long context per attention mode, with the sparse path's time split.

Models: random-weight models with the exact shapes of Llama-3.1-8B and Qwen2.5-7B (bf16 on CUDA), `tiny` for a CPU
smoke run, or a real GGUF (--gguf, e.g. qwen2.5-coder-0.5b). With random weights only speed is meaningful; the
`fluxion` plan for those shapes is drawn from the calibrated qwen2.5-coder-0.5b plan (each (layer, group) copies a
random group of the proportionally mapped qwen layer). The context is synthetic: random K/V imported layer by layer
(SparseAttention.import_kv / the dense cache), not a prefill, so a 128K case costs seconds, not minutes.

Modes: full-gpu (dense, KV on the GPU), full-host (all KV in host RAM, every block read on the CPU), fixed (g=16,
5%, all on the CPU), gpu-sparse (selection on the GPU, blocks over PCIe), fluxion (calibrated plan + scheduler).

Cases run cheapest first (context, then batch); each row is printed and the JSON rewritten as soon as it is
measured, so a timeout still leaves results. Cases that would not fit host RAM / GPU memory, or start after
--time-budget seconds, are listed as skipped.

Usage (H200): python bench/tpot.py --shape llama3.1-8b --contexts 8192 32768 65536 131072 --batches 1 4 8
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from fluxion_lite.hostkv import native

from fluxion_lite.sparse import zero_copy
from fluxion_lite.engine.async_decode import queue_tokens
from fluxion_lite.model.attention import DenseAttention, SeqChunk
from fluxion_lite.model.config import ModelConfig
from fluxion_lite.model.cuda_graphs import DecodeGraphs
from fluxion_lite.engine.engine import make_attention
from fluxion_lite.hub.resolve import resolve_model
from fluxion_lite.model.gguf_loader import GGUFModel, load_gguf, tensor_shapes
from fluxion_lite.hostkv.store import page_stride
from fluxion_lite.model.transformer import Transformer
from fluxion_lite.sparse.backend import SparseAttention
from fluxion_lite.plan.sparse_plan import GroupPlan, SparsePlan
from fluxion_lite.settings import Settings

sys.path.insert(0, str(Path(__file__).resolve().parent))
from model_shapes import SHAPES  # noqa: E402  (bench/ is not a package)

# fluxion-gpu: fluxion's plan with selection and attention on the GPU (device_graph.py), one graph per step, the
# pinned blocks held in device memory (the pin cache, serving's default) and the dynamic ones read over PCIe;
# fluxion-gpu-nocache: the same with every block over PCIe (FLUXION_PIN_CACHE=0: no KV on the GPU beyond sink +
# window; called fluxion-gpu before commit 13d0e16); fluxion-gpu-layers: one graph per layer. Since the reuse
# cache, fluxion-gpu also keeps the blocks read over PCIe for the next steps (reuse_cache.py);
# fluxion-gpu-noreuse: the pin cache without the reuse cache (fluxion-gpu before the reuse cache existed)
# fluxion-gpu-early: fluxion-gpu with the early block choice (device_graph.py; batch 1 only). The engine turns it on
# by default (at batch 1); here the other fluxion-gpu modes keep it off (unless FLUXION_EARLY_SELECT
# says otherwise), so that fluxion-gpu / fluxion-gpu-early stay the A/B pair of earlier tables
EARLY_ENV = os.environ.get("FLUXION_EARLY_SELECT", "0")  # what the other fluxion-gpu modes keep
MODES = ("full-gpu", "fluxion", "fluxion-gpu", "fluxion-gpu-early", "fluxion-gpu-noreuse", "fluxion-gpu-nocache",
         "fluxion-gpu-layers",
         "fixed", "gpu-sparse", "full-host")
# llama.cpp on the same H200 host, Llama-3.1-8B shape, random F16 GGUF, batch 1, 16 threads, median of 16 steps:
# measured by bench/llamacpp_peer.py (llama-cpp-python 0.3.36's vendored llama.cpp, sm_90) in the thirty-first
# session, bench/results/llamacpp_peer_llama3.1-8b_h200_17345bf.json. KV on the GPU: flash attention on (the faster
# of llama.cpp's two; the 5.33 / 6.81 / 8.65 ms agree with it). KV in host RAM: offload_kqv=false, flash
# attention off, attention on the CPU (the issue had 68.8 / 230 / 508 ms).
PEER_KV_GPU_MS = {8192: 5.38, 32768: 6.81, 65536: 8.52, 131072: 12.43}
PEER_KV_HOST_MS = {8192: 77.8, 32768: 273.9, 65536: 648.8, 131072: 1161.9}


def random_model(shape: str, device: torch.device, dtype: torch.dtype, seed: int = 0) -> Transformer:
    s = SHAPES[shape]
    cfg = ModelConfig(context_length=131072 + 64, rms_eps=1e-5, rope_dim=s["head_dim"], tied_embeddings=False, **s)
    gen = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape_: int) -> torch.Tensor:
        return (torch.randn(*shape_, generator=gen, device=device, dtype=torch.float32) * 0.02).to(dtype)

    # norms are ones (a random model that keeps activations in range), everything else small noise
    t = {n: torch.ones(s, device=device, dtype=dtype) if n.endswith("norm.weight") else rnd(*s)
         for n, s in tensor_shapes(cfg).items()}
    return Transformer(GGUFModel(Path(shape), cfg, {}, t), device=device, dtype=dtype)


def borrowed_plan(cfg: ModelConfig, source: Path, seed: int = 0) -> SparsePlan:
    src = SparsePlan.load(source)
    if len(src.groups) == cfg.n_layers and len(src.groups[0]) == cfg.n_kv_heads:
        return src  # the model the plan was calibrated on
    rng = random.Random(seed)
    groups: list[list[GroupPlan]] = []
    for layer in range(cfg.n_layers):
        row = src.groups[layer * len(src.groups) // cfg.n_layers]
        groups.append([rng.choice(row) for _ in range(cfg.n_kv_heads)])
    # the source's context scaling too (short_scale, and short_tokens for its long-only groups' ramp): a drawn plan
    # reads at each context what the source reads there (runs before long-only groups drew no short scale)
    return SparsePlan(src.sink, src.window, groups, source=f"drawn from {source.name}", pin_fraction=src.pin_fraction,
                      obs_window=src.obs_window, scoring=src.scoring, pin_span=src.pin_span, pin_decay=src.pin_decay,
                      short_scale=src.short_scale, short_tokens=src.short_tokens, pin_span_tokens=src.pin_span_tokens)


def host_bytes_per_token(cfg: ModelConfig) -> float:
    """Host RAM per token of context: pages of 256 tokens (K, V bf16 + 4 summaries) at their stride in the store's
    slabs (no power-of-two rounding per page any more), plus ~1% for partly used slabs."""
    page = page_stride(native.page_bytes(cfg.n_kv_heads, cfg.head_dim, 256, (16, 32, 64, 128)), cfg.head_dim)
    return page * cfg.n_layers / 256 * 1.01


def mem_available() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float("inf")


def fill_context(attn: object, cfg: ModelConfig, batch: int, context: int, dev: torch.device, seed: int) -> None:
    """Random K/V for positions 0..context-1 of sequences 0..batch-1 (no attention computed)."""
    gen = torch.Generator(device=dev).manual_seed(seed)
    chunk = 4096
    # The host store's copy goes through pinned buffers: import_kv's own .cpu() of a CUDA tensor is a pageable copy
    # (measured on the H200 host: 1.8 s of a 32K fill's 2.2 s, before this staging)
    staged = dev.type == "cuda" and not isinstance(attn, DenseAttention)
    if staged:
        k_host, v_host = (torch.empty(chunk, cfg.n_kv_heads, cfg.head_dim, dtype=torch.bfloat16, pin_memory=True)
                          for _ in range(2))
    for b in range(batch):
        attn.allocate(b)  # type: ignore[attr-defined]
        for s in range(0, context, chunk):  # positions in order in every layer (the dense cache checks for gaps)
            n = min(chunk, context - s)
            for layer in range(cfg.n_layers):
                k = torch.randn(n, cfg.n_kv_heads, cfg.head_dim, generator=gen, device=dev).to(torch.bfloat16)
                v = torch.randn(n, cfg.n_kv_heads, cfg.head_dim, generator=gen, device=dev).to(torch.bfloat16)
                if isinstance(attn, DenseAttention):
                    attn.cache.append(layer, b, s, k, v)
                    continue
                if staged:
                    k_host[:n].copy_(k, non_blocking=True)
                    v_host[:n].copy_(v, non_blocking=True)
                    torch.cuda.current_stream(dev).synchronize()  # before import_kv reads them
                    k, v = k_host[:n], v_host[:n]
                attn.import_kv(layer, b, s, k, v)  # type: ignore[attr-defined]
        if isinstance(attn, SparseAttention) and attn.pins is not None:
            synthetic_pins(attn, b, context, seed + b)


def synthetic_pins(attn: SparseAttention, seq: int, context: int, seed: int) -> None:
    """Pinned blocks as a prefill would leave them (a plan with pin_fraction), from random attention mass: the
    context here is imported, not prefilled, so no observed queries exist. Same counts and eligibility as serving, so
    decode takes the same path (the native top-k with the pins)."""
    assert attn.pins is not None
    rng = np.random.default_rng(seed)
    for layer in range(attn.cfg.n_layers):
        mass = rng.random((attn.cfg.n_kv_heads, context))  # [Hkv, n_prompt]
        attn.pins.pin_by_mass(layer, attn.state.slot[seq], mass, context + 1)


def new_attention(model: Transformer, mode: str, context: int, batch: int, plan: SparsePlan) -> object:
    if mode.startswith("fluxion-gpu"):
        os.environ["FLUXION_DEVICE_GRAPHS"] = "layer" if mode == "fluxion-gpu-layers" else "step"
        os.environ["FLUXION_PIN_CACHE"] = "0" if mode == "fluxion-gpu-nocache" else "1"  # read when the backend is made
        os.environ["FLUXION_REUSE_CACHE"] = "0" if mode == "fluxion-gpu-noreuse" else "1"  # (nocache: off with it)
        os.environ["FLUXION_EARLY_SELECT"] = "1" if mode == "fluxion-gpu-early" else EARLY_ENV
        attn: object = SparseAttention(model.cfg, plan, model.dtype, model.device, max_seqs=batch + 1, placement="gpu",
                                       selection="gpu")
    else:
        # the mode names where selection runs: `fluxion` is the CPU-selection hybrid (the paper's design), whatever
        # the serving default (engine.fluxion_selection) would pick; `fluxion-gpu` selects on the device
        attn = make_attention(mode, model.cfg, model.dtype, model.device, batch + 1, "synthetic",
                              plan=plan if mode == "fluxion" else None, selection="cpu")
    fill_context(attn, model.cfg, batch, context, model.device, seed=context + batch)
    return attn


def close_attention(model: Transformer, attn: object, batch: int) -> None:
    for b in range(batch):
        attn.free(b)  # type: ignore[attr-defined]
    if isinstance(attn, SparseAttention):
        attn.executor.close()
    if model.graphs is not None:  # graph sets captured with this backend keep its host store alive (a 72 GiB
        model.graphs.release_backends()  # store under the next case's: the H200 host's fixed 32K b16 run died so)


def release_pinned_cache() -> None:
    """Hand torch's cached pinned blocks (freed host-store slabs) back to the system. Between modes of one case they
    are kept: the next store takes the same slab sizes from the cache instead of pinning new memory (~2 GB/s on the
    H200 host, most of a fill); a case of another size could not use them."""
    gc.collect()  # a backend in a reference cycle frees its slabs only here
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        for name in ("_host_emptyCache", "_accelerator_emptyHostCache"):  # the name differs across torch versions
            if hasattr(torch._C, name):
                getattr(torch._C, name)()
                break


def machine_name(dev: torch.device) -> str:
    """The GPU's name on CUDA, else the processor (or host) name: the machine a result file names."""
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or platform.node()


def commit_label() -> str:
    """The commit measured. A copied working tree (the device tool's) may carry a stale .git: FLUXION_COMMIT, when
    set, names the real one."""
    return os.environ.get("FLUXION_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()


def decode_step(model: Transformer, attn: object, batch: int, token: int, pos: int) -> torch.Tensor:
    """One decode token for sequences 0..batch-1, all at position pos -> logits [batch, V]."""
    return model.forward(torch.full((batch,), token), torch.full((batch,), pos),
                         [SeqChunk(b, pos, 1) for b in range(batch)], attn)  # type: ignore[arg-type]


def check_graphs(model: Transformer, mode: str, context: int, batch: int, plan: SparsePlan, steps: int = 3) -> str:
    """Logits of decode steps through the CUDA graphs vs the eager forward, on two identically filled caches."""
    graphs, worst, agree, total = model.graphs, 0.0, 0, 0
    runs = []
    for use in (False, True):
        model.graphs = graphs if use else None
        attn = new_attention(model, mode, context, batch, plan)
        outs = []
        for i in range(steps):
            outs.append(decode_step(model, attn, batch, 7 + i, context + i).cpu())
        close_attention(model, attn, batch)
        runs.append(outs)
    model.graphs = graphs
    for a, b in zip(*runs):
        worst = max(worst, float((a - b).abs().max() / a.abs().max()))
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        total += a.shape[0]
    return f"graphs vs eager, {mode} ctx {context} batch {batch}: max |diff|/max|logit| {worst:.2e}, top-1 {agree}/{total}"


def chained_tpot(model: Transformer, attn: object, batch: int, token: int, pos: int, steps: int) -> list[float]:
    """Seconds between successive steps of a run of `steps` decode steps chained as the engine's async decode
    chains them (async_decode.py): each step's input tokens are the previous step's argmax on the device, the step
    is queued (defer_sync) and then the previous step's tokens are read on the host."""
    chunks = [SeqChunk(b, 0, 1) for b in range(batch)]
    inflight = None
    tokens = torch.full((batch,), token)
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    gaps, last = [], time.perf_counter()
    for i in range(steps):
        for b in range(batch):
            chunks[b] = SeqChunk(b, pos + i, 1)
        logits = model.forward(tokens if inflight is None else inflight.tokens, torch.full((batch,), pos + i),
                               chunks, attn, defer_sync=True)  # type: ignore[arg-type]
        nxt = queue_tokens([], logits.argmax(-1))  # greedy: the engine's sample_rows for such rows
        if inflight is not None:
            inflight.read()  # the previous step's tokens on the host, as the engine reads them
        inflight = nxt
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    assert inflight is not None
    inflight.read()
    return gaps


def measure(model: Transformer, mode: str, context: int, batch: int, steps: int, plan: SparsePlan,
            profile: Path | None = None, kernel_profile: Path | None = None, async_decode: bool = False) -> dict:
    cfg, dev = model.cfg, model.device
    t0 = time.perf_counter()
    attn = new_attention(model, mode, context, batch, plan)
    fill_s = time.perf_counter() - t0
    tokens = torch.randint(0, cfg.vocab_size, (steps + 1,)).tolist()
    times = []
    for i in range(steps + 1):
        if i == 2:
            attn.reset_stats()  # the first decode call ends the prefill state; the second warms caches up
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        decode_step(model, attn, batch, tokens[i], context + i)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    host, gpu = attn.bytes_used()
    stats = attn.stats()
    next_pos = context + steps + 1  # the profiled steps continue the sequence
    chained: dict[str, object] = {}
    if async_decode:  # the same number of steps again, chained (the first two gaps: warm-up of the chain)
        gaps = chained_tpot(model, attn, batch, tokens[0], next_pos, steps + 1)
        next_pos += steps + 1
        chained = {"tpot_async_ms": 1000 * statistics.median(gaps[2:]), "tpot_async_all_ms": [1000 * g for g in gaps]}
    if profile is not None:  # where the host time of a step goes (Python functions, cumulative)
        import cProfile
        import io
        import pstats

        prof = cProfile.Profile()
        prof.enable()
        for _ in range(3):
            decode_step(model, attn, batch, tokens[0], next_pos)
            next_pos += 1
        if dev.type == "cuda":
            torch.cuda.synchronize()
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(45)
        with profile.open("a") as f:
            f.write(f"===== {mode} ctx {context} batch {batch} graphs {model.graphs is not None}: 3 steps\n")
            f.write(buf.getvalue())
    if kernel_profile is not None:  # device busy time vs step time: is the GPU idle, and which ops cost the host?
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        with torch_profile(activities=acts) as prof:
            t = time.perf_counter()
            for _ in range(3):
                decode_step(model, attn, batch, tokens[0], next_pos)
                next_pos += 1
            if dev.type == "cuda":
                torch.cuda.synchronize()
            wall = time.perf_counter() - t
        # the timeline too (which kernels overlap on which stream): <profile stem>.<mode>.<context>.<batch>.json
        prof.export_chrome_trace(str(kernel_profile.with_name(
            f"{kernel_profile.stem}.{mode}.{context}.{batch}.trace.json")))
        events = prof.key_averages()
        busy_us = sum(e.self_device_time_total for e in events) if dev.type == "cuda" else 0.0
        with kernel_profile.open("a") as f:
            f.write(f"===== {mode} ctx {context} batch {batch} graphs {model.graphs is not None}: 3 steps, "
                    f"wall {1000 * wall / 3:.2f} ms/step (profiled), device busy {busy_us / 3000:.2f} ms/step\n")
            f.write(events.table(sort_by="self_cpu_time_total", row_limit=30) + "\n")
            if dev.type == "cuda":  # the device side: which kernels take the step's time (itemised without graphs)
                f.write(events.table(sort_by="self_cuda_time_total", row_limit=30) + "\n")
    close_attention(model, attn, batch)
    del attn
    gc.collect()  # its slabs back to torch's pinned cache before the next store allocates (no 2 x 72 GiB)
    return {"tpot_ms": 1000 * statistics.median(times[2:]), "tpot_all_ms": [1000 * t for t in times],
            "fill_s": fill_s, "kv_host_bytes": host, "kv_device_bytes": gpu, **stats, **chained,
            "kv_read_fraction": stats.get("kv_read_fraction", 1.0)}


def summary_lines(rows: list[dict], peers: bool = True) -> list[str]:
    """One line per fluxion case with its ratios; peers: also against the llama.cpp rows (Llama-3.1-8B shape)."""
    out = []
    by = {(r["mode"], r["context"], r["batch"]): r["tpot_ms"] for r in rows}
    chained = {(r["mode"], r["context"], r["batch"]): r["tpot_async_ms"] for r in rows if "tpot_async_ms" in r}
    for (mode, ctx, batch), ms in sorted(by.items(), key=lambda kv: (kv[0][1], kv[0][2])):
        if not mode.startswith("fluxion"):
            continue
        parts = [f"ctx {ctx:>6} batch {batch:>2}: {mode} {ms:8.2f} ms"]
        for other in ("fixed", "full-host", "gpu-sparse", "full-gpu"):
            if (other, ctx, batch) in by:
                parts.append(f"{by[(other, ctx, batch)] / ms:5.2f}x vs {other}")
        if (mode, ctx, batch) in chained:  # --async-decode: each mode's chained TPOT against fixed's chained one
            a = chained[(mode, ctx, batch)]
            parts.append(f"async decode {a:.2f} ms"
                         + (f" ({chained[('fixed', ctx, batch)] / a:.2f}x vs fixed async)"
                            if ("fixed", ctx, batch) in chained else ""))
        if peers and batch == 1 and ctx in PEER_KV_GPU_MS:
            parts.append(f"{ms / PEER_KV_GPU_MS[ctx]:5.2f}x llama.cpp KV-on-GPU time ({PEER_KV_GPU_MS[ctx]} ms)")
            parts.append(f"{PEER_KV_HOST_MS[ctx] / ms:5.1f}x faster than llama.cpp KV-in-host ({PEER_KV_HOST_MS[ctx]} ms)")
        out.append(", ".join(parts))
    return out


def plot(rows: list[dict], path: Path, title: str, peers: bool = True) -> None:
    """peers: draw the llama.cpp rows at batch 1 (measured for the Llama-3.1-8B shape only)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot", flush=True)
        return
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 4), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        for mode in MODES:
            pts = sorted((r["context"], r["tpot_ms"]) for r in rows if r["mode"] == mode and r["batch"] == batch)
            if pts:
                line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=mode)
                chained = sorted((r["context"], r["tpot_async_ms"]) for r in rows
                                 if r["mode"] == mode and r["batch"] == batch and "tpot_async_ms" in r)
                if chained:  # --async-decode: the same mode's chained steps, in its colour
                    ax.plot([p[0] for p in chained], [p[1] for p in chained], marker="s", linestyle=":",
                            color=line.get_color(), label=f"{mode}, async decode")
        if batch == 1 and peers:
            for peer, lab in ((PEER_KV_GPU_MS, "llama.cpp KV on GPU"), (PEER_KV_HOST_MS, "llama.cpp KV in host")):
                ax.plot(list(peer), list(peer.values()), linestyle="--", marker="x", label=lab)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("TPOT (ms)")
        ax.set_title(f"batch {batch}")
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="tiny", choices=list(SHAPES))
    ap.add_argument("--gguf", default=None, help="time a real GGUF model (catalog name or .gguf path) instead of a random-weight shape")
    ap.add_argument("--contexts", nargs="+", type=int, default=[2048])
    ap.add_argument("--batches", nargs="+", type=int, default=[1])
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES) + ["full"])
    ap.add_argument("--steps", type=int, default=8, help="decode steps per case; the first 2 are warm-up")
    ap.add_argument("--plan-source", default="models/qwen2.5-coder-0.5b.plan.json")
    ap.add_argument("--time-budget", type=float, default=450.0, help="seconds; later cases are skipped")
    ap.add_argument("--host-mem-fraction", type=float, default=0.7)
    ap.add_argument("--native-threads", type=int, default=None,
                    help="native pool size; default on CUDA: physical cores - 1, so the main thread (enqueuing GPU "
                         "work while the CPU worker's call holds the pool) keeps a core of its own")
    ap.add_argument("--graphs", choices=["on", "off", "both", "uncaptured"], default="on",
                    help="CUDA graphs for the dense part of decode steps (decode_graphs.py); both: every case twice; "
                         "uncaptured: the graph runner's code with its segments launched eagerly, so a "
                         "--kernel-profile itemises the kernels that the graphs would replay")
    ap.add_argument("--check-graphs", action="store_true",
                    help="first compare graph and eager logits for each mode at the smallest context and batch")
    ap.add_argument("--profile", default=None, help="append a cProfile of 3 extra steps per case to this file")
    ap.add_argument("--kernel-profile", default=None,
                    help="append a torch.profiler table of 3 extra steps per case (host ops, device busy time)")
    ap.add_argument("--async-decode", action="store_true",
                    help="per case, also the TPOT of --steps decode steps chained as the engine's async decode "
                         "runs them, greedy (tpot_async_ms: each step queued before the previous step's tokens "
                         "are read; the main TPOT waits for every step)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    start = time.perf_counter()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.native_threads or dev.type == "cuda":
        native.set_threads(args.native_threads or max(1, native.physical_cores() - 1))
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    if args.gguf:
        path = resolve_model(args.gguf, pull_missing=False)  # a catalog name or a .gguf path
        model = Transformer(load_gguf(path, dtype=torch.float32), device=dev, dtype=dtype)
        name, weights = path.stem, "real weights"
    else:
        model = random_model(args.shape, dev, dtype)
        name, weights = args.shape, "random weights"
    cfg = model.cfg
    plan = borrowed_plan(cfg, Path(args.plan_source))
    commit = commit_label()
    machine = machine_name(dev)
    note = (f"{name} ({weights}, {dtype}); fluxion plan: {plan.source}; machine {machine}, {os.cpu_count()} CPUs, "
            f"native threads {native.get_threads()}, commit {commit or '?'}")
    zc_setting = Settings.load().zero_copy  # FLUXION_ZERO_COPY, as the backends read it
    zc_ok, zc_why = (zero_copy.check(dev, zc_setting is not False) if dev.type == "cuda" else
                     (zc_setting is True, "CPU device: staging unless FLUXION_ZERO_COPY=1"))
    note += f"; zero-copy feeder: {'on' if zc_ok else 'off'} ({zc_why})"
    print(note, flush=True)
    print("command: python " + " ".join(sys.argv), flush=True)
    out = Path(args.out or f"bench/results/tpot_{name}{'_' + dev.type if dev.type != 'cuda' else ''}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    graph_runner = model.graphs
    if args.graphs == "uncaptured":  # also on the CPU, where it runs the same hooks as a GPU step
        graph_runner = DecodeGraphs(model, capture=False)

    peers = name == "llama3.1-8b"  # the llama.cpp rows were measured for this shape only

    def shown(rows: list[dict]) -> list[dict]:
        """The rows the summary and the plot use: the graphed ones, unless graphs are off or unavailable."""
        graphed = graph_runner is not None and args.graphs != "off"
        return [r for r in rows if r["cuda_graphs"] == graphed]

    if args.check_graphs and graph_runner is not None:
        for mode in ["full-gpu" if m == "full" else m for m in args.modes]:
            print(check_graphs(model, mode, min(args.contexts), min(args.batches), plan), flush=True)
    hdr = (f"{'mode':<19}{'G':>2}{'ctx':>7}{'B':>3}{'TPOT ms':>9}{'KV read':>8}{'wait%':>7}{'wait ms':>8}{'gpu ms':>7}"
           f"{'topk':>6}{'cpuatt':>7}{'gather':>7}{'PCIe MB':>8}{'GPU%':>5}{'ZC':>3}{'zcGB/s':>7}")
    print(hdr, flush=True)
    rows: list[dict] = []
    skipped: list[str] = []
    host_cap = mem_available() * args.host_mem_fraction
    gpu_cap = torch.cuda.mem_get_info()[0] * 0.8 if dev.type == "cuda" else float("inf")
    modes = ["full-gpu" if m == "full" else m for m in args.modes]
    for context in sorted(args.contexts):
        for batch in sorted(args.batches):
            release_pinned_cache()  # the last case's slabs: another size
            for mode, graphed in [(m, g) for m in modes for g in
                                  {"on": [True], "off": [False], "both": [False, True],
                                   "uncaptured": [True]}[args.graphs]]:
                case = f"{mode} ctx {context} batch {batch}{'' if graphed else ' (no graphs)'}"
                host_need = context * batch * host_bytes_per_token(cfg)
                dev_need = context * batch * cfg.kv_bytes_per_token(2) * 1.5  # dense cache grows by doubling
                if mode != "full-gpu" and host_need > host_cap:
                    skipped.append(f"{case}: needs {host_need / 2**30:.0f} GiB host RAM")
                    continue
                if mode == "full-gpu" and dev_need > gpu_cap:
                    skipped.append(f"{case}: needs {dev_need / 2**30:.0f} GiB GPU memory")
                    continue
                if time.perf_counter() - start > args.time_budget:
                    skipped.append(f"{case}: time budget")
                    continue
                model.graphs = graph_runner if graphed else None
                # A real model's last positions: decode must stay inside its context (decode_graphs graphs only
                # positions below it; beyond, every step would run eagerly), so fill a little less
                # (--async-decode runs as many steps again after them)
                filled = min(context, cfg.context_length - (2 if args.async_decode else 1) * (args.steps + 1) - 8)
                r = measure(model, mode, filled, batch, args.steps, plan, Path(args.profile) if args.profile else None,
                            Path(args.kernel_profile) if args.kernel_profile else None, args.async_decode)
                rows.append({"mode": mode, "context": context, "batch": batch, "filled_tokens": filled,
                             "cuda_graphs": model.graphs is not None, **r})
                print(f"{mode:<19}{'y' if model.graphs is not None else '-':>2}{context:>7}{batch:>3}{r['tpot_ms']:>9.2f}{r['kv_read_fraction']:>8.3f}"
                      f"{100 * r.get('gpu_wait_ratio', 0):>7.1f}{r.get('gpu_wait_ms', 0):>8.2f}"
                      f"{r.get('gpu_compute_ms', 0):>7.2f}{r.get('cpu_topk_ms', 0):>6.1f}{r.get('cpu_attn_ms', 0):>7.1f}"
                      f"{r.get('gather_ms', 0):>7.1f}{r.get('pcie_mb', 0):>8.1f}{100 * r.get('gpu_byte_fraction', 0):>5.0f}"
                      f"{'y' if r.get('zero_copy') else '-':>3}{r.get('pcie_read_gbs', 0):>7.1f}"
                      f"   (fill {r['fill_s']:.1f}s)"
                      + (f"  async {r['tpot_async_ms']:.2f} ms" if "tpot_async_ms" in r else ""), flush=True)
                out.write_text(json.dumps({"model": name, "weights": weights, "note": note, "machine": machine,
                                           "commit": commit, "command": "python " + " ".join(sys.argv),
                                           "mode_names": "reuse",  # fluxion-gpu has the reuse cache (tpot_plot.py)
                                           "dtype": str(dtype), "plan": plan.source,
                                           "zero_copy": {"available": zc_ok, "why": zc_why,
                                                         "pcie_read_gbs": max((r.get("pcie_read_gbs", 0.0)
                                                                               for r in rows), default=0.0)},
                                           "peer_llamacpp_ms": {"kv_gpu": PEER_KV_GPU_MS, "kv_host": PEER_KV_HOST_MS},
                                           "rows": rows, "skipped": skipped,
                                           "summary": summary_lines(shown(rows), peers)}, indent=1))
    print("\n".join(summary_lines(shown(rows), peers)), flush=True)
    for s in skipped:
        print(f"skipped {s}", flush=True)
    print(f"wrote {out} ({time.perf_counter() - start:.0f} s)", flush=True)
    plot(shown(rows), out.with_suffix(".png"), note, peers)


if __name__ == "__main__":
    main()
