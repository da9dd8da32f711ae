"""Load test of the chat server: concurrent streaming clients against `fluxion-lite serve` on this machine.

Starts the server as a subprocess on a free loopback port (or uses --url), then runs three bounded phases of streaming
chat requests with a fixed completion length (ignore_eos, so every request generates exactly --max-tokens tokens):

  1 client  x N requests   -> baseline aggregate tokens/s
  8 clients x N requests   -> batched aggregate tokens/s (continuous batching: expect >= 3x the baseline)
  32 clients x 4 requests  -> the main load: zero failures, well-formed streams, p50/p99 TTFT, aggregate tokens/s

Every stream is checked: role chunk first, finish_reason only on the last choice chunk, usage chunk, `data: [DONE]`,
completion_tokens == max_tokens. Prints a table and writes bench/results/load.json.

--replicas N [M ...] runs the same phases once per value against `serve --replicas N` (0: one engine without Ray)
on this machine, the cores shared out among the replicas, and adds a comparison table (the main phase's tokens/s and
TTFT per run) to the report (bench/results/cluster_load.json by default).

    .venv/bin/python bench/load.py                 # smollm2-135m, ~1-2 minutes on 2 cores
    .venv/bin/python bench/load.py --replicas 0 1 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

RESULTS = Path(__file__).resolve().parent / "results"
TOPICS = ["the sea", "mountains", "a city at night", "trains", "coffee", "winter", "a library", "the moon",
          "bicycles", "rain", "a garden", "the desert", "music", "an old map", "bread", "lighthouses"]


@dataclass
class RequestResult:
    ok: bool
    error: str | None = None
    ttft_s: float | None = None
    latency_s: float = 0.0
    completion_tokens: int = 0
    prompt_tokens: int = 0
    chunks: int = 0


@dataclass
class PhaseResult:
    name: str
    clients: int
    requests_per_client: int
    requests: int = 0
    failures: int = 0
    errors: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    completion_tokens: int = 0
    aggregate_tokens_per_s: float = 0.0
    ttft_p50_s: float | None = None
    ttft_p99_s: float | None = None
    latency_p50_s: float | None = None
    per_request_tokens_per_s_p50: float | None = None


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


async def one_request(http: httpx.AsyncClient, url: str, headers: dict[str, str], prompt: str,
                      max_tokens: int) -> RequestResult:
    """One streaming chat request, validated chunk by chunk."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0.8,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    result = RequestResult(ok=False)
    try:
        async with http.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return result
            events: list[Any] = []
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue  # blank separators and keep-alive comments
                data = line[len("data: "):]
                if data == "[DONE]":
                    events.append(data)
                    continue
                event = json.loads(data)
                if "error" in event:
                    result.error = f"in-stream error: {event['error']}"
                    return result
                if (result.ttft_s is None and event.get("choices")
                        and event["choices"][0]["delta"].get("content")):
                    result.ttft_s = time.perf_counter() - t0
                events.append(event)
        result.latency_s = time.perf_counter() - t0
        problem = check_stream(events, max_tokens)
        if problem:
            result.error = problem
            return result
        usage = events[-2]["usage"]
        result.completion_tokens = usage["completion_tokens"]
        result.prompt_tokens = usage["prompt_tokens"]
        result.chunks = len(events)
        result.ok = True
    except (httpx.HTTPError, json.JSONDecodeError, KeyError, IndexError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


def check_stream(events: list[Any], max_tokens: int) -> str | None:
    """None if the stream is a complete, well-formed OpenAI chat stream; else what is wrong."""
    if len(events) < 4 or events[-1] != "[DONE]":
        return f"stream did not end with [DONE] ({len(events)} events)"
    chunks = events[:-1]
    if chunks[0]["choices"][0]["delta"].get("role") != "assistant":
        return "first chunk does not carry the assistant role"
    with_choices = [c for c in chunks if c["choices"]]
    finishes = [c["choices"][0]["finish_reason"] for c in with_choices]
    if finishes[-1] != "length" or any(f is not None for f in finishes[:-1]):
        return f"finish_reason sequence is wrong: {finishes[-3:]}"
    usage = chunks[-1].get("usage")
    if chunks[-1]["choices"] or not usage:
        return "no usage chunk at the end"
    if usage["completion_tokens"] != max_tokens:
        return f"completion_tokens {usage['completion_tokens']} != max_tokens {max_tokens}"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in with_choices)
    if not text.strip():
        return "empty completion text"
    return None


