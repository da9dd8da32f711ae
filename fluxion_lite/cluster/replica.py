"""An engine replica: the single server's app and engine (server/app.py) inside a Ray Serve deployment.

Each replica owns one device (a GPU, or a share of the CPU cores as its native thread pool) and its own KV cache;
the ingress (cluster/ingress.py) forwards whole HTTP requests to it, so every endpoint, error and usage field is the
single server's.
"""
from __future__ import annotations

import argparse
import os
from collections.abc import AsyncIterator
from typing import Any

from fluxion_lite.cluster.asgi_call import call_asgi
from fluxion_lite.settings import Settings


class EngineReplica:
    """options: the engine options of `serve` (model, device, dtype, attention, max_batch, max_queue, max_context,
    prefill_chunk, default_max_tokens) and `settings_flags` (settings over this process's environment, e.g. the
    replica's threads)."""

    def __init__(self, options: dict[str, Any]) -> None:
        from fluxion_lite.server.app import build_server

        settings = Settings.load(flags=options.get("settings_flags") or None)
        args = argparse.Namespace(**{k: v for k, v in options.items() if k != "settings_flags"})
        self.app, self.bridge, self.config = build_server(args, settings, api_key=None)  # the ingress checks keys
        self.bridge.start()  # loads the model in the background; status() says when it is ready

    async def status(self) -> dict[str, Any]:
        return {"state": self.bridge.state, "pid": os.getpid(), "in_flight": self.bridge.in_flight,
                "error": self.bridge.load_error, "capacity": self.bridge.max_batch + self.bridge.max_queue}

    async def metrics(self) -> str:
        return str(self.app.state.server.metrics.render(self.bridge.stats()))

    async def http(self, method: str, path: str, query: bytes, headers: list[tuple[bytes, bytes]],
                   body: bytes) -> AsyncIterator[dict[str, Any] | bytes]:
        async for part in call_asgi(self.app, method, path, query, headers, body):
            yield part

    def __del__(self) -> None:
        bridge = getattr(self, "bridge", None)
        if bridge is not None:
            bridge.stop(timeout=5)
