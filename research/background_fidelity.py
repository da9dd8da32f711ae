"""Teacher-forced fidelity of a simulated block top-k policy with and without the unread-background estimate.

research/background_mass.py measures, layer by layer, how much of a retrieval group's output error the estimate of
the unread spans (per-block running sums of keys and values) takes back. This asks whether that carries through the
whole model: decode the last M tokens of essay text one at a time (as bench/fidelity.py does) with a simulated
policy in torch -- every KV group reads sink + window + the top `budget` of its g-token blocks by the Quest bound
summed over its query heads (fluxion_lite/plan/calibration.py's group_outputs) -- and optionally the background term at
summary block size G; report KL(full || sim) and top-1 agreement. A policy simulation, not the engine's kernels:
it compares the two variants under the same selection.

Usage: python research/background_fidelity.py --context 4096 --positions 64 --budgets 0.02 0.05 --summary-g 128 \
           --out bench/results/background_fidelity_qwen2.5-coder-0.5b_4096_vm.json
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # the product benchmarks they build on
sys.path.insert(0, str(Path(__file__).resolve().parent))
from background_mass import background_output  # noqa: E402  (scripts import each other by name)
from policy_sim import SimulatedBackend, add_case_args, essay_case, print_policies, run_policy  # noqa: E402
from ruler_paired import write_out  # noqa: E402

from fluxion_lite.model.attention import DenseAttention, SeqChunk  # noqa: E402
from fluxion_lite.plan.space import Config  # noqa: E402
from fluxion_lite.plan.calibration import group_outputs  # noqa: E402


class SimulatedTopK(SimulatedBackend):
    """Dense prefill; each single-token decode step attends, per KV group, over sink + window + the top `budget`
    blocks of g tokens (Quest bound), plus the unread-background term at summary size `summary_g` if given, its
    mass estimated from the mean key (`mass="mean"`) or taken from the true scores (`"oracle"`, exact)."""

    def __init__(self, base: DenseAttention, g: int, budget: float, sink: int, window: int,
                 summary_g: int | None, mass: str = "mean") -> None:
        self.cache, self.scale = base.cache, base.scale  # share the loaded engine's (empty) cache
        self.config = Config(False, g, budget)
        self.sink, self.window, self.summary_g, self.mass = sink, window, summary_g, mass
        self.read: list[float] = []

    def _decode(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                chunks: list[SeqChunk]) -> torch.Tensor:
        keys, values, qg = self.step_inputs(layer, q, k, v, chunks)  # [Hkv, N, D] x2, q [Hkv, r, D]
        hkv, n = keys.shape[:2]
        qg = qg[:, None]  # [Hkv, M=1, r, D]
        pos = torch.tensor([n - 1])
        causal = torch.ones(1, n, dtype=torch.bool)
        outs = []
        for h in range(hkv):
            kh, vh = keys[h].float(), values[h].float()
            masks: dict[str, torch.Tensor] = {}
            res = group_outputs(qg[h], kh, vh, pos, [self.config], self.sink, self.window, self.scale, masks)
            allowed = masks[self.config.key]
            self.read.append(float(allowed.float().mean()))
            if self.summary_g is None:
                outs.append(res[self.config.key][0])
            else:
                outs.append(background_output(qg[h], kh, vh, allowed, causal, self.summary_g, self.scale,
                                             self.mass)[0])
        return torch.stack(outs, dim=1).reshape(q.shape).to(q.dtype)  # [M=1, Hkv, r, D] -> [1, Hq, D]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_case_args(ap, positions=64)
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.02, 0.05])
    ap.add_argument("--summary-g", type=int, nargs="+", default=[128])
    args = ap.parse_args()
    case = essay_case(args.model, args.context, args.positions, args.text_offset)
    rows: dict[str, Any] = {}
    for budget in args.budgets:
        for sg in [None, *args.summary_g]:
            name = f"g{args.g} b{budget:g}" + ("" if sg is None else f" +bg{sg}")
            rows[name] = run_policy(case, name, SimulatedTopK(case.base, args.g, budget, args.sink, args.window, sg))
    print_policies(f"{args.model}, {args.context} tokens of essay text, last {args.positions} decoded one at a time "
                   f"(float32), simulated top-k vs full", rows)
    write_out(args.out, {"model": args.model, "context": args.context, "positions": args.positions,
                         "text_offset": args.text_offset, "g": args.g, "sink": args.sink,
                         "window": args.window, "rows": rows})


if __name__ == "__main__":
    main()
