"""`fluxion-lite serve` as a real subprocess on a free port, driven by the official openai SDK: one engine under
uvicorn, and the same tests through the Ray Serve ingress of `serve --replicas 2` (needs fluxion-lite[cluster])."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
API_KEY = "test-key-123"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module", params=["one engine", "2 replicas"])
def server(request: pytest.FixtureRequest) -> Iterator[tuple[str, list[int]]]:
    """Base URL and the /health statuses seen while it started."""
    replicas = ["--replicas", "2"] if request.param == "2 replicas" else []
    if replicas:
        pytest.importorskip("ray.serve", reason="serve --replicas needs fluxion-lite[cluster]")
    port = _free_port()
    # --dtype float32: the answers these tests read ("Paris", ...) are the fp32 model's; with the file's 4-bit blocks
    # (the CPU default) smollm2-135m answers as llama.cpp does on the same file (tests/engine/test_quantized_model.py)
    proc = subprocess.Popen(
        [sys.executable, "-m", "fluxion_lite.cli", "serve", "--model", MODEL, "--port", str(port), "--max-batch", "4",
         "--api-key", API_KEY, "--log-level", "warning", "--dtype", "float32", *replicas],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    base = f"http://127.0.0.1:{port}"
    seen: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"server exited with {proc.returncode}:\n{proc.stdout.read() if proc.stdout else ''}")
            try:
                status = httpx.get(f"{base}/health", timeout=2).status_code
            except httpx.TransportError:
                time.sleep(0.1)
                continue
            seen.append(status)
            if status == 200:
                break
            time.sleep(0.1)
        else:
            pytest.fail("server did not become healthy in 120 s")
        yield base, seen
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def client(server: tuple[str, list[int]]) -> object:
    from openai import OpenAI

    return OpenAI(base_url=f"{server[0]}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def test_health_reports_loading_before_ready(server: tuple[str, list[int]]) -> None:
    statuses = server[1]
    assert statuses[-1] == 200
    assert set(statuses) <= {503, 200}  # never an error other than "still loading"


def test_sdk_lists_the_model(client: object) -> None:
    models = client.models.list()  # type: ignore[attr-defined]
    assert [m.id for m in models.data] == [MODEL]


def test_sdk_chat_non_stream(client: object) -> None:
    resp = client.chat.completions.create(  # type: ignore[attr-defined]
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=12,
        temperature=0,
    )
    assert resp.object == "chat.completion"
    assert "Paris" in resp.choices[0].message.content
    assert resp.choices[0].finish_reason in ("stop", "length")
    assert resp.usage.completion_tokens >= 1 and resp.usage.prompt_tokens > 10


def test_sdk_chat_stream_with_usage(client: object) -> None:
    stream = client.chat.completions.create(  # type: ignore[attr-defined]
        model=MODEL, messages=[{"role": "user", "content": "Name three colours."}], max_tokens=16, temperature=0,
        stream=True, stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text.strip() and finishes in (["stop"], ["length"])
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1


def test_sdk_completions_stream_and_non_stream(client: object) -> None:
    full = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=8, temperature=0)  # type: ignore
    assert full.choices[0].finish_reason == "length" and full.usage.completion_tokens == 8
    parts = [c.choices[0].text for c in client.completions.create(  # type: ignore[attr-defined]
        model=MODEL, prompt="The sky is", max_tokens=8, temperature=0, stream=True) if c.choices]
    assert "".join(parts) == full.choices[0].text


def test_sdk_raises_typed_errors(client: object, server: tuple[str, list[int]]) -> None:
    import openai

    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=4)  # type: ignore[attr-defined]
    assert err.value.code == "empty_messages"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(  # type: ignore[attr-defined]
            model="no-such-model", messages=[{"role": "user", "content": "x"}], max_tokens=4)
    from openai import OpenAI

    wrong = OpenAI(base_url=f"{server[0]}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
