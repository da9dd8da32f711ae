"""The chat server against the real engine on smollm2-135m: every endpoint, the error table, loading, auth, faults,
plus (in a uvicorn thread) mid-stream disconnect, the bounded queue and concurrent batching."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient

from fluxion_lite.errors import ModelFileError
from fluxion_lite.server.app import ServerConfig, create_app
from fluxion_lite.server.async_engine import AsyncEngine

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
USER = [{"role": "user", "content": "What is the capital of France?"}]


# Every test runs with the engine waiting for each step and with async decode (async_decode.py: the next decode step
# queued before the current tokens are read, the CUDA default), whose bookkeeping must not show through the server.
DECODE = ["sync", "async"]


@pytest.fixture(scope="module", params=DECODE)
def engine(request: pytest.FixtureRequest) -> Any:
    from fluxion_lite.engine.engine import Engine

    e = Engine(MODEL, max_batch=4, prefill_chunk=128, dtype="float32")  # the fp32 model's answers
    e.async_decode = request.param == "async"
    return e


def make_app(engine: Any, *, max_batch: int = 4, max_queue: int = 8, loader: Any = None,
             **config: Any) -> tuple[Any, AsyncEngine]:
    bridge = AsyncEngine(loader or (lambda: engine), max_batch=max_batch, max_queue=max_queue)
    config.setdefault("max_body_bytes", 256 * 1024)
    return create_app(bridge, ServerConfig(model_id=MODEL, **config)), bridge


@pytest.fixture(scope="module")
def client(engine: Any) -> Iterator[TestClient]:
    app, bridge = make_app(engine)
    with TestClient(app) as c:
        assert bridge.wait_ready(30)
        yield c


def sse_events(text: str) -> list[Any]:
    """Parsed `data:` payloads of an SSE body ([DONE] kept as the string); comments dropped."""
    events: list[Any] = []
    for block in text.split("\n\n"):
        if block.startswith("data: "):
            data = block[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


# ---------------------------------------------------------------------------------------------------------------------
# Endpoints


def test_chat_non_stream_shape_and_usage(client: TestClient) -> None:
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": USER, "max_tokens": 12,
                                                  "temperature": 0})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "chat.completion" and body["model"] == MODEL
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and "Paris" in choice["message"]["content"]
    assert choice["finish_reason"] in ("stop", "length")
    usage = body["usage"]
    assert usage["prompt_tokens"] > 10 and 1 <= usage["completion_tokens"] <= 12
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_chat_stream_chunks_match_non_stream_text(client: TestClient) -> None:
    req = {"messages": USER, "max_tokens": 12, "temperature": 0}
    full = client.post("/v1/chat/completions", json=req).json()["choices"][0]["message"]["content"]
    r = client.post("/v1/chat/completions", json={**req, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    # finish_reason only on the last choice chunk, then one usage chunk with no choices
    with_choices = [c for c in chunks if c["choices"]]
    assert [c["choices"][0]["finish_reason"] for c in with_choices[:-1]] == [None] * (len(with_choices) - 1)
    assert with_choices[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] >= 1
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in with_choices)
    assert streamed == full  # greedy: the same text either way


def test_follow_up_turn_reuses_the_prefix(client: TestClient) -> None:
    first = client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 10, "temperature": 0}).json()
    turn2 = USER + [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                    {"role": "user", "content": "And Italy?"}]
    second = client.post("/v1/chat/completions", json={"messages": turn2, "max_tokens": 5, "temperature": 0}).json()
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= first["usage"]["prompt_tokens"]  # the whole first prompt came from the cache
    assert cached < second["usage"]["prompt_tokens"]


def test_completions_stream_and_non_stream(client: TestClient) -> None:
    req = {"prompt": "The quick brown fox", "max_tokens": 6, "temperature": 0}
    body = client.post("/v1/completions", json=req).json()
    assert body["object"] == "text_completion" and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 6
    events = sse_events(client.post("/v1/completions", json={**req, "stream": True}).text)
    assert events[-1] == "[DONE]"
    assert all(e["object"] == "text_completion" for e in events[:-1])
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == body["choices"][0]["text"]
    assert events[-2]["choices"][0]["finish_reason"] == "length"


def test_completions_accept_token_ids_and_stop_strings(client: TestClient) -> None:
    ids = client.post("/tokenize", json={"content": "1, 2, 3, 4,"}).json()["tokens"]
    body = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 20, "temperature": 0,
                                                "stop": [","]}).json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop" and "," not in choice["text"]


def test_seeded_sampling_is_reproducible(client: TestClient) -> None:
    req = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 1.0, "top_k": 40, "min_p": 0.05,
           "seed": 1234}
    a = client.post("/v1/completions", json=req).json()["choices"][0]["text"]
    b = client.post("/v1/completions", json=req).json()["choices"][0]["text"]
    assert a == b


def test_models_props_tokenize_detokenize(client: TestClient, engine: Any) -> None:
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == MODEL
    assert models["data"][0]["max_model_len"] == engine.context_length
    props = client.get("/props").json()
    assert props["context_length"] == engine.context_length and props["attention_mode"] == "auto"
    assert props["auto_dense_tokens"] == engine.auto_dense_tokens == 2048
    toks = client.post("/tokenize", json={"content": "hello world", "add_special": False}).json()
    assert toks["tokens"] == engine.tokenizer.encode("hello world", add_special=False)
    assert client.post("/detokenize", json={"tokens": toks["tokens"]}).json() == {"content": "hello world"}


def test_usage_says_how_a_request_attended_and_takes_its_epsilon(client: TestClient, engine: Any) -> None:
    """Mode auto: a short prompt ran dense (reads all its KV), a long one fluxion; a request's own epsilon is used
    and reported, a smaller one reading more; a bad epsilon is a 400 naming the field."""
    short = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).json()
    assert short["usage"]["attention"] == {"mode": "dense", "epsilon": None, "kv_read_fraction": 1.0}
    long_prompt = engine.tokenizer.decode(list(range(1000, 3400)))  # ~2,400 tokens: over the crossover
    reads = {}
    for eps in (None, 0.02, 1.0):
        body = {"prompt": long_prompt, "max_tokens": 2, **({} if eps is None else {"epsilon": eps})}
        usage = client.post("/v1/completions", json=body).json()["usage"]
        assert usage["attention"]["mode"] == "fluxion" and usage["attention"]["epsilon"] == eps
        reads[eps] = usage["attention"]["kv_read_fraction"]
    assert 0 < reads[1.0] < reads[0.02] < 1
    for bad in (0, -1, "small", 1000):
        r = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "epsilon": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "epsilon", r.text


def test_health_page_and_metrics(client: TestClient) -> None:
    assert client.get("/health").json() == {"status": "ok"}
    page = client.get("/")
    assert page.status_code == 200 and "/v1/chat/completions" in page.text and 'id="stop"' in page.text
    client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3})
    text = client.get("/metrics").text
    for name in ("fluxion_requests_total", "fluxion_generation_tokens_total", "fluxion_time_to_first_token_seconds_bucket",
                 "fluxion_time_per_output_token_seconds_count", "fluxion_queue_depth", "fluxion_kv_cache_host_bytes",
                 "fluxion_kv_cache_gpu_bytes"):
        assert name in text
    assert 'fluxion_requests_total{endpoint="/v1/completions",status="200"}' in text
    generated = [line for line in text.splitlines() if line.startswith("fluxion_generation_tokens_total ")]
    assert int(generated[0].split()[1]) >= 3


def test_keep_alive_comments_during_a_long_prefill(engine: Any) -> None:
    app, bridge = make_app(engine, keepalive_s=0.01)
    long_prompt = "Tell me about the sea. " * 150  # ~900 tokens: several 128-token prefill chunks
    with TestClient(app) as c:
        assert bridge.wait_ready(30)
        r = c.post("/v1/completions", json={"prompt": long_prompt, "max_tokens": 2, "stream": True})
    assert r.status_code == 200
    before_data = r.text.split("data: ")[0]
    assert ": keep-alive" in before_data
    assert sse_events(r.text)[-1] == "[DONE]"


# ---------------------------------------------------------------------------------------------------------------------
# Bad input: exact status, type and code for each


def _huge_prompt_ids() -> list[int]:
    return [42] * 9000  # longer than the 8192-token context


BAD_INPUTS = [
    # (path, raw body or JSON, status, type, code)
    ("/v1/chat/completions", b'{"messages": [', 400, "invalid_request_error", "invalid_json"),
    ("/v1/chat/completions", b"", 400, "invalid_request_error", "invalid_json"),
    ("/v1/chat/completions", b'{"messages": [{"role":"user","content":"x"}], "temperature": NaN}', 400,
     "invalid_request_error", "invalid_value"),
    ("/v1/chat/completions", [1, 2], 400, "invalid_request_error", "invalid_type"),
    ("/v1/chat/completions", {}, 400, "invalid_request_error", "missing_required_parameter"),
    ("/v1/chat/completions", {"messages": []}, 400, "invalid_request_error", "empty_messages"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "invalid_request_error", "invalid_type"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "invalid_request_error",
     "invalid_value"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "invalid_request_error",
     "invalid_type"),
    ("/v1/chat/completions", {"messages": USER, "temperature": "hot"}, 400, "invalid_request_error", "invalid_type"),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 0}, 400, "invalid_request_error", "invalid_value"),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": True}, 400, "invalid_request_error", "invalid_type"),
    ("/v1/chat/completions", {"messages": USER, "frobnicate": 1}, 400, "invalid_request_error", "unknown_parameter"),
    ("/v1/chat/completions", {"messages": USER, "n": 2}, 400, "invalid_request_error", "unsupported_parameter"),
    ("/v1/chat/completions", {"messages": USER, "model": "gpt-9"}, 404, "invalid_request_error", "model_not_found"),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 9000}, 400, "invalid_request_error",
     "context_length_exceeded"),
    ("/v1/chat/completions", {"messages": USER, "top_p": 0}, 400, "invalid_request_error", "invalid_value"),
    ("/v1/chat/completions", {"messages": USER, "stream_options": {"include_usage": True}}, 400,
     "invalid_request_error", "invalid_value"),
    ("/v1/completions", {"prompt": _huge_prompt_ids()}, 400, "invalid_request_error", "context_length_exceeded"),
    ("/v1/completions", {"prompt": ""}, 400, "invalid_request_error", "empty_prompt"),
    ("/v1/completions", {"prompt": [10**9]}, 400, "invalid_request_error", "invalid_value"),
    ("/v1/completions", {"prompt": "x" * 300_000}, 413, "invalid_request_error", "request_too_large"),
    ("/detokenize", {"tokens": [-1]}, 400, "invalid_request_error", "invalid_value"),
    ("/tokenize", {"text": "wrong field"}, 400, "invalid_request_error", "unknown_parameter"),
]


@pytest.mark.parametrize(("path", "body", "status", "etype", "code"), BAD_INPUTS,
                         ids=[f"{i}-{case[4]}" for i, case in enumerate(BAD_INPUTS)])
def test_bad_input_table(client: TestClient, path: str, body: Any, status: int, etype: str, code: str) -> None:
    if isinstance(body, bytes):
        r = client.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        r = client.post(path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert (error["type"], error["code"]) == (etype, code)
    assert isinstance(error["message"], str) and error["message"]


def test_context_error_carries_the_token_counts(client: TestClient, engine: Any) -> None:
    r = client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 9000})
    message = r.json()["error"]["message"]
    prompt_tokens = client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 1}).json()["usage"][
        "prompt_tokens"]
    assert str(engine.context_length) in message and "9000" in message and f"{prompt_tokens} in the prompt" in message


def test_unknown_route_and_wrong_method_are_json(client: TestClient) -> None:
    r = client.get("/v1/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = client.get("/v1/chat/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"


# ---------------------------------------------------------------------------------------------------------------------
# Loading, auth, internal faults


def test_health_is_503_while_loading_then_200(engine: Any) -> None:
    gate = threading.Event()
    app, bridge = make_app(engine, loader=lambda: (gate.wait(30), engine)[1])
    with TestClient(app) as c:
        r = c.get("/health")
        assert r.status_code == 503 and r.json() == {"status": "loading"} and "retry-after" in r.headers
        r = c.post("/v1/chat/completions", json={"messages": USER})
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading"
        gate.set()
        assert bridge.wait_ready(30)
        assert c.get("/health").status_code == 200


def test_failed_load_is_reported(engine: Any) -> None:
    def broken() -> Any:
        raise ModelFileError("/models/x.gguf: truncated tensor data")

    app, bridge = make_app(engine, loader=broken)
    with TestClient(app) as c:
        assert not bridge.wait_ready(10)
        r = c.get("/health")
        assert r.status_code == 503 and "truncated tensor data" in r.json()["error"]
        assert c.get("/v1/models").json()["error"]["code"] == "model_load_failed"


def test_api_key(engine: Any) -> None:
    app, bridge = make_app(engine, api_key="s3cret")
    with TestClient(app) as c:
        assert bridge.wait_ready(30)
        assert c.get("/health").status_code == 200  # stays open for probes
        assert c.get("/").status_code == 200  # the page itself asks for the key
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = c.get("/v1/models", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert c.get("/metrics").status_code == 401
        assert c.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200


class FaultyEngine:
    """The real engine with injected faults: add_request fails for seed 666; step fails once when armed."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self.fail_next_step = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def add_request(self, prompt: Any, params: Any, request_id: str | None = None) -> str:
        if params.seed == 666:
            raise RuntimeError("injected add_request fault")
        return self._engine.add_request(prompt, params, request_id=request_id)

    def step(self) -> list[Any]:
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("injected step fault")
        return self._engine.step()