async def run_phase(url: str, headers: dict[str, str], name: str, clients: int, per_client: int,
                    max_tokens: int, timeout_s: float) -> PhaseResult:
    phase = PhaseResult(name=name, clients=clients, requests_per_client=per_client)
    results: list[RequestResult] = []
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)

    async def client(index: int) -> None:
        for j in range(per_client):
            topic = TOPICS[(index * per_client + j) % len(TOPICS)]
            prompt = f"Client {index}, request {j}: write a short poem about {topic}."
            results.append(await one_request(http, url, headers, prompt, max_tokens))

    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits) as http:
        t0 = time.perf_counter()
        tasks = [asyncio.create_task(client(i)) for i in range(clients)]
        _, late = await asyncio.wait(tasks, timeout=timeout_s)
        for task in late:  # bounded: whatever has not finished by the deadline is cancelled and counted as failed
            task.cancel()
        await asyncio.gather(*late, return_exceptions=True)
        phase.wall_s = time.perf_counter() - t0

    expected = clients * per_client
    phase.requests = expected
    phase.failures = sum(not r.ok for r in results) + (expected - len(results))
    if len(results) < expected:
        results.extend(RequestResult(ok=False, error=f"not finished within {timeout_s:.0f} s")
                       for _ in range(expected - len(results)))
    phase.errors = sorted({r.error for r in results if r.error})[:5]
    phase.completion_tokens = sum(r.completion_tokens for r in results)
    phase.aggregate_tokens_per_s = phase.completion_tokens / phase.wall_s
    ttfts = [r.ttft_s for r in results if r.ttft_s is not None]
    phase.ttft_p50_s = _percentile(ttfts, 0.50)
    phase.ttft_p99_s = _percentile(ttfts, 0.99)
    phase.latency_p50_s = _percentile([r.latency_s for r in results if r.ok], 0.50)
    rates = [(r.completion_tokens - 1) / (r.latency_s - r.ttft_s) for r in results
             if r.ok and r.ttft_s is not None and r.latency_s > r.ttft_s]
    phase.per_request_tokens_per_s_p50 = _percentile(rates, 0.50)
    return phase


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(model: str, max_batch: int, api_key: str, threads: int | None,
                 replicas: int = 0) -> tuple[subprocess.Popen[str], str]:
    """The server on a free port once ready (with replicas: every replica up); replicas 0: one engine, no Ray."""
    port = _free_port()
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)  # torch's intra-op pool size in the server process
    log = open(RESULTS / "load_server.log.tmp", "w")  # noqa: SIM115 - lives as long as the server
    proc = subprocess.Popen(
        [sys.executable, "-m", "fluxion_lite.cli", "serve", "--model", model, "--port", str(port), "--max-batch",
         str(max_batch), "--max-queue", "128", "--api-key", api_key, "--log-level", "warning",
         *(["--replicas", str(replicas)] if replicas else [])],
        stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}; see {log.name}")
        try:
            health = httpx.get(f"{url}/health", timeout=2)
            if health.status_code == 200 and health.json().get("replicas_up", 1) == (replicas or 1):
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("server did not become healthy within 180 s")


async def main_async(args: argparse.Namespace, url: str, headers: dict[str, str]) -> dict[str, Any]:
    # Warm-up: first forwards allocate and fault in weights; keep that out of every phase.
    async with httpx.AsyncClient(timeout=120) as http:
        await one_request(http, url, headers, "Warm up.", 4)
    phases = [
        await run_phase(url, headers, "1 client", 1, args.baseline_requests, args.max_tokens, args.phase_timeout),
        await run_phase(url, headers, "8 clients", 8, args.baseline_requests, args.max_tokens, args.phase_timeout),
        await run_phase(url, headers, f"{args.clients} clients", args.clients, args.requests, args.max_tokens,
                        args.phase_timeout),
    ]
    async with httpx.AsyncClient(timeout=30) as http:
        props = (await http.get(f"{url}/props", headers=headers)).json()
        metrics = (await http.get(f"{url}/metrics", headers=headers)).text
    aborted = [line for line in metrics.splitlines() if line.startswith("fluxion_requests_aborted_total ")]
    speedup = phases[1].aggregate_tokens_per_s / phases[0].aggregate_tokens_per_s
    return {
        "model": args.model, "max_tokens": args.max_tokens, "max_batch": args.max_batch, "props": props,
        "server_threads": args.server_threads or "torch default", "load_average_at_end": os.getloadavg(),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "phases": [asdict(p) for p in phases],
        "batching_speedup_8_vs_1": speedup,
        "server_aborted_requests": int(aborted[0].split()[1]) if aborted else None,
        "pass": {
            "zero_failures": all(p.failures == 0 for p in phases),
            "speedup_at_least_3x": speedup >= 3.0,
        },
    }


