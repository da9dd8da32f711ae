"""`fluxion-lite serve --replicas 2` for real: two CPU replicas of smollm2-135m on Ray Serve behind the ingress.
Many concurrent streams, a chat's second turn meeting its prefix cache, metrics of both replicas, and a replica
killed mid-stream (its client gets an error and [DONE], the survivor serves, Ray brings the replica back). The
openai-SDK tests run through the same command too (test_server_openai.py)."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytestmark = pytest.mark.slow
pytest.importorskip("ray.serve", reason="serve --replicas needs fluxion-lite[cluster]")

MODEL = "smollm2-135m"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def replicas(base: str) -> list[dict]:
    return httpx.get(f"{base}/cluster", timeout=10).json()["replicas"]


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "fluxion_lite.cli", "serve", "--model", MODEL, "--port", str(port), "--replicas", "2",
         "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"serve --replicas exited with {proc.returncode}:\n{proc.stdout.read() if proc.stdout else ''}")
            try:
                if all(r["up"] for r in replicas(url)):
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        else:
            pytest.fail("the replicas were not up in 180 s")
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def stream_chat(base: str, content: str, max_tokens: int, timeout: float = 120) -> list[str]:
    """The data lines of one streamed chat completion."""
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "stream": True,
            "temperature": 0}
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=timeout) as r:
        assert r.status_code == 200, r.read()
        return [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]


def test_32_concurrent_streams_of_4_requests_without_a_failure(base: str) -> None:
    def client(i: int) -> int:
        done = 0
        for j in range(4):
            events = stream_chat(base, f"Client {i} asks question {j}: name a colour.", 8)
            assert events[-1] == "[DONE]" and not any('"error"' in e for e in events), events
            text = "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in events[:-1])
            assert text.strip()
            done += 1
        return done

    with ThreadPoolExecutor(32) as pool:
        assert sum(pool.map(client, range(32))) == 128
    routed = [r["routed"] for r in replicas(base)]
    assert min(routed) >= 16, routed  # both replicas served a good share


def test_a_chats_second_turn_reaches_its_prefix_cache(base: str) -> None:
    for topic in ("rivers", "mountains", "deserts", "forests"):
        first = [{"role": "system", "content": "You answer in one short sentence."},
                 {"role": "user", "content": f"Tell me one fact about {topic}."}]
        r1 = httpx.post(f"{base}/v1/chat/completions", json={"messages": first, "max_tokens": 12, "temperature": 0},
                        timeout=60).json()
        reply = r1["choices"][0]["message"]["content"]
        second = first + [{"role": "assistant", "content": reply}, {"role": "user", "content": "And another?"}]
        r2 = httpx.post(f"{base}/v1/chat/completions", json={"messages": second, "max_tokens": 12, "temperature": 0},
                        timeout=60).json()
        assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] >= r1["usage"]["prompt_tokens"] // 2, (r1, r2)


def test_metrics_carry_both_replicas(base: str) -> None:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    assert 'replica="0"' in text and 'replica="1"' in text
    assert text.count("# TYPE fluxion_requests_total") <= 1 and "fluxion_cluster_replica_up" in text


def aborted(base: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("fluxion_requests_aborted_total"))


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_has_its_request_aborted_on_the_replica(base: str, stream: bool) -> None:
    """The client goes away mid-generation: its replica aborts the request (freeing its KV) rather than generating
    to the end, streaming or not (a non-streaming answer would only come at the end)."""
    before = aborted(base)
    body = {"messages": [{"role": "user", "content": f"Write a long essay ({stream})."}], "max_tokens": 2000,
            "ignore_eos": True, "stream": stream}
    if stream:  # a few events, then the connection closes
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=60) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i == 6:
                    break
    else:  # the client gives up waiting for the whole answer
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{base}/v1/chat/completions", json=body, timeout=httpx.Timeout(60, read=1.0))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (aborted(base) <= before or any(x["in_flight"] for x in replicas(base))):
        time.sleep(0.2)
    assert aborted(base) == before + 1 and not any(x["in_flight"] for x in replicas(base))


def test_a_killed_replica_ends_its_streams_and_comes_back(base: str) -> None:
    body = {"messages": [{"role": "user", "content": "Tell me a long story about a lighthouse."}], "max_tokens": 400,
            "stream": True, "temperature": 0}
    events: list[str] = []
    victim: dict | None = None
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if len(events) == 5:  # a few tokens in: kill the replica that serves this stream
                victim = next(x for x in replicas(base) if x["in_flight"] > 0)
                os.kill(victim["pid"], signal.SIGKILL)
                t_kill = time.monotonic()
        t_end = time.monotonic()
    assert victim is not None, events
    assert t_end - t_kill < 5
    assert json.loads(events[-2])["error"]["code"] == "replica_failed" and events[-1] == "[DONE]"
    # the survivor takes new requests at once
    assert stream_chat(base, "Tell me a long story about a lighthouse.", 4)[-1] == "[DONE]"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        back = replicas(base)[victim["replica"]]
        if back["up"]:
            break
        time.sleep(0.5)
    else:
        pytest.fail("the killed replica did not come back in 90 s")
    assert back["pid"] != victim["pid"]
    before = back["routed"]
    for i in range(40):  # conversations spread again: some land on the restarted replica
        r = httpx.post(f"{base}/v1/chat/completions", headers={"X-Session-ID": f"after-{i}"}, timeout=60,
                       json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
        assert r.status_code == 200
        if replicas(base)[victim["replica"]]["routed"] > before:
            break
    else:
        pytest.fail("the restarted replica took no traffic")