def test_internal_failures_stay_with_their_request(engine: Any) -> None:
    faulty = FaultyEngine(engine)
    app, bridge = make_app(engine, loader=lambda: faulty)
    with TestClient(app) as c:
        assert bridge.wait_ready(30)
        r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "seed": 666})
        assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
        faulty.fail_next_step = True
        r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "stream": True})
        events = sse_events(r.text)
        assert events[-2]["error"]["code"] == "internal_error" and events[-1] == "[DONE]"
        # The server is still up and the engine holds nothing for the failed requests.
        r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert not engine.has_unfinished()


# ---------------------------------------------------------------------------------------------------------------------
# Real sockets: uvicorn in a thread of this process, so the test can watch the engine's state directly.


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module", params=DECODE)
def live_engine(request: pytest.FixtureRequest) -> Any:
    """A second Engine for the uvicorn servers: the module's TestClient keeps its own engine thread running on
    `engine` for the whole module, and an Engine must only ever be stepped by one thread."""
    from fluxion_lite.engine.engine import Engine

    e = Engine(MODEL, max_batch=4, prefill_chunk=128, dtype="float32")  # the fp32 model's answers
    e.async_decode = request.param == "async"
    return e


@pytest.fixture()
def live_server(live_engine: Any) -> Iterator[Any]:
    import uvicorn

    servers: list[Any] = []

    def start(**kw: Any) -> tuple[str, AsyncEngine]:
        app, bridge = make_app(live_engine, **kw)
        port = _free_port()
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                               timeout_graceful_shutdown=5))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        servers.append((server, thread))
        assert bridge.wait_ready(30)
        deadline = time.monotonic() + 20
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        return f"http://127.0.0.1:{port}", bridge

    yield start
    for server, thread in servers:
        server.should_exit = True
        thread.join(15)


