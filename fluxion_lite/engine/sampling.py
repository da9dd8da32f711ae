"""Sampling parameters and the token sampler (penalties -> top-k -> top-p -> min-p -> temperature -> draw)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from fluxion_lite.errors import RequestError

MAX_STOP_STRINGS = 16
REPETITION_WINDOW = 64  # llama.cpp's default penalty_last_n: the repetition penalty looks at this many recent tokens


@dataclass
class SamplingParams:
    """What a request leaves out takes llama-server's defaults (temperature 0.8, top_k 40, top_p 0.95, min_p 0.05):
    plain temperature-1 sampling from a small model's whole vocabulary drifts into gibberish within a sentence.
    A field that a request sets keeps its OpenAI meaning; top_k = 0, top_p = 1 and min_p = 0 turn truncation off."""

    max_tokens: int = 256
    temperature: float = 0.8  # 0 = greedy
    top_k: int = 40  # 0 = off
    top_p: float = 0.95  # 1 = off
    min_p: float = 0.05  # 0 = off
    repetition_penalty: float = 1.0  # llama.cpp-style: divides positive logits of recent tokens
    presence_penalty: float = 0.0  # OpenAI-style: subtracted once for every token already generated
    frequency_penalty: float = 0.0  # OpenAI-style: subtracted per occurrence in the generated text
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    # fluxion's error bound for this request (the selector's epsilon; the model's plan when None): smaller reads more
    epsilon: float | None = None

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
        if self.epsilon is not None and not (isinstance(self.epsilon, (int, float)) and not isinstance(self.epsilon, bool)
                                             and 0.0 < self.epsilon <= 100.0):
            raise bad("epsilon", "must be a number in (0, 100]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


class Penalties:
    """A request's token history as its penalties read it, kept on the model's device so that choosing the next
    token never needs the host's copy of the ids (async decode queues a step before the host has read the newest
    one): the last REPETITION_WINDOW ids of prompt + output (repetition penalty) and how often each id was generated
    (presence / frequency penalties). Filled from the ids at the request's first choice, then fed each chosen id."""

    def __init__(self, ids: list[int], n_prompt: int, vocab: int, device: torch.device):
        tail = ids[-REPETITION_WINDOW:]
        self.ring = torch.zeros(REPETITION_WINDOW, dtype=torch.long, device=device)  # [W] recent ids, any order
        self.ring[: len(tail)] = torch.tensor(tail, dtype=torch.long)
        self.valid, self.write = len(tail), len(tail) % REPETITION_WINDOW
        self.counts = torch.zeros(vocab, dtype=torch.float32, device=device)  # [V] times each id was generated
        generated = ids[n_prompt:]
        if generated:
            self.counts.index_add_(0, torch.tensor(generated, dtype=torch.long, device=device),
                                   torch.ones(len(generated), device=device))
        self.any_generated = bool(generated)

    def push(self, token: torch.Tensor) -> None:
        """token: a 0-d long tensor on the device (the chosen id, possibly still being computed)."""
        self.ring[self.write] = token
        self.write = (self.write + 1) % REPETITION_WINDOW
        self.valid = min(self.valid + 1, REPETITION_WINDOW)
        self.counts.index_add_(0, token.reshape(1), torch.ones(1, device=self.counts.device))
        self.any_generated = True

    def apply(self, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
        """logits [V] -> penalised logits: llama.cpp's repetition penalty on each distinct recent id (positive
        logits divided, negative multiplied), then OpenAI's presence and frequency penalties on generated ids."""
        if params.repetition_penalty != 1.0 and self.valid:
            # index_fill_ takes True as a kernel argument; `recent[ids] = True` copied it to the device from
            # pageable memory, which waits for the stream (it cost the chained CUDA step its overlap)
            recent = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
            recent.index_fill_(0, self.ring[: self.valid], True)
            rp = params.repetition_penalty
            logits = torch.where(recent, torch.where(logits > 0, logits / rp, logits * rp), logits)
        if (params.presence_penalty or params.frequency_penalty) and self.any_generated:
            seen = self.counts > 0
            logits = logits - torch.where(seen, params.presence_penalty + params.frequency_penalty * self.counts, 0.0)
        return logits


def sample(logits: torch.Tensor, params: SamplingParams, penalties: Penalties | None,
           rng: torch.Generator | None) -> torch.Tensor:
    """logits: [V] fp32 (left unchanged) -> the chosen token id, a 0-d long tensor on the logits' device (penalties
    and rng there too): on CUDA nothing here waits for the device, so a caller may keep the choice there
    (async_decode.py) or read many rows' choices in one copy. penalties: the request's history (needed when
    penalised(params)); the chosen id is not pushed into it here."""
    if penalties is not None:
        logits = penalties.apply(logits, params)
    if params.greedy:
        return torch.argmax(logits)
    if params.top_k > 0 and params.top_k < logits.numel():
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = torch.where(logits < kth, -math.inf, logits)
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the token that crosses the threshold stays)
        drop_sorted = (sorted_probs.cumsum(0) - sorted_probs) >= params.top_p
        probs = probs.scatter(0, order, torch.where(drop_sorted, 0.0, sorted_probs))
    if params.min_p > 0.0:
        probs = torch.where(probs < params.min_p * probs.max(), 0.0, probs)
    # temperature after truncation: truncation decided on the model's own distribution (as llama.cpp's default chain)
    if params.temperature != 1.0:
        probs = torch.softmax(torch.log(probs) / params.temperature, dim=-1)
    else:
        probs = probs / probs.sum()
    return torch.multinomial(probs, 1, generator=rng)[0]


def sample_rows(logits: torch.Tensor, rows: list[tuple[SamplingParams, Penalties | None, torch.Generator | None]]
                ) -> torch.Tensor:
    """logits [R, V] fp32 (left unchanged), rows[r] = (params, penalties, rng) -> chosen ids [R] long on the
    logits' device, computed there: one read of R ints instead of R rows of logits to the host (on CUDA at a
    152K vocabulary that read and the host's sort took ~2.5 ms of a batch-4 step, docs/history.md).
    Each row's chosen id goes into its penalties' history."""
    if all(p.greedy and pen is None for p, pen, _ in rows):
        return torch.argmax(logits, dim=-1)  # one kernel for the common case
    chosen = torch.stack([sample(logits[r], *row) for r, row in enumerate(rows)])  # [R]
    for r, (_, pen, _) in enumerate(rows):
        if pen is not None:
            pen.push(chosen[r])
    return chosen


def penalised(params: SamplingParams) -> bool:
    """Whether the newest tokens change the next choice (repetition / presence / frequency penalties)."""
    return params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0

