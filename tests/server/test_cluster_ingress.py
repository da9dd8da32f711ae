"""The cluster ingress (cluster/ingress.py) over stand-in replicas: handles with Ray Serve's interface whose app is
a small Starlette app run in-process by call_asgi, as a real replica runs the server's app. No Ray, no model: the
routing, relaying and failure handling on their own (tests/server/test_cluster.py runs the real thing)."""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from fluxion_lite.cluster.asgi_call import call_asgi
from fluxion_lite.cluster.ingress import ClusterIngress


class ReplicaDied(Exception):
    """What Ray raises when a replica's process is gone (ActorDiedError), as far as the ingress can tell."""


def replica_app(index: int) -> Starlette:
    async def chat(request: Request) -> Any:
        body = await request.json()
        if body.get("stream"):
            async def events() -> AsyncIterator[str]:
                for i in range(body.get("events", 4)):
                    yield f"data: {json.dumps({'replica': index, 'i': i})}\n\n"
                yield "data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")
        return JSONResponse({"replica": index})

    async def metrics(request: Request) -> Any:
        return PlainTextResponse(f"# HELP fx_done Done.\n# TYPE fx_done counter\nfx_done {index + 10}\n")

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"]),
                             Route("/metrics", metrics, methods=["GET"])])


class Stream:
    def __init__(self, parts: AsyncIterator[Any]) -> None:
        self.parts, self.cancelled = parts, False

    def __aiter__(self) -> Stream:
        return self

    async def __anext__(self) -> Any:
        return await self.parts.__anext__()

    def cancel(self) -> None:
        self.cancelled = True


class FakeReplica:
    """A replica handle: status / metrics / http as Ray Serve's DeploymentHandle methods."""

    def __init__(self, index: int) -> None:
        self.index, self.app = index, replica_app(index)
        self.state, self.dead, self.die_after_parts = "ready", False, None
        self.status = SimpleNamespace(remote=self._status)
        self.metrics = SimpleNamespace(remote=self._metrics)
        self.http = SimpleNamespace(remote=lambda *a: Stream(self._http(*a)))

    def options(self, **kwargs: Any) -> FakeReplica:
        return self

    async def _status(self) -> dict[str, Any]:
        if self.dead:
            raise ReplicaDied()
        return {"state": self.state, "pid": 1000 + self.index, "in_flight": 0, "capacity": 3, "error": None}

    async def _metrics(self) -> str:
        if self.dead:
            raise ReplicaDied()
        return replica_app_metrics(self.index)

    async def _http(self, *args: Any) -> AsyncIterator[Any]:
        if self.dead:
            raise ReplicaDied()
        n = 0
        async for part in call_asgi(self.app, *args):
            if self.die_after_parts is not None and n >= self.die_after_parts:
                self.dead = True
                raise ReplicaDied()
            yield part
            n += 1


def replica_app_metrics(index: int) -> str:
    return f"# HELP fx_done Done.\n# TYPE fx_done counter\nfx_done {index + 10}\n"


@pytest.fixture
def cluster() -> tuple[TestClient, list[FakeReplica], ClusterIngress]:
    replicas = [FakeReplica(0), FakeReplica(1)]
    ingress = ClusterIngress(replicas, {"capacity": 3, "api_key": "k"})
    client = TestClient(ingress.asgi, headers={"Authorization": "Bearer k"})
    assert client.get("/health").status_code == 200  # the first probe marks both up
    return client, replicas, ingress


def chat(client: TestClient, first: str, *later: str, **fields: Any) -> Any:
    messages = [{"role": "user", "content": first}]
    for text in later:
        messages += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": text}]
    return client.post("/v1/chat/completions", json={"messages": messages, **fields})


def test_a_conversation_stays_on_one_replica_and_conversations_spread(cluster: Any) -> None:
    client, _, ingress = cluster
    homes = {f"topic {i}": chat(client, f"topic {i}").json()["replica"] for i in range(16)}
    assert set(homes.values()) == {0, 1}
    for topic, home in homes.items():
        assert chat(client, topic, "and more", "and then").json()["replica"] == home
    assert sum(r.routed for r in ingress.router.replicas) == 32


