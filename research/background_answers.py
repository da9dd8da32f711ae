"""Free-running RULER answers under a plan's simulated selection, with and without the unread-background term.

research/margin_flips.py --simulate showed, teacher-forced along full's cwe answers, that a plain top-k leans toward
ending the list and that the unread-background term (research/background_mass.py: each summary block's unread tokens
as one more softmax term, its mass estimated or true, its value their mean) takes part of that lean back. Whether
that changes the *answers* needs them generated: this answers exported RULER samples greedily (batch 1, fp32
attention in torch over the engine's dense cache, model weights in --dtype) with a backend that reads what a plan
would read -- sink + window, the pins from the prompt's last obs_window queries (fluxion_lite.plan.pins, as the engine
picks them) and the per-step top-k of the group-summed Quest bound (research/copy_heads.py's read_mask) -- and with
--background G:MASS also the background term (--retrieval-only: in retrieval groups alone). A simulation, not
the engine's kernels: it compares variants under the same selection, and its `sim` run without the term is the
check against the engine's own answers.

Writes an answers file that `bench/ruler_split.py score` reads (one run per variant, outputs as token ids).

  python research/background_answers.py --gguf qwen2.5-coder-0.5b --dir .ruler_ids40 --length 4096 --tasks cwe \\
      --per-task 20 --background none 128:oracle --out bench/results/background_answers.json
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # the product benchmarks they build on
sys.path.insert(0, str(Path(__file__).resolve().parent))
from background_mass import MASSES, VALUES, background_output  # noqa: E402  (scripts import each other by name)
from copy_heads import quest_bound, read_mask  # noqa: E402
from margin_flips import answer_steps  # noqa: E402
from policy_sim import SimulatedBackend  # noqa: E402
from ruler_split import exported_samples, model_tag, picked_samples  # noqa: E402

from fluxion_lite.plan import pins as pinned  # noqa: E402
from fluxion_lite.model.attention import DenseAttention, SeqChunk, causal_attention  # noqa: E402
from fluxion_lite.engine.engine import Engine  # noqa: E402
from fluxion_lite.plan.sparse_plan import SparsePlan  # noqa: E402


class PlanSimulated(SimulatedBackend):
    """Dense prefill that keeps the prompt's last obs_window queries per layer; each single-token decode step reads,
    per KV group, what `plan` selects (read_mask), plus the unread-background term at summary size `summary_g` if
    given. One sequence at a time: call start(prompt_len) before each prompt."""

    def __init__(self, base: DenseAttention, plan: SparsePlan, summary_g: int | None, mass: str = "mean",
                 retrieval_only: bool = False, value: str = "unread") -> None:
        self.cache, self.scale = base.cache, base.scale  # share the loaded engine's (empty) cache
        self.plan, self.summary_g, self.mass, self.value = plan, summary_g, mass, value
        # the term for retrieval groups only: their block summaries are scanned by the top-k anyway, a streaming
        # group's are not (reading them would cost it 2 D values per 16 tokens)
        self.retrieval_only = retrieval_only
        self.read: list[float] = []
        self.start(0)

    def start(self, prompt_len: int) -> None:
        self.prompt_len = prompt_len
        self.q_obs: dict[int, list[torch.Tensor]] = {}
        self.masses: dict[int, np.ndarray] = {}  # layer -> observed attention mass [Hkv, prompt_len]
        self.consensus_done = False

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               chunks: list[SeqChunk]) -> torch.Tensor:
        if all(c.length == 1 for c in chunks):
            return self._decode(layer, q, k, v, chunks)
        (c,) = chunks  # q: [L, Hq, D]; one prompt at a time
        keys, values = self.cache.append(layer, c.seq_id, c.start, k, v)  # [Hkv, start + L, D] views
        first_obs = self.prompt_len - self.plan.obs_window
        skip = max(first_obs - c.start, 0)
        if skip < c.length:
            self.q_obs.setdefault(layer, []).append(q[skip:].float())
        if c.start + c.length == self.prompt_len:  # the prompt's last chunk: its observation window is complete
            q_obs = torch.cat(self.q_obs.pop(layer))  # [obs_window, Hq, D]
            self.masses[layer] = pinned.attention_mass(q_obs, keys, first_obs, self.scale).numpy()
        return causal_attention(q, keys, values, c.start, self.scale)

    def _decode(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                chunks: list[SeqChunk]) -> torch.Tensor:
        plan = self.plan
        if not self.consensus_done:  # every layer's mass is in by the first decode step
            self.masses = pinned.consensus_masses(plan, self.masses, self.prompt_len + 1, plan.pin_consensus)
            self.consensus_done = True
        keys, values, qg = self.step_inputs(layer, q, k, v, chunks)  # [Hkv, N, D] x2, q [Hkv, r, D]
        hkv, n = keys.shape[:2]
        causal = torch.ones(1, n, dtype=torch.bool)
        outs = []
        for h in range(hkv):
            gp = plan.groups[layer][h]
            kh, vh = keys[h].float(), values[h].float()
            retrieving = not gp.streaming and plan.block_count(gp, n) > 0
            pins = (pinned.group_pins(plan, gp, self.masses[layer][h], self.prompt_len + 1) if retrieving
                    else np.zeros(0, dtype=np.int64))
            bound = quest_bound(qg[h], kh, gp.g, n) if retrieving else None
            mask = read_mask(plan, gp, n, bound, pins)  # [N]
            self.read.append(float(mask.float().mean()))
            if self.summary_g is None or (self.retrieval_only and not retrieving):
                s = (qg[h] @ kh.T) * self.scale  # [r, N]
                outs.append(torch.softmax(s.masked_fill(~mask[None, :], float("-inf")), dim=-1) @ vh)
            else:
                out, _ = background_output(qg[h][None], kh, vh, mask[None], causal, self.summary_g, self.scale,
                                           self.mass, value=self.value)
                outs.append(out[0])
        return torch.stack(outs).reshape(q.shape).to(q.dtype)  # [Hkv, r, D] -> [1, Hq, D]


def parse_background(spec: str) -> tuple[int | None, str, str]:
    """'none' or 'G:MASS[:VALUE]' -> (summary_g or None, mass, value), or exit naming the flag."""
    if spec == "none":
        return None, "mean", "unread"
    parts = spec.split(":")
    try:
        if len(parts) not in (2, 3) or parts[1] not in MASSES:
            raise ValueError(f"MASS is one of {', '.join(MASSES)}")
        if len(parts) == 3 and parts[2] not in VALUES:
            raise ValueError(f"VALUE is one of {', '.join(VALUES)}")
        g = int(parts[0])
        if g < 1:
            raise ValueError("G >= 1")
    except ValueError as e:
        sys.exit(f"error: --background {spec!r}: use none or G:MASS[:VALUE] ({e})")
    return g, parts[1], parts[2] if len(parts) == 3 else "unread"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", required=True, help="catalog name or GGUF path")
    ap.add_argument("--dir", default=".ruler_ids")
    ap.add_argument("--length", type=int, required=True)
    ap.add_argument("--plan", default=None, help="plan file (default: models/<model>.plan.json)")
    ap.add_argument("--tasks", nargs="*", default=None)
    ap.add_argument("--per-task", type=int, default=20)
    ap.add_argument("--dtype", default="bfloat16", help="model weights and activations; attention is fp32")
    ap.add_argument("--chunk", type=int, default=1024, help="prefill chunk")
    ap.add_argument("--background", nargs="+", default=["none"], metavar="none|G:MASS[:VALUE]",
                    help="variants: none (the plan's selection alone) or the background term at summary size G "
                         f"with mass {' / '.join(MASSES)} and value {' / '.join(VALUES)} (default unread)")
    ap.add_argument("--retrieval-only", action="store_true",
                    help="the background term for retrieval groups only (streaming groups read sink + window alone)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    variants = [parse_background(b) for b in args.background]
    meta, prompts = exported_samples(args.dir, args.gguf, args.length)
    eog = set(meta["eog_ids"])
    wanted = picked_samples(meta, args.tasks, args.per_task, args.gguf)
    plan_path = Path(args.plan) if args.plan else Path("models") / f"{model_tag(args.gguf)}.plan.json"
    if not plan_path.exists():
        sys.exit(f"error: --plan {plan_path}: no such file")
    plan = SparsePlan.load(plan_path)
    engine = Engine(args.gguf, attention="full", dtype=args.dtype, max_context=args.length + 256,
                    prefix_cache_entries=0, load_tokenizer=False)
    assert isinstance(engine.attn, DenseAttention)
    out = Path(args.out)
    results: dict[str, Any] = {"machine": platform.node(), "device": "cpu", "dtype": args.dtype, "gpu": None,
                               "simulated": True, "plan": str(plan_path), "runs": []}
    t0 = time.perf_counter()
    for summary_g, mass, value in variants:
        label = f"sim@{plan_path.stem}" + ("" if summary_g is None else f"+bg{summary_g}-{mass}"
                                           + ("" if value == "unread" else f"-{value}value")
                                           + ("-retrieval" if args.retrieval_only else ""))
        sim = PlanSimulated(engine.attn, plan, summary_g, mass, args.retrieval_only, value)
        outputs: list[list[int]] = [[] for _ in prompts]
        finished: list[int] = []
        run: dict[str, Any] = {"mode": label, "length": meta["length"], "model": meta["model"],
                               "answered": finished, "partial": True, "outputs": outputs}
        results["runs"].append(run)
        t_run = time.perf_counter()
        with torch.no_grad():
            for n, k in enumerate(wanted):
                s = meta["samples"][k]
                sim.start(len(prompts[k]))
                got = answer_steps(engine.model, sim, prompts[k], s["max_new_tokens"], eog, chunk=args.chunk)
                outputs[k] = got["taken"]
                finished.append(k)
                run |= {"seconds": time.perf_counter() - t_run, "sparse": {"read_fraction": float(np.mean(sim.read))}}
                out.write_text(json.dumps(results))  # after every sample: a run cut short keeps what it answered
                print(f"[{label} {n + 1}/{len(wanted)}] {s['task']}#{s['index']}: {len(got['taken'])} tokens  "
                      f"{time.perf_counter() - t0:.0f} s", flush=True)
        run["partial"] = False
        out.write_text(json.dumps(results))
        print(f"[{label}] {len(wanted)} samples in {run['seconds']:.0f} s, read {run['sparse']['read_fraction']:.2%} "
              f"(the background term's summaries not counted)", flush=True)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
