"""What the unread context costs, and whether block summaries can stand in for it (offline, real model Q/K/V).

Every sparse configuration drops the tokens it does not read and renormalises over the rest, so its output is
full attention's with the unread part's share (its mass x its mean value) taken out. At 32K every sparse run tried
loses the same RULER samples (docs/history.md), whatever its budget: a bias common to all
of them. This measures, on real Q/K/V of RULER prompts, how much of a retrieval group's output error that dropped
part is, and how much of it comes back when each unread span is approximated from per-block running sums (sum of
keys and sum of values) at summary block size G:

    unread span U of block B: mass ~ |U| exp(s q.kbar_U), value ~ vbar_U,

where kbar_U and vbar_U come from B's sums minus the read tokens' own keys and values (the reader has
those). The estimate merges with the read part as one more softmax term, as the streaming and retrieval parts
merge by log-sum-exp. `+oracle` gives each unread span its true mass (the ceiling of any mass estimate that keeps
the mean value: what is left is the value's error). Per configuration: the contribution-weighted relative output deviation from full attention
(the calibration's error measure, fluxion_lite/plan/calibration.py), the unread share of full's attention mass, and the
metadata those sums cost per step as a fraction of the KV bytes.

Usage: python research/background_mass.py --dir .ruler_ids --length 4096 --tasks niah_multivalue niah_multiquery vt \
           --per-task 2 --positions 16 --budgets 0.02 0.05 --summary-g 16 64 128 --out bench/results/background_mass.json
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # the product benchmarks they build on
sys.path.insert(0, str(Path(__file__).resolve().parent))
from ruler_paired import write_out  # noqa: E402  (scripts import each other by name)
from ruler_split import exported_samples  # noqa: E402

from fluxion_lite.plan.space import Config  # noqa: E402

from fluxion_lite.plan.calibration import capture_prompt, group_outputs  # noqa: E402


MASSES = ("mean", "oracle", "minmax", "midrange")  # background_output's mass rules
VALUES = ("unread", "block")  # its value rules


def background_output(qg: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor,
                      causal: torch.Tensor, block: int, scale: float, mass: str,
                      scores: torch.Tensor | None = None, value: str = "unread") -> tuple[torch.Tensor, float]:
    """Read tokens exactly plus one estimated term per summary block for its unread tokens.

    mass: "mean" (|U| exp(s q.kbar)), "oracle" (the unread tokens' true mass: what a mass estimate aims at; not
    the best on RULER's cwe, docs/history.md), "minmax" or "midrange" (from the per-16-token key minimum and maximum the top-k's
    summaries already hold: see minmax_logits). value: "unread" (the unread tokens' mean value: needs the read
    tokens' values subtracted from the block's sum) or "block" (the whole block's mean value, read tokens included:
    what a per-block running sum alone gives). qg: [M, r, D]; keys/values: [N, D]; allowed/causal: [M, N] bool.
    Returns the output [M, r, D] and the estimated over the true unread mass (mean over M, r). scores: s q.k
    [M, r, N] if the caller has them (computed here otherwise).
    """
    if mass not in MASSES:
        raise ValueError(f"mass={mass!r}: use one of {', '.join(MASSES)}")
    if value not in VALUES:
        raise ValueError(f"value={value!r}: use one of {', '.join(VALUES)}")
    m, r, d = qg.shape
    n = keys.shape[0]
    nb = -(-n // block)
    pad = nb * block - n
    unread = (causal & ~allowed).double()  # [M, N]
    u = torch.nn.functional.pad(unread, (0, pad)).view(m, nb, block)  # [M, nb, G]
    kp = torch.nn.functional.pad(keys.double(), (0, 0, 0, pad)).view(nb, block, d)
    vp = torch.nn.functional.pad(values.double(), (0, 0, 0, pad)).view(nb, block, d)
    # the block sums minus the read tokens' part = the unread tokens' sums (what a reader with the block's running
    # sums and the tokens it read can form); here summed over the unread tokens directly, which is the same number
    count = u.sum(-1)  # [M, nb]
    vsum = torch.einsum("mbg,bgd->mbd", u, vp)
    has = count > 0
    c = count.clamp(min=1.0)[..., None]
    vbar = vsum / c  # [M, nb, D]
    if value == "block":  # every valid token of the block, read or not
        valid = torch.nn.functional.pad(causal.double(), (0, pad)).view(m, nb, block)  # [M, nb, G]
        vbar = torch.einsum("mbg,bgd->mbd", valid, vp) / valid.sum(-1).clamp(min=1.0)[..., None]
    s_all = (torch.einsum("mrd,nd->mrn", qg.double(), keys.double()) * scale if scores is None
             else scores.double())  # [M, r, N]
    s_unread = torch.nn.functional.pad(s_all.masked_fill(~(unread > 0)[:, None, :], float("-inf")), (0, pad),
                                       value=float("-inf")).view(m, r, nb, block).logsumexp(-1)  # [M, r, nb]
    if mass == "oracle":
        logit = s_unread
    elif mass in ("minmax", "midrange"):
        logit = minmax_logits(qg, keys, unread, block, scale, variance=mass == "minmax")
    else:
        kbar = torch.einsum("mbg,bgd->mbd", u, kp) / c  # [M, nb, D]: the unread tokens' mean key
        logit = torch.einsum("mrd,mbd->mrb", qg.double(), kbar) * scale  # [M, r, nb]
        logit = logit + count.clamp(min=1.0).log()[:, None, :]
        logit = logit.masked_fill(~has[:, None, :], float("-inf"))
    true_total = s_unread.logsumexp(-1)  # [M, r]
    ratio = float((logit.logsumexp(-1) - true_total).exp().mean()) if bool(has.any()) else 1.0
    s = s_all.masked_fill(~allowed[:, None, :], float("-inf"))
    both = torch.cat([s, logit], dim=-1)  # [M, r, N + nb]
    p = torch.softmax(both, dim=-1)
    return (p[..., :n] @ values.double() + torch.einsum("mrb,mbd->mrd", p[..., n:], vbar)).float(), ratio


SUMMARY_SUB = 16  # the retrieval block whose key min / max the engine keeps (g = 16)
RANGE_PER_SIGMA = 3.5  # expected range of 16 normal samples, in standard deviations


def minmax_logits(qg: torch.Tensor, keys: torch.Tensor, unread: torch.Tensor, block: int,
                  scale: float, variance: bool = True) -> torch.Tensor:
    """Log of each summary block's unread mass, estimated per 16-token sub-block from its keys' min and max alone.

    A sub-block's scores s q.k are taken as normal with mean s q.mid (mid = (min + max) / 2 per dimension) and
    variance s^2 sum_d q_d^2 sigma_d^2 (sigma_d = range_d / RANGE_PER_SIGMA, dimensions independent), so its mean
    exp-score is exp(mean + variance / 2) (log-normal), times the sub-block's unread count; variance=False drops
    the variance term (the midrange key as the sub-block's typical key). qg: [M, r, D]; keys: [N, D]; unread:
    [M, N] (0 / 1). Returns [M, r, nb] (-inf where a block has nothing unread).
    """
    if block % SUMMARY_SUB:
        raise ValueError(f"summary block {block} is not a multiple of {SUMMARY_SUB}")
    m, r, d = qg.shape
    n = keys.shape[0]
    ns = -(-n // SUMMARY_SUB)
    nb = -(-n // block)
    k64 = keys.double()
    pad = ns * SUMMARY_SUB - n
    kmin = torch.nn.functional.pad(k64, (0, 0, 0, pad), value=float("inf")).view(ns, SUMMARY_SUB, d).amin(1)
    kmax = torch.nn.functional.pad(k64, (0, 0, 0, pad), value=float("-inf")).view(ns, SUMMARY_SUB, d).amax(1)
    mid, sigma = (kmin + kmax) / 2, (kmax - kmin) / RANGE_PER_SIGMA  # [ns, D]
    q64 = qg.double()
    mean = torch.einsum("mrd,sd->mrs", q64, mid) * scale  # [M, r, ns]
    var = torch.einsum("mrd,sd->mrs", q64 * q64, sigma * sigma) * scale * scale
    count = torch.nn.functional.pad(unread, (0, pad)).view(m, ns, SUMMARY_SUB).sum(-1)  # [M, ns]
    sub = mean + (var / 2 if variance else 0.0) + count.clamp(min=1.0).log()[:, None, :]
    sub = sub.masked_fill((count == 0)[:, None, :], float("-inf"))
    per = block // SUMMARY_SUB
    sub = torch.nn.functional.pad(sub, (0, nb * per - ns), value=float("-inf")).view(m, r, nb, per)
    return sub.logsumexp(-1)  # [M, r, nb]


def prompt_errors(model: Any, ids: list[int], m: int, configs: list[Config], summary_g: list[int], sink: int,
                  window: int) -> dict[str, dict[str, float]]:
    """Per configuration (and with each background estimate): contribution-weighted deviation, unread mass share."""
    cfgm = model.cfg
    cap = capture_prompt(model, ids, m)
    r, d, hkv = cfgm.gqa_ratio, cfgm.head_dim, cfgm.n_kv_heads
    positions = torch.arange(len(ids) - m, len(ids))
    collected: dict[str, list[float]] = {}  # name -> one value per (layer, group)
    for layer in range(cfgm.n_layers):
        q = torch.cat(cap.q[layer]).view(m, hkv, r, d)  # [M, Hkv, r, D]
        keys, values = cap.kv[layer]  # [Hkv, N, D]
        wo = model.layers[layer].wo.float()  # [d_model, Hq*D]
        outs, contrib_raw = [], []
        for h in range(hkv):
            masks: dict[str, torch.Tensor] = {}
            res = group_outputs(q[:, h], keys[h], values[h], positions, configs, sink, window, d**-0.5, masks)
            outs.append((res, masks))
            proj = res["full"][0].reshape(m, r * d) @ wo[:, h * r * d : (h + 1) * r * d].T
            contrib_raw.append(proj.norm(dim=-1))
        contrib = torch.stack(contrib_raw)
        contrib = contrib / contrib.sum(0, keepdim=True).clamp(min=1e-12)  # [Hkv, M]
        n = keys.shape[1]
        causal = torch.arange(n)[None, :] < (positions + 1)[:, None]
        for h in range(hkv):
            res, masks = outs[h]
            full = res["full"][0]
            ref = full.reshape(m, -1).norm(dim=-1).clamp(min=1e-12)
            scores = torch.einsum("mrd,nd->mrn", q[:, h].double(), keys[h].double()) * d**-0.5  # [M, r, N]
            probs = torch.softmax(scores.masked_fill(~causal[:, None, :], float("-inf")), dim=-1)  # [M, r, N]

            def add(name: str, out: torch.Tensor, h: int = h, full: torch.Tensor = full, ref: torch.Tensor = ref) -> None:
                dev = (out - full).reshape(m, -1).norm(dim=-1) / ref
                collected.setdefault(name, []).append(float((contrib[h] * dev).sum()) / m)

            for cfg in configs:
                allowed = masks[cfg.key]
                add(cfg.key, res[cfg.key][0])
                unread_mass = float((probs * (~allowed)[:, None, :]).sum(-1).mean())
                collected.setdefault(f"{cfg.key} unread mass", []).append(unread_mass)
                for gs in summary_g:
                    for mass in MASSES:
                        est, ratio = background_output(q[:, h], keys[h], values[h], allowed, causal, gs, d**-0.5,
                                                       mass, scores)
                        name = f"{cfg.key} +bg{gs}" + ("" if mass == "mean" else f"+{mass}")
                        add(name, est)
                        collected.setdefault(f"{name} mass ratio", []).append(ratio)
    # per (layer, group) values: deviations are contribution-weighted within a layer, so sum over groups / layers
    n_layers = cfgm.n_layers
    per_layer = lambda k: "unread mass" not in k and "mass ratio" not in k  # noqa: E731
    return {k: {"mean": sum(v) / n_layers if per_layer(k) else sum(v) / len(v)} for k, v in collected.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--dir", default=".ruler_ids", help="bench/ruler_split.py export folder (prompts' token ids)")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--tasks", nargs="+", default=["niah_multivalue", "niah_multiquery", "vt"])
    ap.add_argument("--per-task", type=int, default=2)
    ap.add_argument("--positions", type=int, default=16, help="the prompt's last M tokens are the queries")
    ap.add_argument("--g", type=int, default=16, help="retrieval block size")
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.02, 0.05])
    ap.add_argument("--summary-g", type=int, nargs="+", default=[16, 64, 128])
    ap.add_argument("--sink", type=int, default=16)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    meta, prompts = exported_samples(args.dir, args.model, args.length)
    picked = [(s, ids) for s, ids in zip(meta["samples"], prompts)
              if s["task"] in args.tasks and s["index"] < args.per_task]
    if not picked:
        sys.exit(f"error: no sample of {args.tasks} among {args.model}'s exported samples at {args.length}")
    from fluxion_lite.engine.engine import Engine

    engine = Engine(args.model, attention="full", prefix_cache_entries=0)
    configs = [Config(True)] + [Config(False, args.g, b) for b in args.budgets]
    per_prompt = []
    t0 = time.time()
    for s, ids in picked:
        with torch.no_grad():
            res = prompt_errors(engine.model, ids, args.positions, configs, args.summary_g, args.sink, args.window)
        per_prompt.append({"task": s["task"], "index": s["index"], "tokens": len(ids), "results": res})
        print(f"{s['task']} #{s['index']} ({len(ids)} tokens) done at {time.time() - t0:.0f} s", flush=True)
    names = list(per_prompt[0]["results"])
    mean = {k: sum(p["results"][k]["mean"] for p in per_prompt) / len(per_prompt) for k in names}
    print(f"\n{len(per_prompt)} prompts x {args.positions} positions at {args.length}, sink {args.sink}, window "
          f"{args.window}, retrieval g={args.g}")
    print(f"{'configuration':<28} {'deviation':>10} {'unread mass':>12} {'est / true':>11} {'sums / KV bytes':>16}")
    for k in names:
        if "unread mass" in k or "mass ratio" in k:
            continue
        base = k.split(" ")[0]
        um = mean.get(f"{base} unread mass")
        meta_cost = ""
        if "+bg" in k and "oracle" not in k:
            gs = int(k.split("+bg")[1].split("+")[0])
            # fp32 K and V sums: 8 bytes a dim per gs tokens of bf16 K, V (4 gs); minmax keeps the V sums only (its
            # key statistics are the g = 16 min / max the top-k scans anyway)
            meta_cost = f"{(1 if 'minmax' in k or 'midrange' in k else 2) / gs:.1%}"
        ratio = mean.get(f"{k} mass ratio")
        print(f"{k:<28} {mean[k]:10.4f} {('' if um is None else f'{um:.3f}'):>12} "
              f"{('' if ratio is None else f'{ratio:.2f}'):>11} {meta_cost:>16}")
    write_out(args.out, {"model": args.model, "length": args.length, "positions": args.positions,
                         "sink": args.sink, "window": args.window, "g": args.g,
                         "mean": mean, "prompts": per_prompt})


if __name__ == "__main__":
    main()