def _wait_for(predicate: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def test_disconnect_mid_stream_aborts_and_frees_kv(live_server: Any, live_engine: Any) -> None:
    base, bridge = live_server()
    kv_idle = bridge.stats()["kv_bytes_host"]
    aborts_before = bridge.stats()["aborts_done"]
    body = {"prompt": "Write a very long story about dragons.", "max_tokens": 2000, "ignore_eos": True,
            "stream": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{base}/v1/completions", json=body) as r:
            assert r.status_code == 200
            received = 0
            for line in r.iter_lines():
                if line.startswith("data: "):
                    received += 1
                if received >= 5:
                    break
            assert bridge.stats()["running"] == 1
            assert bridge.stats()["kv_bytes_host"] > kv_idle  # the request holds KV while it runs
        # leaving the block closes the connection mid-stream
    assert _wait_for(lambda: bridge.stats()["aborts_done"] == aborts_before + 1, 10), bridge.stats()
    stats = bridge.stats()
    assert stats["running"] == 0 and stats["live_requests"] == 0 and bridge.in_flight == 0
    assert stats["kv_bytes_host"] == kv_idle  # its KV was freed, not parked in the prefix cache
    assert not live_engine.has_unfinished()
    with httpx.Client(timeout=30) as http:
        metrics = http.get(f"{base}/metrics").text
    assert "fluxion_requests_aborted_total 1" in metrics


def test_disconnect_during_non_stream_request_aborts_it(live_server: Any, live_engine: Any) -> None:
    base, bridge = live_server()
    aborts_before = bridge.stats()["aborts_done"]
    body = {"prompt": "Write a very long story about dragons.", "max_tokens": 2000, "ignore_eos": True}
    with httpx.Client(timeout=httpx.Timeout(30, read=1.5)) as http:
        with pytest.raises(httpx.ReadTimeout):
            http.post(f"{base}/v1/completions", json=body)  # gives up after 1.5 s and closes the connection
    assert _wait_for(lambda: bridge.stats()["aborts_done"] == aborts_before + 1, 10), bridge.stats()
    assert bridge.stats()["running"] == 0 and bridge.in_flight == 0 and not live_engine.has_unfinished()


def test_full_queue_answers_503_with_retry_after(live_server: Any) -> None:
    base, bridge = live_server(max_batch=1, max_queue=0)
    body = {"prompt": "Count slowly:", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{base}/v1/completions", json=body) as first:
            assert first.status_code == 200
            lines = first.iter_lines()  # keep the iterator: a discarded one is closed, and that closes the stream
            next(lines)
            r = http.post(f"{base}/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
            assert r.status_code == 503 and r.headers["retry-after"].isdigit()
            assert r.json()["error"]["code"] == "queue_full"
    assert _wait_for(lambda: bridge.in_flight == 0, 10)
    with httpx.Client(timeout=30) as http:
        assert http.post(f"{base}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200


def test_concurrent_streams_share_the_running_batch(live_server: Any) -> None:
    base, bridge = live_server()
    peak = 0
    stop = threading.Event()

    def watch() -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, bridge.stats().get("running", 0))
            time.sleep(0.005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    results: list[str] = []

    def one(i: int) -> None:
        with httpx.Client(timeout=60) as http:
            r = http.post(f"{base}/v1/completions", json={"prompt": f"Story {i}:", "max_tokens": 24,
                                                          "ignore_eos": True, "temperature": 0})
            results.append(r.json()["choices"][0]["finish_reason"])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    stop.set()
    watcher.join()
    assert results == ["length"] * 3
    assert peak >= 2  # they decoded together, not one after another
