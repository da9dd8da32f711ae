"""Per-step cost of a dense decode step: wall time, torch op count, and time inside ops vs Python around them.

Runs the model forward alone (no sampling, no engine bookkeeping) for one decode token per sequence, after a prefill of
--context tokens. Two models: `tiny` (a random-weight llama shape, 4 layers x 512 wide) or a catalog GGUF such as
qwen2.5-coder-0.5b. Wall time (and, for --threads 1, the calling thread's CPU time, which other
processes on a shared machine do not inflate) is the median of --steps un-profiled steps; the op count and the time spent in ops come
from one torch.profiler pass over --profile-steps more steps (the profiler's own overhead inflates that pass, so the
split is reported as a fraction: python share = 1 - (sum of top-level op time) / (profiled time), where profiled time
is the thread's CPU time with --threads 1, else wall time; approximate on a loaded machine).

Usage: python research/decode_profile.py --model tiny --dtype float32 --context 2048
       python research/decode_profile.py --model qwen2.5-coder-0.5b --dtype bfloat16 --context 512
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from fluxion_lite.model.attention import DenseAttention, SeqChunk
from fluxion_lite.model.config import ModelConfig
from fluxion_lite.model.gguf_loader import GGUFModel, load_gguf
from fluxion_lite.model.transformer import Transformer

TINY = ModelConfig(arch="llama", n_layers=4, d_model=512, d_ff=1024, n_heads=8, n_kv_heads=2, head_dim=64,
                   vocab_size=1000, context_length=131072, rms_eps=1e-5, rope_theta=10000.0, rope_dim=64,
                   rope_style="interleaved")


def tiny_model(dtype: torch.dtype, device: torch.device) -> Transformer:
    cfg = TINY
    gen = torch.Generator().manual_seed(0)
    q_out, kv_out = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.02

    t = {"token_embd.weight": rnd(cfg.vocab_size, cfg.d_model), "output.weight": rnd(cfg.vocab_size, cfg.d_model),
         "output_norm.weight": torch.ones(cfg.d_model)}
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        t |= {p + "attn_norm.weight": torch.ones(cfg.d_model), p + "ffn_norm.weight": torch.ones(cfg.d_model),
              p + "attn_q.weight": rnd(q_out, cfg.d_model), p + "attn_k.weight": rnd(kv_out, cfg.d_model),
              p + "attn_v.weight": rnd(kv_out, cfg.d_model), p + "attn_output.weight": rnd(cfg.d_model, q_out),
              p + "ffn_gate.weight": rnd(cfg.d_ff, cfg.d_model), p + "ffn_up.weight": rnd(cfg.d_ff, cfg.d_model),
              p + "ffn_down.weight": rnd(cfg.d_model, cfg.d_ff)}
    return Transformer(GGUFModel(Path("tiny"), cfg, {}, t), device=device, dtype=dtype)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny", help="`tiny` or a catalog model name / GGUF path")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--profile-steps", type=int, default=5)
    ap.add_argument("--top", type=int, default=0, help="print the N ops with the most self CPU time")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default). With 2 cores shared "
                    "with other work, 2 OpenMP threads can wait milliseconds per parallel op for a core: 1 is steadier")
    ap.add_argument("--label", default="", help="free text stored with the row (e.g. before / after)")
    ap.add_argument("--out", default=None, help="append the result row (JSON) to this file")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.model == "tiny":
        model = tiny_model(dtype, device)
    else:
        from fluxion_lite.hub.resolve import resolve_model

        model = Transformer(load_gguf(resolve_model(args.model, pull_missing=False), torch.float32), device, dtype)
    cfg = model.cfg
    attn = DenseAttention(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, dtype, device)
    n_steps = args.steps + args.profile_steps + 2
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.context + n_steps), generator=gen)
    for b in range(args.batch):
        attn.allocate(b)
        for s in range(0, args.context, 512):
            n = min(512, args.context - s)
            model.forward(tokens[b, s : s + n], torch.arange(s, s + n), [SeqChunk(b, s, n)], attn)
    pos = args.context

    def step() -> None:
        nonlocal pos
        model.forward(tokens[:, pos], torch.full((args.batch,), pos), [SeqChunk(b, pos, 1) for b in range(args.batch)],
                      attn, logit_rows=torch.arange(args.batch))
        pos += 1

    for _ in range(2):
        step()
    times, cpu_times = [], []
    for _ in range(args.steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0, c0 = time.perf_counter(), time.thread_time()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        cpu_times.append(time.thread_time() - c0)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.thread_time() if args.threads == 1 else time.perf_counter()
        for _ in range(args.profile_steps):
            step()
        prof_wall = (time.thread_time() if args.threads == 1 else time.perf_counter()) - t0
    events = prof.events()
    # top-level ops: torch ops (aten::, mkldnn::, ...) not called from inside another op (their CPU time includes the
    # kernels they launch)
    top = [e for e in events if e.cpu_parent is None and "::" in e.name]
    all_ops = [e for e in events if "::" in e.name]
    op_us = sum(e.cpu_time_total for e in top)
    row = {
        "model": args.model, "dtype": args.dtype, "context": args.context, "batch": args.batch,
        "step_ms_median": 1000 * statistics.median(times),
        # CPU time of this thread: with --threads 1 on the CPU it is the step's own work, not time spent waiting for a
        # core that other processes hold (the VM's 2 cores are shared)
        "step_thread_cpu_ms_median": 1000 * statistics.median(cpu_times),
        "top_level_ops_per_step": len(top) / args.profile_steps,
        "aten_calls_per_step": len(all_ops) / args.profile_steps,
        "python_share": max(0.0, 1 - op_us / 1e6 / prof_wall),
        "threads": torch.get_num_threads(), "label": args.label,
    }
    print(json.dumps(row))
    if args.top:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
    if args.out:
        with open(args.out, "a") as fh:
            fh.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
