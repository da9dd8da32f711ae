"""CPU attention kernels of prefill and of the decode step's streaming part: time and error against float64.

Prefill (`attention.causal_attention` on the CPU): one chunk of n queries at positions start..start+n-1 over
start + n keys, GQA. Three ways, each timed as the median of --repeats calls after one warm-up:
  flash        the shipped path (`attention.cpu_causal_attention`: torch's CPU flash kernel, an unmasked call over
               the prefix with a KV group's query heads as rows plus a causal call over the chunk, merged by LSE)
  masked_sdpa  one SDPA call with a boolean causal mask and the K/V heads repeated to the query heads
  bf16_matmul  the path before cf54bbe: q k^T as a matmul in the input dtype (bf16 scores), then the mask, softmax and
               p v, in row tiles of at most 2^24 scores (what the old code's MAX_SCORE_ELEMS bounded)
Error: relative Frobenius error of the output against float64 attention on the chunk's last --error-rows queries,
next to the bf16 rounding floor of the exact output (the least error a bf16 result can have).

Decode streaming part (`hybrid.biased_attention` on the CPU): B sequences x Hkv groups, r query rows each, over L
sink + window slots with an additive -inf bias on ~40% of them; the shipped CPU flash call against the old
matmul path (bf16 scores), same timing and error.

Shapes are the catalog models' attention (qwen2.5-coder-0.5b: Hq 14 / Hkv 2 / D 64; -1.5b: Hq 12 / Hkv 2 / D 128);
random bf16 inputs with score spreads like a real model's (q, k ~ N(0, 2.5^2)). Prints a table and writes JSON.

  python research/prefill_attention.py --threads 1 2 --out bench/results/prefill_attention_vm.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from fluxion_lite.model.attention import cpu_causal_attention
from fluxion_lite.sparse.attend import biased_attention

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # the product benchmarks they build on
sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels import timed  # noqa: E402  (bench/ is not a package; median seconds after one warm-up)
from tpot import commit_label  # noqa: E402

SHAPES = {"qwen2.5-coder-0.5b": (14, 2, 64), "qwen2.5-coder-1.5b": (12, 2, 128)}  # Hq, Hkv, D
OLD_TILE_SCORES = 1 << 24


def masked_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """q [n, Hq, D], k, v [Hkv, L, D] -> [n, Hq, D]: one masked call, K/V repeated to the query heads."""
    n, hq, _ = q.shape
    r = hq // k.shape[0]
    visible = torch.arange(k.shape[1])[None, :] <= torch.arange(start, start + n)[:, None]  # [n, L]
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.repeat_interleave(r, 0)[None],
                                         v.repeat_interleave(r, 0)[None], attn_mask=visible, scale=scale)
    return out[0].transpose(0, 1)


def bf16_matmul(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """The pre-cf54bbe CPU prefill: scores as a matmul in q's dtype, masked, softmax, p v; row tiles."""
    n, hq, d = q.shape
    hkv, total, _ = k.shape
    r = hq // hkv
    qg = q.permute(1, 0, 2).reshape(hkv, r, n, d)  # [Hkv, r, n, D]
    out = torch.empty(hkv, r, n, d, dtype=q.dtype)
    rows = max(1, OLD_TILE_SCORES // (hq * total))
    key_pos = torch.arange(total)
    for i0 in range(0, n, rows):
        i1 = min(n, i0 + rows)
        end = start + i1
        scores = torch.matmul(qg[:, :, i0:i1], k[:, None, :end].transpose(-1, -2)) * scale  # [Hkv, r, i, end]
        scores.masked_fill_(key_pos[None, :end] > torch.arange(start + i0, start + i1)[:, None], float("-inf"))
        out[:, :, i0:i1] = torch.matmul(torch.softmax(scores, dim=-1), v[:, None, :end])
    return out.reshape(hq, n, d).permute(1, 0, 2)


def exact_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float,
                  rows: int) -> torch.Tensor:
    """float64 attention of the chunk's last `rows` queries -> [rows, Hq, D]."""
    n, hq, _ = q.shape
    r = hq // k.shape[0]
    qs = q[n - rows:].double().transpose(0, 1)  # [Hq, rows, D]
    kk, vv = k.double().repeat_interleave(r, 0), v.double().repeat_interleave(r, 0)  # [Hq, L, D]
    scores = qs @ kk.transpose(-1, -2) * scale  # [Hq, rows, L]
    pos = torch.arange(start + n - rows, start + n)
    scores.masked_fill_(torch.arange(k.shape[1])[None, :] > pos[:, None], float("-inf"))
    return (torch.softmax(scores, dim=-1) @ vv).transpose(0, 1)


def old_biased(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor,
               scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """biased_attention before 17345bf: bf16 scores."""
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale + bias
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse[..., None]).to(v.dtype), v).float(), lse


def rel(a: torch.Tensor, want: torch.Tensor) -> float:
    return ((a.double() - want).norm() / want.norm()).item()


