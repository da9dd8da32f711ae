"""Prometheus text-format metrics, written by hand (no client library needed for a handful of series).

Counters and histograms are updated from the event-loop thread only; engine gauges come from the stats snapshot the
engine thread publishes after each step, so `/metrics` never calls into the (non-thread-safe) engine.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field
from typing import Any

PREFIX = "fluxion"

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)  # last slot: +Inf

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def render(self, name: str, help_text: str) -> list[str]:
        lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        cumulative = 0
        for bound, n in zip(self.buckets, self.counts):
            cumulative += n
            lines.append(f'{name}_bucket{{le="{bound:g}"}} {cumulative}')
        lines.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        lines.append(f"{name}_sum {self.total:.6f}")
        lines.append(f"{name}_count {self.count}")
        return lines


def _number(value: float) -> str:
    """Integral values print as integers (byte counts stay exact); others with full precision."""
    value = float(value)
    return str(int(value)) if value.is_integer() else repr(value)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _named_gauges(name: str, help_text: str, values: dict[str, float]) -> list[str]:
    """One gauge family with a `name` label per entry (nothing when there are no entries)."""
    if not values:
        return []
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} gauge"]
    for key, value in sorted(values.items()):
        lines.append(f'{name}{{name="{_escape(str(key))}"}} {_number(value)}')
    return lines


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()  # /metrics may render while a request finishes on another task
        self.requests: dict[tuple[str, str], int] = {}  # (endpoint, status code) -> count
        self.finish_reasons: dict[str, int] = {}
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.aborted = 0
        self.rejected_queue_full = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)

    def count_request(self, endpoint: str, status: int) -> None:
        with self._lock:
            key = (endpoint, str(status))
            self.requests[key] = self.requests.get(key, 0) + 1

    def record_finished(self, *, prompt_tokens: int, completion_tokens: int, cached_tokens: int,
                        finish_reason: str | None, ttft_s: float | None, decode_s: float, e2e_s: float) -> None:
        with self._lock:
            self.prompt_tokens += prompt_tokens
            self.completion_tokens += completion_tokens
            self.cached_tokens += cached_tokens
            reason = finish_reason or "none"
            self.finish_reasons[reason] = self.finish_reasons.get(reason, 0) + 1
            if ttft_s is not None:
                self.ttft.observe(ttft_s)
            # TPOT: time between the first and the last token, per token after the first.
            if completion_tokens > 1:
                self.tpot.observe(decode_s / (completion_tokens - 1))
            self.e2e.observe(e2e_s)

    def record_aborted(self, *, prompt_tokens: int, completion_tokens: int) -> None:
        with self._lock:
            self.aborted += 1
            self.prompt_tokens += prompt_tokens
            self.completion_tokens += completion_tokens

    def render(self, engine: dict[str, Any]) -> str:
        """`engine`: gauges from the engine thread's snapshot (queue depth, running, KV bytes, sparse stats)."""
        p = PREFIX
        with self._lock:
            lines = [f"# HELP {p}_requests_total HTTP requests by endpoint and status code",
                     f"# TYPE {p}_requests_total counter"]
            for (endpoint, status), n in sorted(self.requests.items()):
                lines.append(f'{p}_requests_total{{endpoint="{_escape(endpoint)}",status="{status}"}} {n}')
            lines += [f"# HELP {p}_request_finish_total Generations by finish reason",
                      f"# TYPE {p}_request_finish_total counter"]
            for reason, n in sorted(self.finish_reasons.items()):
                lines.append(f'{p}_request_finish_total{{reason="{_escape(reason)}"}} {n}')
            for name, value, help_text in (
                ("prompt_tokens_total", self.prompt_tokens, "Prompt tokens processed"),
                ("generation_tokens_total", self.completion_tokens, "Tokens generated"),
                ("prefix_cached_tokens_total", self.cached_tokens, "Prompt tokens served from the prefix cache"),
                ("requests_aborted_total", self.aborted, "Requests aborted (client disconnect or cancel)"),
                ("requests_rejected_total", self.rejected_queue_full, "Requests rejected with 503: queue full"),
            ):
                lines += [f"# HELP {p}_{name} {help_text}", f"# TYPE {p}_{name} counter", f"{p}_{name} {value}"]
            lines += self.ttft.render(f"{p}_time_to_first_token_seconds", "Time from request arrival to first token")
            lines += self.tpot.render(f"{p}_time_per_output_token_seconds", "Mean inter-token time of a request")
            lines += self.e2e.render(f"{p}_e2e_request_latency_seconds", "Request latency, arrival to last token")

        gauges = (
            ("queue_depth", "waiting", "Requests accepted but not yet running (server queue + engine waiting list)"),
            ("requests_running", "running", "Requests in the running batch"),
            ("kv_cache_host_bytes", "kv_bytes_host", "KV cache bytes held in host memory"),
            ("kv_cache_gpu_bytes", "kv_bytes_gpu", "KV cache bytes held on the GPU"),
            ("prefix_cache_bytes", "prefix_cache_bytes", "Bytes held by the prefix cache"),
            ("engine_ready", "ready", "1 once the model is loaded"),
        )
        for name, key, help_text in gauges:
            lines += [f"# HELP {p}_{name} {help_text}", f"# TYPE {p}_{name} gauge",
                      f"{p}_{name} {_number(engine.get(key, 0))}"]
        lines += _named_gauges(f"{p}_sparse_stat", "Hybrid sparse-attention statistics (by name)",
                               engine.get("sparse") or {})
        lines += _named_gauges(f"{p}_engine_step_stat", "Engine steps by kind (decode: one token per row; mixed: "
                               "with a prefill chunk), their seconds, and decode-graph captures (by name)",
                               engine.get("steps") or {})
        return "\n".join(lines) + "\n"
