"""Async decode: the next decode step is queued on the device before the host reads the current step's tokens.

A synchronous engine step is: launch the step, wait for its logits, sample on the host, build the next step's
inputs, launch it. The device idles for the host part (at batch 1 on the H200 host with the 8B shape: ~0.3 ms of a
~6 ms step, docs/hybrid.md). For requests whose next token is the argmax of the logits (greedy, no penalties) the
choice can stay on the device: step t + 1 takes step t's argmax as its input token and is queued right behind it,
and the host reads step t's tokens (a small pinned copy) while t + 1 runs. The engine (Engine._decode_async) then
trails the device by one step:

    step() k:  queue step t (input: step t - 1's argmax, on the device)   <- device busy with t - 1, then t
               read step t - 1's tokens (waits for t - 1 only): text, stop strings, EOS, lengths

The price is one step computed past a request's end when it stops on EOS or a stop string (its token is dropped and
its KV is freed with the sequence); a length limit is known ahead, so no step is queued past it (chainable). Rows
sampled with a temperature, or with penalties that depend on the newest token, keep the synchronous path.

The backend must not wait for the device inside the step for this to pay: the device-selection graph
(device_graph.DeviceGraphedDecode.end with defer_sync) and dense graphed decode do not; the CPU-attention hybrids
wait per layer anyway and simply run as before.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence as Seq

import torch

from .attention import SeqChunk
from .sampling import SamplingParams

if TYPE_CHECKING:
    from .engine import Sequence


def device_choosable(params: SamplingParams) -> bool:
    """The next token is the logits' argmax and nothing the host learns from the newest token changes it."""
    return (params.greedy and params.repetition_penalty == 1.0 and params.presence_penalty == 0.0
            and params.frequency_penalty == 0.0)


@dataclass
class InFlight:
    """A queued decode step whose tokens the host has not read yet."""

    seqs: list[Sequence]  # its rows, in order
    tokens: torch.Tensor  # [B] long on the model's device: each row's argmax (the next step's input tokens)
    host: torch.Tensor  # [B] long on the host (pinned on CUDA): the same, copied without blocking
    done: torch.cuda.Event | None  # recorded after that copy (CUDA); None: already on the host

    def wait(self) -> None:
        if self.done is not None:
            self.done.synchronize()

    def read(self) -> list[int]:
        self.wait()
        return self.host.tolist()


def queue_choice(seqs: list[Sequence], logits: torch.Tensor) -> InFlight:
    """logits [B, V] (fp32, on the device, possibly still being computed) -> the rows' argmax, kept on the device
    and copied to pinned host memory behind the step."""
    tokens = torch.argmax(logits, dim=-1)  # [B]; the first of equal maxima, as sample_token's greedy path
    if tokens.device.type != "cuda":
        return InFlight(seqs, tokens, tokens, None)
    host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
    host.copy_(tokens, non_blocking=True)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(tokens.device))
    return InFlight(seqs, tokens, host, done)


def starts_chain(sampled: Seq[Sequence], chunks: Seq[SeqChunk]) -> bool:
    """A batch that may run as the first step of a chain: one decode token per row, every row sampled, every
    row's choice made on the device."""
    return (len(sampled) == len(chunks) and all(c.length == 1 for c in chunks)
            and all(device_choosable(s.params) for s in sampled))


def chainable(inflight: InFlight, running: Seq[Sequence], waiting: Seq[Sequence], max_batch: int,
              context_length: int) -> bool:
    """Whether the next step may be queued before the in-flight tokens are read: the same rows are running, none
    waits to be admitted, and none reaches its length limit with the in-flight token (the queued step would be
    wasted; EOS and stop strings cannot be known ahead)."""
    if list(running) != inflight.seqs or (waiting and len(running) < max_batch):
        return False
    return all(s.finish_reason is None and len(s.output_ids) + 1 < s.params.max_tokens
               and len(s.all_ids) + 1 < context_length for s in inflight.seqs)
