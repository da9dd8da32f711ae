"""Which per-step block scoring picks the blocks that matter? Teacher-forced fidelity of simulated top-k policies
that differ only in how they rank blocks.

At 32K every sparse plan tried loses the same RULER samples whatever its budget (docs/history.md), while the
pins, chosen once at prefill end from *exact* attention, are worth 12 points there: the per-step ranking (the Quest
bound over each block's key extremes) is the weak part. This compares, at the same blocks read per step:

- quest:  the bound sum_d max(q_d kmin_d, q_d kmax_d), summed over the group's query heads (the engine's ranking);
- exact:  each block's true softmax mass, summed over the group's query heads (an oracle: it reads every key);
- int4 / int2: the mass computed from keys quantised per token (symmetric, absmax scale; 4 bits = 1/8 of the K+V
  bytes in bf16, the same bytes a g=16 min/max summary scans; 2 bits half that): a key sketch the device could hold;
- lowrankR: the mass from q and keys projected on the top R principal directions of the prompt's keys (per layer
  and KV group; R/D of the key bytes);
- vaware: what leaving a block out moves the output by (an oracle: every key and value): per head, the norm of
  sum over the block's tokens of p_t (v_t - o) with o the full output, summed over the group's heads;
- mass_meanv: the exact block mass times the distance of the block's mean value from the sink + window output
  (a per-block mean-value summary and an output the step has anyway, with the oracle's mass);
- quest_meanv: the same with each head's Quest bounds turned into a mass (softmax over the blocks of bound x
  scale) in place of the exact one: the cheap form (min/max key and mean value summaries).

Decode the last M tokens of essay text one at a time over a dense prefill (as bench/fidelity.py does); every KV
group reads sink + window + the top `budget` of its g-token blocks under the ranking; report KL(full || policy),
top-1 agreement and the fraction of the context read. A policy simulation in torch (fp32), not the engine's kernels.

Usage: python research/block_scoring.py --context 4096 --positions 32 --budget 0.02 --scorings quest exact int4 int2 \
           lowrank8 --out bench/results/block_scoring_qwen2.5-coder-0.5b_4096_vm.json
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # the product benchmarks they build on
sys.path.insert(0, str(Path(__file__).resolve().parent))
from policy_sim import SimulatedBackend, add_case_args, essay_case, print_policies, run_policy  # noqa: E402
from ruler_paired import write_out  # noqa: E402

from fluxion_lite.plan import pins as pinned  # noqa: E402
from fluxion_lite.model.attention import DenseAttention, SeqChunk  # noqa: E402


def quantise_rows(keys: torch.Tensor, bits: int) -> torch.Tensor:
    """keys [N, D] -> the same keys after symmetric per-row quantisation to `bits` bits (levels at odd multiples of
    half a step, so 2 bits keep four levels and no zero), back in fp32."""
    levels = 2**bits
    scale = keys.abs().amax(-1, keepdim=True).clamp(min=1e-12) / (levels / 2)  # [N, 1]
    idx = torch.clamp(torch.floor(keys / scale), -levels // 2, levels // 2 - 1)
    return (idx + 0.5) * scale


def _blocks(x: torch.Tensor, g: int) -> torch.Tensor:
    """x [..., N, D] -> [..., ceil(N / g), g, D], zero rows past N."""
    n = x.shape[-2]
    n_blocks = -(-n // g)
    return torch.nn.functional.pad(x, (0, 0, 0, n_blocks * g - n)).unflatten(-2, (n_blocks, g))


def block_scores(scoring: str, q: torch.Tensor, keys: torch.Tensor, g: int, scale: float,
                 basis: torch.Tensor | None, values: torch.Tensor | None = None,
                 near_out: torch.Tensor | None = None) -> torch.Tensor:
    """q [r, D] (one group's query heads), keys [N, D] -> a score per g-token block [ceil(N / g)], higher = read.
    The value-aware scorings also take values [N, D] and near_out [r, D], the heads' sink + window output."""
    n = keys.shape[0]
    if scoring in ("quest", "quest_meanv"):
        padded = _blocks(keys, g)
        kmin, kmax = padded.amin(1), padded.amax(1)  # [nb, D] (padding rows are zeros: still a valid bound)
        per_head = torch.maximum(q[:, None, :] * kmin, q[:, None, :] * kmax).sum(-1)  # [r, nb]
        if scoring == "quest":
            return per_head.sum(0)
        assert values is not None and near_out is not None
        mass = torch.softmax(per_head * scale, dim=-1)  # [r, nb]: the bound read as a mass
        return (mass * _mean_value_distance(values, near_out, g, n)).sum(0)
    if scoring in ("vaware", "mass_meanv"):
        assert values is not None
        probs = torch.softmax((q @ keys.T) * scale, dim=-1)  # [r, N]
        if scoring == "mass_meanv":
            assert near_out is not None
            mass = _blocks(probs[..., None], g).sum((-1, -2))  # [r, nb]
            return (mass * _mean_value_distance(values, near_out, g, n)).sum(0)
        full_out = probs @ values  # [r, D]
        moved = probs[..., None] * (values[None] - full_out[:, None, :])  # [r, N, D]: p_t (v_t - o)
        return _blocks(moved, g).sum(-2).norm(dim=-1).sum(0)  # [r, nb, D] -> [nb]
    if scoring == "exact":
        approx_q, approx_k = q, keys
    elif scoring in ("int4", "int2"):
        approx_q, approx_k = q, quantise_rows(keys, int(scoring[3:]))
    elif scoring.startswith("lowrank"):
        assert basis is not None
        approx_q, approx_k = q @ basis, keys @ basis  # [r, R], [N, R]
    else:
        raise ValueError(f"unknown scoring {scoring!r}")
    mass = torch.softmax((approx_q @ approx_k.T) * scale, dim=-1).sum(0)  # [N], over the group's heads
    return _blocks(mass[:, None], g).sum((-1, -2))  # [nb]


def _mean_value_distance(values: torch.Tensor, near_out: torch.Tensor, g: int, n: int) -> torch.Tensor:
    """Per head and block, the distance of the block's mean value from that head's near output: [r, nb]."""
    counts = torch.clamp(n - torch.arange(0, n, g), max=g)  # [nb]: a partly filled last block
    mean_v = _blocks(values, g).sum(1) / counts[:, None]  # [nb, D]
    return torch.cdist(near_out, mean_v)  # [r, nb]


class SimulatedScoring(SimulatedBackend):
    """Dense prefill; each single-token decode step attends, per KV group, over sink + window + the top `budget` of
    its g-token blocks (those wholly between them) ranked by `scoring`."""

    def __init__(self, base: DenseAttention, scoring: str, g: int, budget: float, sink: int, window: int) -> None:
        self.cache, self.scale = base.cache, base.scale  # share the loaded engine's (empty) cache
        self.scoring, self.g, self.budget, self.sink, self.window = scoring, g, budget, sink, window
        self.rank = int(scoring[7:]) if scoring.startswith("lowrank") else 0
        self.bases: dict[tuple[int, int], torch.Tensor] = {}  # (layer, group) -> [D, R], from the prompt's keys
        self.read: list[float] = []

    def _basis(self, layer: int, h: int, keys: torch.Tensor) -> torch.Tensor | None:
        if not self.rank:
            return None
        if (layer, h) not in self.bases:  # the prompt's keys at the first decode step: fixed for the decode
            _, _, vt = torch.linalg.svd(keys, full_matrices=False)  # uncentred: q.k needs the mean direction too
            self.bases[(layer, h)] = vt[: self.rank].T.contiguous()
        return self.bases[(layer, h)]

    def _decode(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                chunks: list[SeqChunk]) -> torch.Tensor:
        keys, values, qg = self.step_inputs(layer, q, k, v, chunks)  # [Hkv, N, D] x2, q [Hkv, r, D]
        keys, values = keys.float(), values.float()
        hkv, n = keys.shape[:2]
        g = self.g
        pos = torch.arange(n)
        sink_hi, win_lo = pinned.aligned_sink_window(g, n, self.sink, self.window)
        n_blocks = -(-n // g)
        lo = torch.arange(n_blocks) * g
        eligible = (lo >= sink_hi) & (lo + g <= win_lo)  # [nb]
        k_blocks = min(int(-(-self.budget * n // g)), int(eligible.sum()))
        outs = []
        near = (pos < sink_hi) | (pos >= win_lo)  # [N]
        for h in range(hkv):
            logits = (qg[h] @ keys[h].T) * self.scale  # [r, N]
            near_out = None
            if self.scoring.endswith("_meanv"):
                near_p = torch.softmax(logits.masked_fill(~near, float("-inf")), dim=-1)
                near_out = near_p @ values[h]  # [r, D]: the sink + window part the step reads anyway
            scores = block_scores(self.scoring, qg[h], keys[h], g, self.scale, self._basis(layer, h, keys[h]),
                                  values[h], near_out)
            chosen = torch.zeros(n_blocks, dtype=torch.bool)
            if k_blocks:
                chosen[torch.topk(scores.masked_fill(~eligible, float("-inf")), k_blocks).indices] = True
            allowed = near | chosen.repeat_interleave(g)[:n]  # [N]
            self.read.append(float(allowed.float().mean()))
            probs = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)
            outs.append(probs @ values[h])  # [r, D]
        return torch.stack(outs).reshape(q.shape).to(q.dtype)  # [Hkv, r, D] -> [1, Hq, D]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_case_args(ap, positions=32)
    ap.add_argument("--budget", type=float, default=0.02)
    ap.add_argument("--scorings", nargs="+", default=["quest", "exact", "int4", "int2", "lowrank8"])
    args = ap.parse_args()
    case = essay_case(args.model, args.context, args.positions, args.text_offset)
    rows = {scoring: run_policy(case, scoring, SimulatedScoring(case.base, scoring, args.g, args.budget, args.sink,
                                                                 args.window))
            for scoring in args.scorings}
    print_policies(f"{args.model}, {args.context} tokens of essay text from offset {args.text_offset}, last "
                   f"{args.positions} decoded one at a time (float32); g={args.g}, budget {args.budget:g}, sink "
                   f"{args.sink}, window {args.window}", rows, "scoring", 10)
    write_out(args.out, {"model": args.model, "context": args.context, "positions": args.positions,
                         "text_offset": args.text_offset, "g": args.g, "budget": args.budget, "sink": args.sink,
                         "window": args.window, "command": "python " + " ".join(sys.argv), "rows": rows})


if __name__ == "__main__":
    main()