def test_sse_is_relayed_and_a_replica_dying_mid_stream_ends_it_with_an_error_and_done(cluster: Any) -> None:
    client, replicas, ingress = cluster
    lines = chat(client, "stream me", stream=True).text.strip().split("\n\n")
    assert lines[-1] == "data: [DONE]" and len(lines) == 5
    home = json.loads(lines[0][len("data: "):])["replica"]
    replicas[home].die_after_parts = 3  # the response start, then two events
    lines = chat(client, "stream me", stream=True).text.strip().split("\n\n")
    assert [json.loads(x[6:]).get("i") for x in lines[:2]] == [0, 1]
    assert json.loads(lines[2][6:])["error"]["code"] == "replica_failed" and lines[3] == "data: [DONE]"
    assert ingress.router.replicas[home].failures == 1 and not ingress.router.replicas[home].up
    assert all(r.in_flight == 0 for r in ingress.router.replicas)
    # the conversation moves to the survivor until its replica answers ready again
    assert chat(client, "stream me").json()["replica"] == 1 - home
    replicas[home].dead = False
    for r in ingress.router.replicas:
        r.down_until = 0.0
    assert client.get("/health").json()["replicas_up"] == 2
    assert chat(client, "stream me").json()["replica"] == home


def test_a_replica_failing_before_it_answers_is_retried_elsewhere(cluster: Any) -> None:
    client, replicas, ingress = cluster
    home = chat(client, "retry me").json()["replica"]
    replicas[home].die_after_parts = 0  # dies before the response starts; its status still said ready
    response = chat(client, "retry me")
    assert response.status_code == 200 and response.json()["replica"] == 1 - home
    assert ingress.router.replicas[home].failures == 1


def test_503_with_retry_after_when_every_replica_is_full_or_down(cluster: Any) -> None:
    client, replicas, ingress = cluster
    for r in ingress.router.replicas:
        r.in_flight = r.capacity
    full = chat(client, "hello")
    assert full.status_code == 503 and full.json()["error"]["code"] == "queue_full"
    assert full.headers["retry-after"] == "2"
    for r in ingress.router.replicas:
        r.in_flight = 0
    for replica in replicas:
        replica.dead = True
    assert client.get("/health").status_code == 503
    down = chat(client, "hello")
    assert down.status_code == 503 and down.json()["error"]["code"] == "model_loading"
    assert ingress.router.rejected_full == 1 and ingress.router.rejected_down == 1


def test_health_loading_metrics_labels_and_the_api_key(cluster: Any) -> None:
    client, replicas, ingress = cluster
    text = client.get("/metrics").text
    assert 'fx_done{replica="0"} 10' in text and 'fx_done{replica="1"} 11' in text
    assert text.count("# TYPE fx_done counter") == 1 and 'fluxion_cluster_routed_total{replica="0"}' in text
    assert client.get("/cluster").json()["replicas"][1]["pid"] == 1001
    anonymous = TestClient(ingress.asgi)
    assert anonymous.get("/health").status_code == 200  # open, as on the single server
    assert anonymous.post("/v1/chat/completions", json={}).status_code == 401
    for replica in replicas:
        replica.state = "loading"
    health = client.get("/health")
    assert health.status_code == 503 and health.json()["status"] == "loading"


def test_call_asgi_tells_the_app_when_its_caller_leaves() -> None:
    """A replica's stream closed early (the client went away): the app sees http.disconnect, as under uvicorn."""
    seen: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        assert (await receive())["type"] == "http.request"
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"first", "more_body": True})
        seen.append((await receive())["type"])  # blocks until the caller leaves

    async def run() -> list[Any]:
        stream = call_asgi(app, "GET", "/", b"", [], b"")
        parts = [await stream.__anext__(), await stream.__anext__()]
        await stream.aclose()
        await asyncio.sleep(0.05)
        return parts

    parts = asyncio.run(run())
    assert parts[0]["status"] == 200 and parts[1] == b"first" and seen == ["http.disconnect"]
