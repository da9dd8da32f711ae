"""Sampling parameters and the token sampler (penalties -> top-k -> top-p -> min-p -> temperature -> draw)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .errors import RequestError

MAX_STOP_STRINGS = 16
REPETITION_WINDOW = 64  # llama.cpp's default penalty_last_n: the repetition penalty looks at this many recent tokens


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # llama.cpp-style: divides positive logits of recent tokens
    presence_penalty: float = 0.0  # OpenAI-style: subtracted once for every token already generated
    frequency_penalty: float = 0.0  # OpenAI-style: subtracted per occurrence in the generated text
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False

    def validate(self) -> None:
        def bad(name: str, why: str) -> RequestError:
            return RequestError(f"{name}={getattr(self, name)!r}: {why}")

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad("max_tokens", "must be an integer >= 1")
        if not (isinstance(self.temperature, (int, float)) and 0.0 <= self.temperature <= 100.0):
            raise bad("temperature", "must be a number in [0, 100]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "must be an integer >= 0 (0 disables)")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise bad("top_p", "must be in (0, 1]")
        if not (isinstance(self.min_p, (int, float)) and 0.0 <= self.min_p <= 1.0):
            raise bad("min_p", "must be in [0, 1]")
        if not (isinstance(self.repetition_penalty, (int, float)) and 0.0 < self.repetition_penalty <= 10.0):
            raise bad("repetition_penalty", "must be in (0, 10]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and -2.0 <= value <= 2.0):
                raise bad(name, "must be in [-2, 2]")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "must be an integer")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "must be a list of non-empty strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise bad("stop", f"at most {MAX_STOP_STRINGS} stop strings")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def apply_penalties(logits: torch.Tensor, params: SamplingParams, context: list[int], generated: list[int]) -> None:
    """In place on logits: [V]."""
    if params.repetition_penalty != 1.0 and context:
        recent = torch.tensor(sorted(set(context[-REPETITION_WINDOW:])), dtype=torch.long)
        vals = logits[recent]
        logits[recent] = torch.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
    if (params.presence_penalty or params.frequency_penalty) and generated:
        ids, counts = torch.tensor(generated, dtype=torch.long).unique(return_counts=True)
        logits[ids] -= params.presence_penalty + params.frequency_penalty * counts.to(logits.dtype)


def sample_token(
    logits: torch.Tensor, params: SamplingParams, context: list[int], generated: list[int], rng: torch.Generator | None
) -> int:
    """logits: [V] fp32 (a private copy: modified in place). Returns the chosen token id."""
    apply_penalties(logits, params, context, generated)
    if params.greedy:
        return int(torch.argmax(logits))
    if params.top_k > 0 and params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits[logits < kth] = -math.inf
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the token that crosses the threshold stays)
        drop_sorted = (sorted_probs.cumsum(0) - sorted_probs) >= params.top_p
        probs[order[drop_sorted]] = 0.0
    if params.min_p > 0.0:
        probs[probs < params.min_p * probs.max()] = 0.0
    # temperature after truncation: truncation decided on the model's own distribution (as llama.cpp's default chain)
    if params.temperature != 1.0:
        probs = torch.softmax(torch.log(probs) / params.temperature, dim=-1)
    else:
        probs = probs / probs.sum()
    return int(torch.multinomial(probs, 1, generator=rng))
