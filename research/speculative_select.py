"""Could a layer's blocks be chosen before its query exists? Selection quality of a query predicted one layer early.

Why (issue 5, batch 1): per layer the device step waits for block_scores -> select_top -> block_attention (its PCIe
reads) -> combine, all after the layer's q (H200, 8B shape, 32K: ~52 of ~170 us per layer, docs/hybrid.md). If
layer l's dynamic blocks were chosen from a query predicted while layer l - 1 still runs its MLP, the choice and the
PCIe reads would leave that chain. The prediction tried here: layer l's own input norm, q projection and RoPE applied
to the residual stream after layer l - 1's attention (before its MLP), i.e. layer l's query as if layer l - 1's MLP
added nothing.

Part 1, selection (teacher-forced decode with full attention over real text: nothing changes the model's output).
Per decode position, layer and retrieval group of the plan:
  true   the group's top-k blocks by the Quest bound (summed over the group's query heads) with the real query,
         k = the dynamic share (1 - pin_fraction) of the plan's budget, over blocks between sink and window
  spec   the same from the predicted query (layer l - 1's stream after its attention)
  early  the same from layer l's query computed on layer l - 1's input stream (before its attention: the choice
         could overlap all of layer l - 1, not only its MLP)
  prev   the same from the previous position's real query (what choosing one step late would read)
  oracle the k blocks with the most true attention mass (no bound can do better)
and, with the real query, other block scorings at the same k (is the Quest bound the right score at all?):
  quest_max  the largest of the group's per-head Quest bounds (not their sum)
  mean_sum   q . (the block's mean key), summed over the group's heads
  mean_max   the largest of the heads' q . (mean key)
  mid_sum    q . (the block's midrange key (min + max) / 2), summed over the heads: needs no summary beyond Quest's
  shrunkA    between the two: q . mid + A/100 * |q| . (max - min) / 2, summed over the heads (A = 100: the bound)
Means over (position, layer, group): block recall |X & true| / k, and mass share = the true attention mass (the
group's heads, full softmax) on X's blocks over the mass of all eligible blocks. Pins are not modelled here: every
eligible block competes (the shipped plan pins pin_fraction of each budget at prefill, chooses the rest per step).

Part 2 (--fidelity), the choice in the loop: three teacher-forced decodes from the same dense prefill, each with its
own K/V from there on: full attention (the reference), sparse with blocks chosen by the real query, sparse with
blocks chosen by the predicted one (layer 0: the real one), and sparse_mean: the real query's choice by mean-key
scores instead of the Quest bound. Sparse = per group sink + window + the plan's whole
budget of g-blocks by the Quest bound (no pins), streaming groups sink + window. KL(full || mode) and top-1
agreement with full, per mode.

  python research/speculative_select.py --model qwen2.5-coder-0.5b --context 4096 --positions 24 [--fidelity] --out F
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from fluxion_lite.model.attention import causal_attention
from fluxion_lite.engine.engine import Engine
from fluxion_lite.offline.eval_text import essay_tokens
from fluxion_lite.model.transformer import Transformer
from fluxion_lite.plan.sparse_plan import SparsePlan

VARIANTS = ("true", "spec", "early", "prev", "oracle", "quest_max", "mean_sum", "mean_max", "mid_sum", "shrunk25", "shrunk50")
KV = list[torch.Tensor]  # per layer [Hkv, context, D]


def quest_top(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, lo: int, hi: int, k: int) -> list[int]:
    """Top-k block ids in [lo, hi) by the Quest bound summed over the group's heads: q [r, D]; kmin, kmax [NB, D]."""
    qp, qn = q.clamp(min=0).sum(0), q.clamp(max=0).sum(0)  # [D]
    return top_of(kmax[lo:hi] @ qp + kmin[lo:hi] @ qn, lo, k)  # scores [n]


def prefill(model: Transformer, tokens: list[int], n_prefix: int, context: int) -> tuple[KV, KV]:
    """Dense prefill of tokens[:n_prefix] -> per layer K, V [Hkv, context, D] (room for the decoded positions)."""
    cfg = model.cfg
    keys = [torch.empty(cfg.n_kv_heads, context, cfg.head_dim) for _ in range(cfg.n_layers)]
    vals = [torch.empty(cfg.n_kv_heads, context, cfg.head_dim) for _ in range(cfg.n_layers)]
    for s in range(0, n_prefix, 512):  # chunked
        n = min(512, n_prefix - s)
        x, cos, sin = model.embed_tokens(torch.tensor(tokens[s:s + n]), torch.arange(s, s + n))
        for i, lw in enumerate(model.layers):
            q, k, v = model.pre_attention(lw, x, cos, sin)
            keys[i][:, s:s + n], vals[i][:, s:s + n] = k.transpose(0, 1), v.transpose(0, 1)
            o = causal_attention(q, keys[i][:, :s + n], vals[i][:, :s + n], s, cfg.head_dim ** -0.5)
            x = model.post_attention(lw, x, o)
    return keys, vals


