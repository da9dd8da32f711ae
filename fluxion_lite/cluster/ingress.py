"""The cluster's front door: the single server's API, page, /health and /metrics over N engine replicas.

Every API request is forwarded whole to one replica (routing.py picks it), whose app (the single server's) answers
it; the ingress relays the answer, streaming event by event. What the ingress adds:

- routing by conversation, so a conversation's turns meet its KV and prefix cache on one replica;
- 503 with Retry-After when every replica that is up is full (their batch and queue), or none is up;
- failures: a replica that dies mid-stream ends its streams with an error event and [DONE] (a non-streaming
  request gets a 502); a request whose replica fails before answering is retried on another; the failed replica gets
  no new requests until its status probe answers `ready` again (Ray Serve restarts it);
- /health (200 while any replica is up), /metrics (each replica's families labelled replica="i", plus the
  ingress's own), /cluster (each replica's state as JSON).

The replicas are reached through handles with Ray Serve's DeploymentHandle interface (`handle.status.remote()`,
`handle.options(stream=True).http.remote(...)`); this module does not import Ray, so it is tested with stand-ins.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Sequence
from importlib import resources
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from fluxion_lite.cluster.metrics import ingress_metrics, merge_replicas
from fluxion_lite.cluster.routing import Router, affinity_key
from fluxion_lite.server.app import ApiKeyMiddleware, error_response
from fluxion_lite.server.protocol import ApiError

log = logging.getLogger("fluxion_lite.cluster")

PROBE_PERIOD_S = 1.0  # how often each replica's status is asked
PROBE_TIMEOUT_S = 2.0  # a status call slower than this counts as "down" (a restarting replica queues the call)
FAILED_HOLD_S = 2.0  # a replica whose call failed gets no new request for this long, and then only once ready
_METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]


class ClusterIngress:
    """replicas: one handle per engine replica. options: api_key, retry_after_s, max_body_bytes, capacity (a
    replica's batch plus queue, until its first status says otherwise)."""

    def __init__(self, replicas: Sequence[Any], options: dict[str, Any]) -> None:
        self.handles = list(replicas)
        self.router = Router.of(len(self.handles), int(options.get("capacity") or 80))
        self.api_key: str | None = options.get("api_key")
        self.retry_after_s = int(options.get("retry_after_s") or 2)
        self.max_body_bytes = int(options.get("max_body_bytes") or 1 << 20)
        self._page = resources.files("fluxion_lite.server").joinpath("static/index.html").read_text("utf-8")
        self._prober: asyncio.Task[None] | None = None
        self.asgi = self._build_app()

    # Ray Serve builds the ASGI app of a `@serve.ingress()` class with this, after __init__.
    def __serve_build_asgi_app__(self) -> Starlette:
        return self.asgi

    def _build_app(self) -> Starlette:
        routes = [
            Route("/", self.page, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/cluster", self.cluster, methods=["GET"]),
            Route("/{path:path}", self.forward, methods=_METHODS),
        ]
        app = Starlette(routes=routes)
        if self.api_key:
            app.add_middleware(ApiKeyMiddleware, api_key=self.api_key)
        return app

    # -- replica state ------------------------------------------------------------------------------------------------

    def _ensure_prober(self) -> None:
        if self._prober is None or self._prober.done():
            self._prober = asyncio.ensure_future(self._probe_forever())

    async def _probe_forever(self) -> None:
        while True:
            await self.probe()
            await asyncio.sleep(PROBE_PERIOD_S)

    async def probe(self) -> None:
        """Ask every replica for its status at once; one that does not answer in time counts as down."""
        await asyncio.gather(*(self._probe_one(i) for i in range(len(self.handles))))

    async def _probe_one(self, index: int) -> None:
        replica = self.router.replicas[index]
        try:
            status = await asyncio.wait_for(_awaitable(self.handles[index].status.remote()), PROBE_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - dead, restarting or unreachable: all mean "not now"
            if replica.ready:
                log.warning("replica %d stopped answering: %s", index, type(exc).__name__)
            replica.ready, replica.state = False, "down"
            return
        replica.pid = status.get("pid")
        replica.capacity = int(status.get("capacity") or replica.capacity)
        replica.state = str(status.get("state"))
        was_ready, replica.ready = replica.ready, replica.state == "ready"
        if replica.ready and not was_ready:
            log.info("replica %d is ready (pid %s)", index, replica.pid)

    # -- endpoints ----------------------------------------------------------------------------------------------------

    async def page(self, request: Request) -> Response:
        return HTMLResponse(self._page)

    async def health(self, request: Request) -> Response:
        self._ensure_prober()
        await self.probe()
        up = sum(r.up for r in self.router.replicas)
        body: dict[str, Any] = {"replicas": len(self.router.replicas), "replicas_up": up}
        if up:
            return JSONResponse({"status": "ok", **body})
        states = {r.state for r in self.router.replicas}
        body["status"] = "failed" if states == {"failed"} else "loading"
        return JSONResponse(body, status_code=503, headers={"Retry-After": str(self.retry_after_s)})

    async def metrics(self, request: Request) -> Response:
        self._ensure_prober()
        texts = await asyncio.gather(*(self._replica_metrics(i) for i in range(len(self.handles))))
        merged = merge_replicas([(i, t) for i, t in enumerate(texts) if t])
        return PlainTextResponse(merged + ingress_metrics(self.router),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    async def _replica_metrics(self, index: int) -> str:
        try:
            return str(await asyncio.wait_for(_awaitable(self.handles[index].metrics.remote()), PROBE_TIMEOUT_S))
        except Exception:  # noqa: BLE001 - a replica that is down has no metrics to give
            return ""

    async def cluster(self, request: Request) -> Response:
        self._ensure_prober()
        return JSONResponse({"replicas": [
            {"replica": r.index, "state": r.state, "up": r.up, "pid": r.pid, "in_flight": r.in_flight,
             "capacity": r.capacity, "routed": r.routed, "failures": r.failures} for r in self.router.replicas],
            "rejected": {"full": self.router.rejected_full, "no_replica_up": self.router.rejected_down}})

    async def forward(self, request: Request) -> Response:
        self._ensure_prober()
        try:
            body = await _read_body(request, self.max_body_bytes)
        except ApiError as exc:
            return error_response(exc)
        headers = {k.lower(): v for k, v in request.headers.items()}
        key = affinity_key(request.url.path, headers, body)
        raw_headers = [(k, v) for k, v in request.scope["headers"]]
        tried: set[int] = set()
        while True:
            replica = self.router.pick(key, exclude=tried)
            if replica is None:
                return self._unavailable(bool(tried))
            replica.in_flight += 1
            replica.routed += 1
            stream = self.handles[replica.index].options(stream=True).http.remote(
                request.method, request.url.path, request.scope.get("query_string", b""), raw_headers, body)
            try:
                start = await _unless_client_leaves(request, stream.__anext__())
            except ClientGone:
                replica.in_flight -= 1
                _cancel(stream)  # the replica's app sees the disconnect: the request is aborted, its KV freed
                return Response(status_code=499)
            except Exception as exc:  # noqa: BLE001 - the replica failed before answering: try another one
                replica.in_flight -= 1
                _cancel(stream)
                self.router.mark_failed(replica, FAILED_HOLD_S)
                log.warning("replica %d failed before answering (%s); retrying elsewhere", replica.index,
                            type(exc).__name__)
                tried.add(replica.index)
                continue
            headers_out = [(k, v) for k, v in start["headers"] if k.lower() != "content-length"]
            media = next((v for k, v in headers_out if k.lower() == "content-type"), "")
            if media.startswith("text/event-stream"):
                return StreamingResponse(self._relay(replica, stream), status_code=start["status"],
                                         headers=dict(headers_out))
            try:
                content = b"".join(await _unless_client_leaves(request, _collect(stream)))
            except ClientGone:
                _cancel(stream)
                return Response(status_code=499)
            except Exception as exc:  # noqa: BLE001
                self.router.mark_failed(replica, FAILED_HOLD_S)
                return error_response(ApiError(502, f"The replica serving this request failed: {type(exc).__name__}",
                                               type="server_error", code="replica_failed"))
            finally:
                replica.in_flight -= 1
            return Response(content, status_code=start["status"], headers=dict(headers_out))

    async def _relay(self, replica: Any, stream: Any) -> AsyncIterator[bytes]:
        """A replica's SSE stream, event by event; if the replica dies, an error event and [DONE] end it."""
        finished = False
        try:
            async for chunk in stream:
                yield chunk
            finished = True
        except Exception as exc:  # noqa: BLE001 - headers are sent: report in-band and end the stream
            self.router.mark_failed(replica, FAILED_HOLD_S)
            log.warning("replica %d failed mid-stream: %s", replica.index, type(exc).__name__)
            error = {"error": {"message": f"The replica serving this request failed ({type(exc).__name__}); "
                                          "retry the request", "type": "server_error", "code": "replica_failed",
                               "param": None}}
            yield f"data: {json.dumps(error)}\n\n".encode()
            yield b"data: [DONE]\n\n"
            finished = True
        finally:
            replica.in_flight -= 1
            if not finished:
                _cancel(stream)  # the client left: the replica's app sees the disconnect and frees the KV

    def _unavailable(self, after_failure: bool) -> Response:
        if any(r.up for r in self.router.replicas):
            error = ApiError(503, "Every replica is at capacity; retry later", type="unavailable_error",
                             code="queue_full", headers={"Retry-After": str(self.retry_after_s)})
        else:
            what = "the replicas failed" if after_failure else "no replica is ready"
            error = ApiError(503, f"The model is not available right now ({what}); retry shortly",
                             type="unavailable_error", code="model_loading",
                             headers={"Retry-After": str(self.retry_after_s)})
        return error_response(error)


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was complete."""


async def _unless_client_leaves(request: Request, awaitable: Any) -> Any:
    """The awaitable's result, or ClientGone if the client disconnects first (the body is read by then, so the next
    message uvicorn gives is the disconnect). A non-streaming answer arrives whole at the end, so without this a
    client that left would keep its request, and its KV, on the replica until the generation ends."""

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work, watch = asyncio.ensure_future(awaitable), asyncio.ensure_future(gone())
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if work in done:
        return work.result()
    work.cancel()
    raise ClientGone()


async def _collect(stream: Any) -> list[bytes]:
    return [chunk async for chunk in stream]


async def _read_body(request: Request, limit: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"Request body exceeds the limit of {limit} bytes", code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


async def _awaitable(response: Any) -> Any:
    return await response


def _cancel(stream: Any) -> None:
    with contextlib.suppress(Exception):
        stream.cancel()


