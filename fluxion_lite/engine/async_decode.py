"""Async decode: the next decode step is queued on the device before the host reads the current step's tokens.

A synchronous engine step is: launch the step, wait for its logits, sample on the host, build the next step's
inputs, launch it. The device idles for the host part (at batch 1 on the H200 host with the 8B shape: ~0.3 ms of a
~6 ms step, docs/hybrid.md). The choice of the next token runs on the device (sampling.sample_rows: argmax, or the
sampling chain with each request's generator and penalty history on the device), so it can stay there: step t + 1
takes step t's choices as its input tokens and is queued right behind it, and the host reads step t's tokens (a
small pinned copy) while t + 1 runs. The engine (Engine._decode_async) then
trails the device by one step:

    step() k:  queue step t (input: step t - 1's choices, on the device)   <- device busy with t - 1, then t
               read step t - 1's tokens (waits for t - 1 only): text, stop strings, EOS, lengths

The price is one step computed past a request's end when it stops on EOS or a stop string (its token is dropped and
its KV is freed with the sequence); a length limit is known ahead, so no step is queued past it (chainable).

The backend must not wait for the device inside the step for this to pay: the device-selection graph
(device_graph.DeviceGraphedDecode.end with defer_sync) and dense graphed decode do not; the CPU-attention hybrids
wait per layer anyway and simply run as before.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence as Seq

import torch

from fluxion_lite.model.attention import SeqChunk

if TYPE_CHECKING:
    from fluxion_lite.engine.engine import Sequence


@dataclass
class InFlight:
    """A queued decode step whose tokens the host has not read yet."""

    seqs: list[Sequence]  # its rows, in order
    tokens: torch.Tensor  # [B] long on the model's device: each row's choice (the next step's input tokens)
    host: torch.Tensor  # [B] long on the host (pinned on CUDA): the same, copied without blocking
    done: torch.cuda.Event | None  # recorded after that copy (CUDA); None: already on the host

    def wait(self) -> None:
        if self.done is not None:
            self.done.synchronize()

    def read(self) -> list[int]:
        self.wait()
        return self.host.tolist()


def queue_tokens(seqs: list[Sequence], tokens: torch.Tensor) -> InFlight:
    """tokens [B] long: the rows' choices on the device (sampling.sample_rows, possibly still being computed),
    kept there and copied to pinned host memory behind the step."""
    if tokens.device.type != "cuda":
        return InFlight(seqs, tokens, tokens, None)
    host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
    host.copy_(tokens, non_blocking=True)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(tokens.device))
    return InFlight(seqs, tokens, host, done)


def starts_chain(sampled: Seq[Sequence], chunks: Seq[SeqChunk]) -> bool:
    """A batch that may run as the first step of a chain: one decode token per row, every row sampled."""
    return len(sampled) == len(chunks) and all(c.length == 1 for c in chunks)


def chainable(inflight: InFlight, running: Seq[Sequence], waiting: Seq[Sequence], max_batch: int,
              context_length: int) -> bool:
    """Whether the next step may be queued before the in-flight tokens are read: the same rows are running, none
    waits to be admitted, and none reaches its length limit with the in-flight token (the queued step would be
    wasted; EOS and stop strings cannot be known ahead)."""
    if list(running) != inflight.seqs or (waiting and len(running) < max_batch):
        return False
    return all(s.finish_reason is None and len(s.output_ids) + 1 < s.params.max_tokens
               and len(s.all_ids) + 1 < context_length for s in inflight.seqs)