def prefill_rows(threads: int, lengths: list[int], chunk: int, repeats: int, error_rows: int) -> list[dict]:
    out = []
    for name, (hq, hkv, d) in SHAPES.items():
        scale = d**-0.5
        for total in lengths:
            n = min(chunk, total)
            start = total - n
            g = torch.Generator().manual_seed(total + d)
            q = (torch.randn(n, hq, d, generator=g) * 2.5).bfloat16()
            k = (torch.randn(hkv, total, d, generator=g) * 2.5).bfloat16()
            v = torch.randn(hkv, total, d, generator=g).bfloat16()
            want = exact_prefill(q, k, v, start, scale, error_rows)
            floor = rel(want.bfloat16(), want)
            for impl, fn in (("flash", cpu_causal_attention), ("masked_sdpa", masked_sdpa),
                             ("bf16_matmul", bf16_matmul)):
                res = fn(q, k, v, start, scale)
                ms = 1000 * timed(lambda: fn(q, k, v, start, scale), repeats)
                out.append({"kind": "prefill", "shape": name, "threads": threads, "keys": total, "queries": n,
                            "impl": impl, "ms": ms, "rel_error": rel(res[n - error_rows:], want),
                            "bf16_floor": floor})
    return out


def decode_rows(threads: int, batch: int, slots: int, repeats: int) -> list[dict]:
    out = []
    for name, (hq, hkv, d) in SHAPES.items():
        r, scale = hq // hkv, d**-0.5
        g = torch.Generator().manual_seed(slots + d)
        q = (torch.randn(batch, hkv, r, d, generator=g) * 2.5).bfloat16()
        k = (torch.randn(batch, hkv, slots, d, generator=g) * 2.5).bfloat16()
        v = torch.randn(batch, hkv, slots, d, generator=g).bfloat16()
        keep = torch.rand(batch, hkv, 1, slots, generator=g) < 0.6
        keep[..., 0] = True
        bias = torch.zeros(batch, hkv, 1, slots).masked_fill_(~keep, float("-inf"))
        s64 = q.double() @ k.double().transpose(-1, -2) * scale + bias.double()
        want = torch.softmax(s64, dim=-1) @ v.double()
        want_lse = torch.logsumexp(s64, dim=-1)
        floor = rel(want.bfloat16(), want)
        for impl, fn in (("flash", biased_attention), ("bf16_matmul", old_biased)):
            o, lse = fn(q, k, v, bias, scale)
            ms = 1000 * timed(lambda: fn(q, k, v, bias, scale), repeats)
            out.append({"kind": "decode_stream", "shape": name, "threads": threads, "batch": batch, "slots": slots,
                        "impl": impl, "ms": ms, "rel_error": rel(o, want), "bf16_floor": floor,
                        "lse_max_error": (lse.double() - want_lse).abs().max().item()})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, os.cpu_count() or 1])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192], help="keys (prefix + chunk)")
    ap.add_argument("--chunk", type=int, default=1024, help="queries per prefill chunk")
    ap.add_argument("--error-rows", type=int, default=128, help="queries checked against float64 (the chunk's last)")
    ap.add_argument("--batch", type=int, default=20, help="decode sequences")
    ap.add_argument("--slots", type=int, default=1100, help="decode sink + window slots")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="bench/results/prefill_attention.json")
    args = ap.parse_args()
    if any(t < 1 for t in args.threads) or any(n < 2 for n in args.lengths) or args.chunk < 2 or args.repeats < 1:
        ap.error("--threads, --repeats >= 1; --lengths, --chunk >= 2")
    if args.error_rows < 1 or args.error_rows > min(args.chunk, min(args.lengths)):
        ap.error("--error-rows must be between 1 and the smallest chunk")
    rows: list[dict] = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        rows += prefill_rows(threads, args.lengths, args.chunk, args.repeats, args.error_rows)
        rows += decode_rows(threads, args.batch, args.slots, args.repeats)
    print(f"{'kind':<14}{'shape':<20}{'thr':>4}{'size':>12}{'impl':>13}{'ms':>10}{'rel err':>10}{'floor':>9}"
          f"{'vs flash':>9}")
    flash_ms = {(r["kind"], r["shape"], r["threads"], r.get("keys", r.get("slots"))): r["ms"]
                for r in rows if r["impl"] == "flash"}
    for r in rows:
        size = f"{r['keys']} keys" if r["kind"] == "prefill" else f"B{r['batch']} L{r['slots']}"
        ref = flash_ms[(r["kind"], r["shape"], r["threads"], r.get("keys", r.get("slots")))]
        print(f"{r['kind']:<14}{r['shape']:<20}{r['threads']:>4}{size:>12}{r['impl']:>13}{r['ms']:>10.1f}"
              f"{r['rel_error']:>10.2e}{r['bf16_floor']:>9.1e}{r['ms'] / ref:>8.2f}x")
    meta = {"machine": platform.node(), "cpus": os.cpu_count(), "torch": torch.__version__, "commit": commit_label(),
            "command": "python research/prefill_attention.py " + " ".join(sys.argv[1:]), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(meta, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