def print_table(report: dict[str, Any]) -> None:
    def fmt(v: float | None, unit: str = "") -> str:
        return "-" if v is None else f"{v:.2f}{unit}"

    print(f"\nmodel {report['model']}, {report['max_tokens']} tokens per request, max_batch {report['max_batch']}")
    print(f"{'phase':<12} {'reqs':>5} {'fail':>5} {'wall s':>7} {'tok':>6} {'agg tok/s':>10} {'TTFT p50':>9} "
          f"{'TTFT p99':>9} {'req tok/s':>9}")
    for p in report["phases"]:
        print(f"{p['name']:<12} {p['requests']:>5} {p['failures']:>5} {p['wall_s']:>7.1f} {p['completion_tokens']:>6} "
              f"{p['aggregate_tokens_per_s']:>10.1f} {fmt(p['ttft_p50_s'], 's'):>9} {fmt(p['ttft_p99_s'], 's'):>9} "
              f"{fmt(p['per_request_tokens_per_s_p50']):>9}")
        for e in p["errors"]:
            print(f"    error: {e}")
    print(f"batching speedup, 8 clients vs 1: {report['batching_speedup_8_vs_1']:.2f}x (need >= 3x)")
    print(f"pass: {report['pass']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--url", default=None, help="use a running server instead of starting one")
    parser.add_argument("--api-key", default="load-test-key")
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--requests", type=int, default=4, help="requests per client in the main phase")
    parser.add_argument("--baseline-requests", type=int, default=3, help="requests per client, 1- and 8-client phases")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--server-threads", type=int, default=1,
                        help="torch threads in the server (0 = torch's default). On 2 shared cores, 1 avoids OpenMP "
                             "stalls: the server's event loop and these clients need CPU too")
    parser.add_argument("--phase-timeout", type=float, default=300.0, help="seconds; a phase past this fails")
    parser.add_argument("--replicas", type=int, nargs="+", default=None,
                        help="run once per value against `serve --replicas N` (0: one engine, no Ray)")
    parser.add_argument("--out", default=None, help="default bench/results/load.json (cluster_load.json with "
                                                    "--replicas)")
    args = parser.parse_args()

    RESULTS.mkdir(parents=True, exist_ok=True)
    headers = {"Authorization": f"Bearer {args.api_key}"}
    runs = []
    for replicas in args.replicas or [0]:
        proc = None
        url = args.url
        if url is None:
            proc, url = start_server(args.model, args.max_batch, args.api_key, args.server_threads or None, replicas)
        try:
            report = asyncio.run(main_async(args, url, headers))
        finally:
            if proc is not None:
                proc.terminate()
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
        report["replicas"] = replicas
        print(f"\n== {'one engine (no Ray)' if not replicas else f'{replicas} replicas on Ray Serve'}")
        print_table(report)
        runs.append(report)
    if args.replicas is None:
        out, result = Path(args.out or RESULTS / "load.json"), runs[0]
    else:
        out, result = Path(args.out or RESULTS / "cluster_load.json"), {"runs": runs, "table": compare(runs)}
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return 0 if all(all(r["pass"].values()) for r in runs) else 1


def compare(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The main phase of each run side by side (printed as a table)."""
    rows = []
    for r in runs:
        main = r["phases"][-1]
        rows.append({"replicas": r["replicas"], "requests": main["requests"], "failures": main["failures"],
                     "tokens_per_s": main["aggregate_tokens_per_s"], "ttft_p50_s": main["ttft_p50_s"],
                     "ttft_p99_s": main["ttft_p99_s"], "one_client_tokens_per_s": r["phases"][0]["aggregate_tokens_per_s"]})
    print(f"\n{'server':<26}{'reqs':>6}{'fail':>6}{'tok/s':>8}{'TTFT p50':>10}{'TTFT p99':>10}{'1-client tok/s':>16}")
    for row in rows:
        name = "one engine (no Ray)" if not row["replicas"] else f"{row['replicas']} replica(s), Ray Serve"
        print(f"{name:<26}{row['requests']:>6}{row['failures']:>6}{row['tokens_per_s']:>8.1f}"
              f"{row['ttft_p50_s']:>9.2f}s{row['ttft_p99_s']:>9.2f}s{row['one_client_tokens_per_s']:>16.1f}")
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
