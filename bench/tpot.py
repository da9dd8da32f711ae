"""Time per output token (TPOT) at long context, per attention mode, on random-weight models of real shapes.

Shapes: llama3.1-8b (32 layers, 4096 wide, 32 q / 8 kv heads, head_dim 128, ffn 14336, vocab 128256), qwen2.5-7b,
and `tiny` (for a CPU smoke run). Weights are random (bf16 on CUDA), so only speed is meaningful. The `fluxion` plan
for these shapes is drawn from the calibrated plan of qwen2.5-coder-0.5b (models/qwen2.5-coder-0.5b.plan.json): each
(layer, group) copies the entry of a random group in the proportionally mapped qwen layer.

Modes: full (dense KV on the compute device), fixed and fluxion (KV in the host store, sparse decode on the CPU path:
the GPU waits while the CPU runs top-k and sparse attention; the priority scheduler is not built yet).

Usage: python bench/tpot.py --shape llama3.1-8b --contexts 8192 32768 --batches 1 --modes full fixed fluxion
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import subprocess
import time
from pathlib import Path

import torch

from fluxion_lite.attention import SeqChunk
from fluxion_lite.config import ModelConfig
from fluxion_lite.engine import fixed_plan, make_attention
from fluxion_lite.gguf_loader import GGUFModel
from fluxion_lite.model import Transformer
from fluxion_lite.sparse_plan import GroupPlan, SparsePlan

SHAPES = {
    "llama3.1-8b": dict(arch="llama", n_layers=32, d_model=4096, d_ff=14336, n_heads=32, n_kv_heads=8, head_dim=128,
                        vocab_size=128256, rope_theta=500000.0, rope_style="interleaved", qkv_bias=False),
    "qwen2.5-7b": dict(arch="qwen2", n_layers=28, d_model=3584, d_ff=18944, n_heads=28, n_kv_heads=4, head_dim=128,
                       vocab_size=152064, rope_theta=1000000.0, rope_style="neox", qkv_bias=True),
    "tiny": dict(arch="llama", n_layers=4, d_model=512, d_ff=1024, n_heads=8, n_kv_heads=2, head_dim=64,
                 vocab_size=1000, rope_theta=10000.0, rope_style="interleaved", qkv_bias=False),
}


def random_model(shape: str, device: torch.device, dtype: torch.dtype, seed: int = 0) -> Transformer:
    s = SHAPES[shape]
    cfg = ModelConfig(context_length=131072, rms_eps=1e-5, rope_dim=s["head_dim"], tied_embeddings=False, **s)
    gen = torch.Generator(device=device).manual_seed(seed)
    q_out, kv_out = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim

    def rnd(*shape_: int) -> torch.Tensor:
        return (torch.randn(*shape_, generator=gen, device=device, dtype=torch.float32) * 0.02).to(dtype)

    t = {"token_embd.weight": rnd(cfg.vocab_size, cfg.d_model), "output.weight": rnd(cfg.vocab_size, cfg.d_model),
         "output_norm.weight": torch.ones(cfg.d_model, device=device, dtype=dtype)}
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        t |= {p + "attn_norm.weight": torch.ones(cfg.d_model, device=device, dtype=dtype),
              p + "ffn_norm.weight": torch.ones(cfg.d_model, device=device, dtype=dtype),
              p + "attn_q.weight": rnd(q_out, cfg.d_model), p + "attn_k.weight": rnd(kv_out, cfg.d_model),
              p + "attn_v.weight": rnd(kv_out, cfg.d_model), p + "attn_output.weight": rnd(cfg.d_model, q_out),
              p + "ffn_gate.weight": rnd(cfg.d_ff, cfg.d_model), p + "ffn_up.weight": rnd(cfg.d_ff, cfg.d_model),
              p + "ffn_down.weight": rnd(cfg.d_model, cfg.d_ff)}
        if cfg.qkv_bias:
            t |= {p + "attn_q.bias": rnd(q_out), p + "attn_k.bias": rnd(kv_out), p + "attn_v.bias": rnd(kv_out)}
    return Transformer(GGUFModel(Path(shape), cfg, {}, t), device=device, dtype=dtype)


def borrowed_plan(cfg: ModelConfig, source: Path, seed: int = 0) -> SparsePlan:
    src = SparsePlan.load(source)
    rng = random.Random(seed)
    groups: list[list[GroupPlan]] = []
    for layer in range(cfg.n_layers):
        row = src.groups[layer * len(src.groups) // cfg.n_layers]
        groups.append([rng.choice(row) for _ in range(cfg.n_kv_heads)])
    return SparsePlan(src.sink, src.window, groups, source=f"drawn from {source.name}")


def tpot(model: Transformer, mode: str, context: int, batch: int, steps: int, plan_source: Path) -> dict[str, float]:
    cfg, dev = model.cfg, model.device
    plan = None if mode == "full" else (fixed_plan(cfg) if mode == "fixed" else borrowed_plan(cfg, plan_source))
    attn = make_attention("full" if mode == "full" else "fluxion", cfg, model.dtype, dev, batch + 1, "synthetic", plan=plan)
    tokens = torch.randint(0, cfg.vocab_size, (context + steps,))
    chunk = 2048 if dev.type == "cuda" else 256
    for b in range(batch):
        attn.allocate(b)
        for s in range(0, context, chunk):
            n = min(chunk, context - s)
            model.forward(tokens[s : s + n], torch.arange(s, s + n), [SeqChunk(b, s, n)], attn)
    times = []
    attn.reset_stats()
    for i in range(steps):
        pos = context + i
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.forward(tokens[pos : pos + 1].repeat(batch), torch.full((batch,), pos),
                      [SeqChunk(b, pos, 1) for b in range(batch)], attn)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    host, gpu = attn.bytes_used()
    stats = attn.stats()
    for b in range(batch):
        attn.free(b)
    warm = times[2:] if len(times) > 4 else times
    return {"tpot_ms": 1000 * statistics.median(warm), "kv_read_fraction": stats.get("kv_read_fraction", 1.0),
            "kv_host_bytes": host, "kv_device_bytes": gpu}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="tiny", choices=list(SHAPES))
    ap.add_argument("--contexts", nargs="+", type=int, default=[2048])
    ap.add_argument("--batches", nargs="+", type=int, default=[1])
    ap.add_argument("--modes", nargs="+", default=["full", "fixed", "fluxion"])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--plan-source", default="models/qwen2.5-coder-0.5b.plan.json")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = random_model(args.shape, dev, dtype)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    machine = torch.cuda.get_device_name() if dev.type == "cuda" else platform.processor() or platform.node()
    print(f"{args.shape} random weights, {dtype}, {machine}, commit {commit or '?'}")
    print(f"{'mode':<9}{'context':>8}{'batch':>6}{'TPOT ms':>10}{'KV read':>9}{'vs fixed':>9}")
    rows = []
    for context in args.contexts:
        for batch in args.batches:
            fixed_ms = None
            for mode in args.modes:
                r = tpot(model, mode, context, batch, args.steps, Path(args.plan_source))
                fixed_ms = r["tpot_ms"] if mode == "fixed" else fixed_ms
                ratio = f"{fixed_ms / r['tpot_ms']:.2f}x" if fixed_ms and mode != "fixed" else "-"
                rows.append({"mode": mode, "context": context, "batch": batch, **r})
                print(f"{mode:<9}{context:>8}{batch:>6}{r['tpot_ms']:>10.2f}{r['kv_read_fraction']:>9.3f}{ratio:>9}",
                      flush=True)
    out = Path(args.out or f"bench/results/tpot_{args.shape}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"shape": args.shape, "machine": machine, "commit": commit, "dtype": str(dtype),
                               "plan": f"fluxion plan drawn from {args.plan_source}", "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
