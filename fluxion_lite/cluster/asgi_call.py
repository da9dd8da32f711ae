"""One HTTP request through an ASGI app inside this process, its response as a stream of parts.

A replica runs the single server's app (server/app.py) without a socket: the ingress hands it the request's method,
path, headers and body over Ray, and gets back the response start (status and headers), then the body's chunks as
the app sends them (an SSE stream event by event). When the caller stops reading (its client went away, or the
ingress cancelled the call), the app sees `http.disconnect`, as it would from uvicorn, and aborts the request: its KV
is freed at the engine's next step.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from starlette.types import ASGIApp, Message

_RUNNING: set[asyncio.Task[None]] = set()  # apps still finishing after their caller left (kept from the collector)


async def call_asgi(app: ASGIApp, method: str, path: str, query: bytes, headers: list[tuple[bytes, bytes]],
                    body: bytes) -> AsyncIterator[dict[str, Any] | bytes]:
    """Yields {"status": int, "headers": [(name, value), ...]} first, then the body's chunks (bytes)."""
    sent: asyncio.Queue[Message] = asyncio.Queue()
    gone = asyncio.Event()
    body_given = False

    async def receive() -> Message:
        nonlocal body_given
        if not body_given:
            body_given = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        await sent.put(message)

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": method, "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": query,
             "root_path": "", "headers": headers, "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0)}
    task = asyncio.ensure_future(app(scope, receive, send))
    _RUNNING.add(task)
    task.add_done_callback(_RUNNING.discard)
    try:
        while True:
            getter = asyncio.ensure_future(sent.get())
            done, _ = await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
            if getter not in done:
                getter.cancel()
                task.result()  # the app raised: re-raise here
                if sent.empty():
                    return  # it returned without finishing its response
                continue
            message = getter.result()
            if message["type"] == "http.response.start":
                yield {"status": int(message["status"]),
                       "headers": [(k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", [])]}
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    return
    finally:
        gone.set()  # the app sees the client leave and frees the request; it finishes on the loop by itself
