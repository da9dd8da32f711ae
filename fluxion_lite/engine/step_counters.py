"""Where an engine's step time goes, by kind of step: counters for benchmarks and /metrics.

A step is `decode` when every row is one token whose logits are sampled (the kind the decode graphs run; a sequence's
first such step still runs its attention eagerly), `mixed` when some row is a prompt chunk (or the step is prefill
only). Continuous batching with long prompts
makes most steps mixed (a 32K prompt is several chunks, each one step beside the running batch), so their time, not
the captured decode step's, can set the throughput; the counters make that visible. Graph captures (decode_graphs:
a new batch size or step structure) are counted with the time of the step that captured them.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fluxion_lite.model.cuda_graphs import DecodeGraphs


@dataclass
class StepCounters:
    decode_steps: int = 0
    decode_s: float = 0.0
    mixed_steps: int = 0
    mixed_s: float = 0.0
    _t0: float = 0.0

    def start(self) -> None:
        self._t0 = time.perf_counter()

    def stop(self, mixed: bool) -> None:
        """After the step's logits reached the host (the step's device work is done)."""
        dt = time.perf_counter() - self._t0
        if mixed:
            self.mixed_steps += 1
            self.mixed_s += dt
        else:
            self.decode_steps += 1
            self.decode_s += dt

    def reset(self, graphs: DecodeGraphs | None = None) -> None:
        self.decode_steps = self.mixed_steps = 0
        self.decode_s = self.mixed_s = 0.0
        if graphs is not None:
            graphs.captures, graphs.capture_s = 0, 0.0

    def as_dict(self, graphs: DecodeGraphs | None = None) -> dict[str, float]:
        """graphs: the model's DecodeGraphs (None without CUDA graphs): its captures and their steps' seconds."""
        out = {"decode_steps": float(self.decode_steps), "decode_s": self.decode_s,
               "mixed_steps": float(self.mixed_steps), "mixed_s": self.mixed_s}
        if graphs is not None:
            out |= {"graph_captures": float(graphs.captures), "graph_capture_s": graphs.capture_s}
        return out
