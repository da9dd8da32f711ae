"""Shared by the policy simulations (research/background_fidelity.py, research/block_scoring.py): the full model's
teacher-forced reference over essay text, one simulated backend scored against it, and the results table."""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # the product benchmarks they build on
from fidelity import compare, decode_logprobs  # noqa: E402

from fluxion_lite.model.attention import DenseAttention, SeqChunk  # noqa: E402
from fluxion_lite.engine.engine import Engine  # noqa: E402
from fluxion_lite.offline.eval_text import essay_tokens  # noqa: E402


class SimulatedBackend(DenseAttention):
    """Dense prefill over the loaded engine's cache; a subclass's _decode simulates a policy and records in `read`
    the fraction of the context each (step, KV group) read."""

    read: list[float]

    def append_step(self, layer: int, k: torch.Tensor, v: torch.Tensor,
                    chunks: list[SeqChunk]) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode step's k, v ([1, Hkv, D]) into the cache -> every key and value so far, [Hkv, N, D] each."""
        (c,) = chunks
        ((keys4, values4),) = self.cache.append_decode(layer, [c.seq_id], [c.start], k, v)  # [1, Hkv, N, D] each
        return keys4[0], values4[0]

    def step_inputs(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    chunks: list[SeqChunk]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A decode step's q ([1, Hq, D]) and k, v appended -> (keys, values [Hkv, N, D], q per group fp32 [Hkv, r, D])."""
        keys, values = self.append_step(layer, k, v, chunks)
        hq, d = q.shape[1], q.shape[2]
        return keys, values, q.float().view(keys.shape[0], hq // keys.shape[0], d)


def add_case_args(ap: argparse.ArgumentParser, positions: int) -> None:
    """The flags every policy simulation takes: model, text, decoded positions, block size, sink, window, --out."""
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--positions", type=int, default=positions)
    ap.add_argument("--text-offset", type=int, default=0)
    ap.add_argument("--g", type=int, default=16)
    ap.add_argument("--sink", type=int, default=16)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--out", type=Path)


@dataclass
class EssayCase:
    engine: Engine  # dense fp32, its attention backend `base` shared by the simulations
    base: DenseAttention
    tokens: list[int]
    next_tokens: list[int]  # the true next token of each decoded position but the last
    positions: int
    ref: torch.Tensor  # log-probs [positions, V] of full attention


def essay_case(model: str, context: int, positions: int, text_offset: int) -> EssayCase:
    """Load `model` dense in fp32, take `context` tokens of essay text from `text_offset` and decode the last
    `positions` one at a time with full attention (the reference); a clear exit if the text is too short."""
    engine = Engine(model, attention="full", dtype="float32", max_context=context + 1, prefix_cache_entries=0)
    assert engine.tokenizer is not None
    tokens = essay_tokens(engine.tokenizer, context, text_offset)
    if len(tokens) < context:
        sys.exit(f"error: only {len(tokens)} tokens of essay text from offset {text_offset}")
    base = engine.attn
    assert isinstance(base, DenseAttention)
    with torch.no_grad():
        ref = decode_logprobs(engine.model, base, tokens, positions, 512)
    return EssayCase(engine, base, tokens, tokens[len(tokens) - positions + 1 :], positions, ref)


def run_policy(case: EssayCase, name: str, sim: SimulatedBackend) -> dict[str, Any]:
    """Decode the case's positions through `sim` -> compare()'s row plus the mean fraction read and the seconds."""
    t0 = time.perf_counter()
    with torch.no_grad():
        got = decode_logprobs(case.engine.model, sim, case.tokens, case.positions, 512)
    row = compare(case.ref, got, case.next_tokens) | {"read": sum(sim.read) / len(sim.read),
                                                      "seconds": time.perf_counter() - t0}
    print(f"[{name}] done in {row['seconds']:.0f} s", file=sys.stderr, flush=True)
    return row


def print_policies(title: str, rows: dict[str, dict[str, Any]], label: str = "policy", width: int = 20) -> None:
    print(f"\n{title}")
    print(f"{label:<{width}} {'KL mean':>8} {'KL p90':>8} {'KL max':>8} {'top-1':>7} {'read':>7}")
    for name, r in rows.items():
        print(f"{name:<{width}} {r['kl_mean']:8.4f} {r['kl_p90']:8.4f} {r['kl_max']:8.4f} "
              f"{r['top1_agreement']:7.1%} {r['read']:7.1%}")