def eligible(plan: SparsePlan, g: int, ctx: int) -> tuple[int, int]:
    """g-blocks wholly after the sink and before the window: [lo, hi)."""
    return -(-plan.sink // g), (ctx - plan.window) // g


def top_of(score: torch.Tensor, lo: int, k: int) -> list[int]:
    """The k best entries of score (over blocks lo..) as block ids."""
    return (torch.topk(score, min(k, score.shape[0])).indices + lo).tolist()


def block_bounds(k: torch.Tensor, g: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k [N, D] -> per whole g-block min, max and mean [NB, D]."""
    nb = k.shape[0] // g
    blocks = k[: nb * g].view(nb, g, -1)
    return blocks.amin(1), blocks.amax(1), blocks.mean(1)


def selection_run(model: Transformer, plan: SparsePlan, pin_fraction: float, tokens: list[int], n_prefix: int,
                  keys: KV, vals: KV) -> tuple[dict[str, dict[str, float]], int]:
    """Part 1: per variant the mean block recall and mass share (module docstring)."""
    cfg = model.cfg
    hkv, d = cfg.n_kv_heads, cfg.head_dim
    r, scale = cfg.n_heads // hkv, d ** -0.5
    sums = {v: {"recall": 0.0, "share": 0.0} for v in VARIANTS}
    count = 0
    prev_q: list[torch.Tensor | None] = [None] * cfg.n_layers
    for p in range(n_prefix, len(tokens)):
        x, cos, sin = model.embed_tokens(torch.tensor([tokens[p]]), torch.tensor([p]))
        spec_q: torch.Tensor | None = None
        early_q: torch.Tensor | None = None
        for i, lw in enumerate(model.layers):
            x_in = x.clone()  # post_attention updates x in place
            q, k, v = model.pre_attention(lw, x, cos, sin)
            q = q.clone()
            keys[i][:, p], vals[i][:, p] = k[0], v[0]
            ctx = p + 1
            kk, vv = keys[i][:, :ctx], vals[i][:, :ctx]
            o = causal_attention(q, kk, vv, p, scale)
            x_mid = x + o.reshape(1, -1) @ lw.wo.t()  # the residual stream after attention, before the MLP
            probs = torch.softmax(torch.einsum("hrd,hnd->hrn", q[0].view(hkv, r, d), kk) * scale, -1)  # [Hkv, r, N]
            for h, gp in enumerate(plan.groups[i]):
                k_all = plan.block_count(gp, ctx)  # 0: streaming here (a long-only group at a short context too)
                if k_all == 0 or spec_q is None or early_q is None or prev_q[i] is None:
                    continue
                g = gp.g
                lo, hi = eligible(plan, g, ctx)
                k_dyn = max(1, round((1 - pin_fraction) * k_all))
                if hi - lo <= k_dyn:
                    continue
                kmin, kmax, kmean = block_bounds(kk[h], g)
                nb = kmin.shape[0]
                mass = probs[h, :, : nb * g].sum(0).view(nb, g).sum(1)  # [NB]: the group's heads' mass per block
                pick = {"true": quest_top(q[0].view(hkv, r, d)[h], kmin, kmax, lo, hi, k_dyn),
                        "spec": quest_top(spec_q.view(hkv, r, d)[h], kmin, kmax, lo, hi, k_dyn),
                        "early": quest_top(early_q.view(hkv, r, d)[h], kmin, kmax, lo, hi, k_dyn),
                        "prev": quest_top(prev_q[i].view(hkv, r, d)[h], kmin, kmax, lo, hi, k_dyn),  # type: ignore[union-attr]
                        "oracle": top_of(mass[lo:hi], lo, k_dyn)}
                qh = q[0].view(hkv, r, d)[h]  # [r, D]
                per_head = kmax[lo:hi] @ qh.clamp(min=0).T + kmin[lo:hi] @ qh.clamp(max=0).T  # [n, r]
                by_mean = kmean[lo:hi] @ qh.T  # [n, r]
                by_mid = (kmin[lo:hi] + kmax[lo:hi]) @ qh.T  # [n, r]: the midrange key, from the summaries kept anyway
                pick.update({"quest_max": top_of(per_head.amax(1), lo, k_dyn),
                             "mean_sum": top_of(by_mean.sum(1), lo, k_dyn),
                             "mean_max": top_of(by_mean.amax(1), lo, k_dyn),
                             "mid_sum": top_of(by_mid.sum(1), lo, k_dyn)})
                radius = (kmax[lo:hi] - kmin[lo:hi]) @ qh.abs().T  # [n, r]: Quest bound = (mid + radius) / 2
                for a in (25, 50):
                    pick[f"shrunk{a}"] = top_of((by_mid + a / 100 * radius).sum(1), lo, k_dyn)
                true, total = set(pick["true"]), float(mass[lo:hi].sum())
                for name, got in pick.items():
                    sums[name]["recall"] += len(set(got) & true) / len(true)
                    sums[name]["share"] += float(mass[got].sum()) / max(total, 1e-12)
                count += 1
            prev_q[i] = q[0]
            x = model.post_attention(lw, x, o)
            if i + 1 < cfg.n_layers:  # layer i + 1's query from the stream before layer i's MLP, and before its attention
                spec_q = model.query_ahead(model.layers[i + 1], x_mid, cos, sin)[0]
                early_q = model.query_ahead(model.layers[i + 1], x_in, cos, sin)[0]
    return {v: {m: s / max(count, 1) for m, s in sums[v].items()} for v in VARIANTS}, count


def sparse_attention(plan: SparsePlan, layer: int, q: torch.Tensor, sel_q: torch.Tensor, kk: torch.Tensor,
                     vv: torch.Tensor, bounds: dict[tuple[int, int], tuple[torch.Tensor, ...]], scale: float,
                     mean_scoring: bool = False) -> torch.Tensor:
    """One decode row's attention under the plan: q, sel_q [Hq, D] (sel_q chooses the blocks); kk, vv [Hkv, N, D];
    bounds[(h, g)] the prefix's block min/max/mean. Per group: sink + window + the budget's top-k g-blocks by the
    Quest bound (or, mean_scoring, by sel_q . mean key summed over the group's heads) for retrieval groups, sink +
    window for streaming ones. Returns [Hq, D]."""
    hkv, n, d = kk.shape
    r = q.shape[0] // hkv
    out = torch.empty_like(q)
    near = list(range(min(plan.sink, n))) + list(range(max(plan.sink, n - plan.window), n))
    for h, gp in enumerate(plan.groups[layer]):
        idx = near
        k_all = plan.block_count(gp, n)  # 0: streaming here (a long-only group at a short context too)
        if k_all > 0:
            g = gp.g
            lo, hi = eligible(plan, g, n)
            if hi > lo:
                kmin, kmax, kmean = bounds[(h, g)]
                qs = sel_q.view(hkv, r, d)[h]
                chosen = (top_of((kmean[lo:hi] @ qs.T).sum(1), lo, k_all) if mean_scoring
                          else quest_top(qs, kmin, kmax, lo, hi, k_all))
                idx = near + [b * g + t for b in chosen for t in range(g)]
        sel = torch.tensor(sorted(set(idx)))
        qh = q.view(hkv, r, d)[h]  # [r, D]
        w = torch.softmax(qh @ kk[h, sel].T * scale, -1)  # [r, n_sel]
        out.view(hkv, r, d)[h] = w @ vv[h, sel]
    return out


def fidelity_run(model: Transformer, plan: SparsePlan, tokens: list[int], n_prefix: int, keys: KV,
                 vals: KV) -> dict[str, dict[str, float]]:
    """Part 2: KL(full || mode) and top-1 agreement for sparse decoding with the real and the predicted choice (Quest
    bound), and with the real query's choice by mean-key scores (sparse_mean)."""
    cfg = model.cfg
    d = cfg.head_dim
    scale = d ** -0.5
    modes = ("full", "sparse_true", "sparse_spec", "sparse_mean")
    kv = {m: ([k.clone() for k in keys], [v.clone() for v in vals]) for m in modes}  # each decodes on its own K/V
    # every eligible block lies in the prefix for the positions measured here (the decoded ones are in the window)
    bounds = [{(h, gp.g): block_bounds(keys[i][h, :n_prefix], gp.g) for h, gp in enumerate(plan.groups[i])
               if not gp.streaming} for i in range(cfg.n_layers)]
    logp: dict[str, list[torch.Tensor]] = {m: [] for m in modes}
    for p in range(n_prefix, len(tokens)):
        if p + 1 - plan.window > n_prefix:
            raise SystemExit("error: --positions must not exceed the window (decoded tokens would become eligible)")
        for m in modes:
            ks, vs = kv[m]
            x, cos, sin = model.embed_tokens(torch.tensor([tokens[p]]), torch.tensor([p]))
            spec_q: torch.Tensor | None = None
            for i, lw in enumerate(model.layers):
                q, k, v = model.pre_attention(lw, x, cos, sin)
                q = q.clone()
                ks[i][:, p], vs[i][:, p] = k[0], v[0]
                kk, vv = ks[i][:, :p + 1], vs[i][:, :p + 1]
                if m == "full":
                    o = causal_attention(q, kk, vv, p, scale)
                else:
                    sel_q = spec_q if m == "sparse_spec" and spec_q is not None else q[0]
                    o = sparse_attention(plan, i, q[0], sel_q, kk, vv, bounds[i], scale, m == "sparse_mean")[None]
                if m == "sparse_spec" and i + 1 < cfg.n_layers:  # the stream after attention, before the MLP
                    spec_q = model.query_ahead(model.layers[i + 1], x + o.reshape(1, -1) @ lw.wo.t(), cos, sin)[0]
                x = model.post_attention(lw, x, o)
            logp[m].append(torch.log_softmax(model.logits(x, None)[0].double(), -1))
    ref = torch.stack(logp["full"])
    result = {}
    for m in modes[1:]:
        got = torch.stack(logp[m])
        kl = (ref.exp() * (ref - got)).sum(-1)  # [positions]
        result[m] = {"kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
                     "top1_agree": float((got.argmax(-1) == ref.argmax(-1)).double().mean())}
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--context", type=int, default=4096, help="tokens of essay text: prefix + decoded positions")
    ap.add_argument("--positions", type=int, default=24, help="decode positions measured")
    ap.add_argument("--text-offset", type=int, default=0)
    ap.add_argument("--plan", default="models/qwen2.5-coder-0.5b.plan.json")
    ap.add_argument("--fidelity", action="store_true", help="also part 2: KL with the choice in the loop")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    t_start = time.perf_counter()
    eng = Engine(args.model, attention="full", max_context=args.context + 1, prefix_cache_entries=0)
    model = eng.model
    assert eng.tokenizer is not None
    tokens = essay_tokens(eng.tokenizer, args.context, args.text_offset)
    if len(tokens) < args.context:
        raise SystemExit(f"error: the essay text from offset {args.text_offset} has only {len(tokens)} tokens")
    plan = SparsePlan.load(Path(args.plan))
    pin_fraction = float(json.loads(Path(args.plan).read_text()).get("pin_fraction", 0.0))
    n_prefix = args.context - args.positions
    model.rope.ensure(args.context)
    with torch.inference_mode():
        keys, vals = prefill(model, tokens, n_prefix, args.context)
        fid = fidelity_run(model, plan, tokens, n_prefix, keys, vals) if args.fidelity else None
        sel, count = selection_run(model, plan, pin_fraction, tokens, n_prefix, keys, vals)
    result = {"model": args.model, "context": args.context, "positions": args.positions,
              "text_offset": args.text_offset, "plan": args.plan, "pin_fraction": pin_fraction, "samples": count,
              "machine": platform.node(), "seconds": time.perf_counter() - t_start, "variants": sel,
              "fidelity": fid}
    print(f"{args.model} {args.context} tokens, {args.positions} positions, {count} (position, layer, group) samples")
    print(f"{'variant':<8}{'block recall':>14}{'mass share':>12}")
    for v in VARIANTS:
        print(f"{v:<8}{sel[v]['recall']:>14.3f}{sel[v]['share']:>12.3f}")
    if fid is not None:
        print(f"{'mode':<13}{'KL mean':>10}{'KL max':>10}{'top-1':>8}")
        for m, f in fid.items():
            print(f"{m:<13}{f['kl_mean']:>10.4f}{f['kl_max']:>10.4f}{f['top1_agree']:>8.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
