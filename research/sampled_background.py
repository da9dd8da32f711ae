"""Teacher-forced fidelity of a simulated block top-k whose weakest picks are swapped for a weighted even sample
of the blocks it leaves unread.

A per-step top-k drops everything it does not pick; the full model's output still holds that part, and on RULER's
look-alike haystacks it is ~20% of a layer's attention mass (research/copy_heads.py). Swapping the top-k's last
`share` of blocks for as many blocks spread evenly over the eligible blocks left unread, each weighted by
(unread blocks) / (sampled blocks) (a logit bias of log of that weight: a stratified estimate of the unread part,
with the sampled tokens' own keys and values), reads the same number of blocks. `--unweighted` variants give the
sampled blocks weight 1 (an even spread of extra blocks, as pinned.pick_pins' stride does at prefill end).

Every KV group reads sink + window + its top `budget` of g-token blocks by the Quest bound summed over its query
heads (as research/background_fidelity.py); decode the last M tokens of essay text one at a time, KL(full || sim) and
top-1 agreement. A policy simulation in fp32, not the engine's kernels.

Usage: python research/sampled_background.py --model qwen2.5-coder-0.5b --context 4096 --positions 64 \\
           --budgets 0.02 0.05 --shares 0.25 0.5 --out bench/results/sampled_background_0.5b_4096_vm.json
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # the product benchmarks they build on
sys.path.insert(0, str(Path(__file__).resolve().parent))
from copy_heads import block_mask, quest_bound  # noqa: E402
from policy_sim import SimulatedBackend, add_case_args, essay_case, print_policies, run_policy  # noqa: E402
from ruler_paired import write_out  # noqa: E402

from fluxion_lite.plan import pins as pinned  # noqa: E402
from fluxion_lite.model.attention import DenseAttention, SeqChunk  # noqa: E402


def sampled_selection(bound: torch.Tensor, first: int, last: int, k: int, share: float
                      ) -> tuple[list[int], list[int], float]:
    """Blocks of one step: the top k - s by `bound` [>= last] among [first, last), and s = round(share x k) blocks
    spread evenly over the eligible blocks the first part leaves -> (top blocks, sampled blocks, their weight)."""
    k = min(k, last - first)
    s = min(int(round(share * k)), k)
    order = torch.argsort(bound[first:last], descending=True, stable=True) + first
    top = order[: k - s].tolist()
    rest = sorted(order[k - s :].tolist())
    if not s or not rest:
        return top, [], 1.0
    return top, pinned.spread_evenly(np.array(rest), s).tolist(), len(rest) / s


def group_step(qg: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, g: int, budget: float, sink: int,
               window: int, share: float, weighted: bool, scale: float) -> tuple[torch.Tensor, float]:
    """One KV group's output for one query: qg [r, D]; keys/values [N, D] -> ([r, D], fraction of the N read)."""
    n = keys.shape[0]
    sink_hi, win_lo = pinned.aligned_sink_window(g, n, sink, window)
    first, last = sink_hi // g, win_lo // g
    bias = torch.zeros(n)
    k = math.ceil(budget * n / g)
    top: list[int] = []
    picks: list[int] = []
    if last > first and k > 0:
        top, picks, weight = sampled_selection(quest_bound(qg, keys, g, n), first, last, k, share)
        if weighted and picks:
            for b in picks:
                bias[b * g : (b + 1) * g] = math.log(weight)
    mask = block_mask(n, g, sink_hi, win_lo, top + picks)
    logits = (qg @ keys.T) * scale + bias[None, :]  # [r, N]
    probs = torch.softmax(logits.masked_fill(~mask[None, :], float("-inf")), dim=-1)
    return probs @ values, float(mask.float().mean())


class SimulatedSampled(SimulatedBackend):
    """Dense prefill; each decode step per KV group: sink + window + top-k with the weakest `share` swapped for an
    even (weighted) sample of the unread blocks."""

    def __init__(self, base: DenseAttention, g: int, budget: float, sink: int, window: int, share: float,
                 weighted: bool) -> None:
        self.cache, self.scale = base.cache, base.scale
        self.g, self.budget, self.sink, self.window = g, budget, sink, window
        self.share, self.weighted = share, weighted
        self.read: list[float] = []

    def _decode(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                chunks: list[SeqChunk]) -> torch.Tensor:
        keys, values, qg = self.step_inputs(layer, q, k, v, chunks)  # [Hkv, N, D] x2, q [Hkv, r, D]
        outs = []
        for h in range(keys.shape[0]):
            o, frac = group_step(qg[h], keys[h].float(), values[h].float(), self.g, self.budget, self.sink,
                                 self.window, self.share, self.weighted, self.scale)
            outs.append(o)
            self.read.append(frac)
        return torch.stack(outs).reshape(q.shape).to(q.dtype)  # [Hkv, r, D] -> [1, Hq, D]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_case_args(ap, positions=64)
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.02, 0.05])
    ap.add_argument("--shares", type=float, nargs="+", default=[0.25, 0.5])
    ap.add_argument("--unweighted", action="store_true", help="also each share with the sampled blocks at weight 1")
    args = ap.parse_args()
    case = essay_case(args.model, args.context, args.positions, args.text_offset)
    rows: dict[str, Any] = {}
    for budget in args.budgets:
        variants = [(0.0, True)] + [(s, True) for s in args.shares]
        variants += [(s, False) for s in args.shares] if args.unweighted else []
        for share, weighted in variants:
            name = f"g{args.g} b{budget:g}" + ("" if not share else f" swap{share:g}{'' if weighted else ' w1'}")
            sim = SimulatedSampled(case.base, args.g, budget, args.sink, args.window, share, weighted)
            rows[name] = run_policy(case, name, sim)
    print_policies(f"{args.model}, {args.context} tokens of essay text, last {args.positions} decoded one at a time "
                   f"(float32), top-k with a weighted even sample of the unread blocks vs full", rows, width=26)
    write_out(args.out, {"model": args.model, "context": args.context, "positions": args.positions,
                         "text_offset": args.text_offset, "g": args.g, "sink": args.sink, "window": args.window,
                         "rows": rows})


if __name__ == "__main__":
    main()
