"""Bridge between asyncio request handlers and the (non-thread-safe) Engine.

One dedicated engine thread owns the Engine: it loads it, calls add_request / step / abort, and nothing else touches it.
Handlers talk to that thread through a thread-safe inbox (submit, abort) and get results back on a per-request
asyncio.Queue, fed with loop.call_soon_threadsafe. Each engine step decodes one token for every running request, and new
requests are added between steps, so requests join a running batch without waiting for it to drain (continuous batching).
The Engine itself chunks long prefills so a new prompt does not stall running decodes for its whole length.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from fluxion_lite.errors import CapacityError, FluxionError

log = logging.getLogger("fluxion_lite.server")


class EngineLike(Protocol):
    """The part of fluxion_lite.engine.engine.Engine this bridge uses."""

    def add_request(self, prompt: str | list[int], params: Any, request_id: str | None = None) -> str: ...
    def step(self) -> list[Any]: ...
    def abort(self, request_id: str) -> None: ...
    def has_unfinished(self) -> bool: ...
    def stats(self) -> Any: ...


class QueueFullError(Exception):
    """Too many requests in flight; the client should retry later (HTTP 503 + Retry-After)."""


class EngineNotReadyError(Exception):
    """The model is still loading, or failed to load (HTTP 503)."""


class EngineFailure(Exception):
    """The engine raised while serving this request; other requests are unaffected where possible (HTTP 500)."""


@dataclass
class _Submission:
    request_id: str
    prompt: str | list[int]
    params: Any
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue[Any]
    accepted: asyncio.Future[None]


def _resolve(future: asyncio.Future[None], error: BaseException | None) -> None:
    """Runs on the event loop: settle the acceptance future unless the handler already gave up on it."""
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


class RequestStream:
    """The handler's end of one request: outputs in order, then `finished`; abort on early exit."""

    def __init__(self, bridge: AsyncEngine, submission: _Submission) -> None:
        self._bridge = bridge
        self._submission = submission
        self.request_id = submission.request_id
        self.finished = False

    async def next(self, timeout: float | None = None) -> Any | None:
        """The next RequestOutput, or None if `timeout` seconds pass first (used for SSE keep-alives)."""
        try:
            item = await asyncio.wait_for(self._submission.outputs.get(), timeout)
        except asyncio.TimeoutError:
            return None
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def abort(self) -> None:
        """Idempotent. Frees the request's KV in the engine at the next loop iteration (before the next step)."""
        if not self.finished:
            self.finished = True
            self._bridge.abort(self.request_id)


class AsyncEngine:
    def __init__(self, load_engine: Callable[[], EngineLike], *, max_batch: int = 16, max_queue: int = 64) -> None:
        self._load_engine = load_engine
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.engine: Any = None  # read-only use outside the engine thread: model_name, context_length, tokenizer
        self.state = "loading"  # loading | ready | failed
        self.load_error: str | None = None
        self.load_seconds: float | None = None
        self._inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()
        self._in_flight = 0  # event-loop side: accepted and not yet released
        self._stats: dict[str, Any] = {"ready": 0}
        self.aborts_done = 0  # engine thread: requests whose KV was freed by abort

    # ------------------------------------------------------------------------------------------------------------------
    # Event-loop side

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="fluxion-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._inbox.put(("stop", None))
        if self._thread is not None:
            self._thread.join(timeout)

    def wait_ready(self, timeout: float) -> bool:
        """Blocking helper for tests and the CLI: True once loaded, False on failure or timeout."""
        deadline = time.monotonic() + timeout
        while self.state == "loading" and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.state == "ready"

    def stats(self) -> dict[str, Any]:
        """Latest snapshot published by the engine thread, plus the server-side queue depth."""
        snapshot = dict(self._stats)
        snapshot["in_flight"] = self._in_flight
        return snapshot

    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}-{time.time_ns() % 10**9:09d}"

    async def submit(self, prompt: str | list[int], params: Any, request_id: str) -> RequestStream:
        """Hand a request to the engine thread and wait until it is accepted.

        Raises EngineNotReadyError, QueueFullError, or whatever add_request raised (RequestError, CapacityError, ...),
        so the HTTP status is known before any response byte is sent.
        """
        if self.state != "ready":
            raise EngineNotReadyError(self.load_error or "the model is still loading")
        if self._in_flight >= self.max_batch + self.max_queue:
            raise QueueFullError(f"{self._in_flight} requests in flight (limit {self.max_batch + self.max_queue})")
        loop = asyncio.get_running_loop()
        submission = _Submission(request_id, prompt, params, loop, asyncio.Queue(), loop.create_future())
        self._in_flight += 1
        stream = RequestStream(self, submission)
        self._inbox.put(("add", submission))
        try:
            await submission.accepted
        except BaseException:
            # Rejected by the engine (nothing to free), or the client left while waiting (abort frees it).
            stream.abort()
            self._in_flight -= 1
            raise
        return stream

    def release(self, stream: RequestStream) -> None:
        """Called exactly once per accepted stream by its handler when done; aborts it if it is still running."""
        stream.abort()
        self._in_flight -= 1

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    # ------------------------------------------------------------------------------------------------------------------
    # Engine thread

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            self.engine = self._load_engine()
        except Exception as exc:  # noqa: BLE001 - reported through /health
            self.load_error = f"model failed to load: {exc}"
            self.state = "failed"
            log.error("%s\n%s", self.load_error, traceback.format_exc())
            return
        self.load_seconds = time.perf_counter() - t0
        self._live: dict[str, _Submission] = {}
        self._parked: deque[_Submission] = deque()  # accepted, waiting for engine capacity
        self._publish_stats()
        self.state = "ready"
        log.info("model ready in %.1f s", self.load_seconds)

        while True:
            busy = self.engine.has_unfinished() or bool(self._parked)
            try:
                # Idle: block until a request arrives. Busy: only pick up what is already there, then step.
                command = self._inbox.get_nowait() if busy else self._inbox.get()
            except queue.Empty:
                command = None
            while command is not None:
                if command[0] == "stop":
                    self._shutdown()
                    return
                self._handle(command)
                try:
                    command = self._inbox.get_nowait()
                except queue.Empty:
                    command = None
            self._admit_parked()
            if self.engine.has_unfinished():
                self._step()
            self._publish_stats()

    def _handle(self, command: tuple[str, Any]) -> None:
        kind, payload = command
        if kind == "add":
            self._add(payload, park_on_capacity=True)
        elif kind == "abort":
            self._abort(payload)

    def _add(self, sub: _Submission, park_on_capacity: bool) -> bool:
        try:
            self.engine.add_request(sub.prompt, sub.params, request_id=sub.request_id)
        except CapacityError as exc:
            # Full batch/KV now, but running requests will finish and free room: wait in our queue. If nothing is
            # running the request can never fit, so it is refused.
            if park_on_capacity and (self.engine.has_unfinished() or self._live):
                if sub not in self._parked:
                    self._parked.append(sub)
                self._notify_accepted(sub, None)
                return False
            self._notify_accepted(sub, exc)
            return False
        except FluxionError as exc:
            self._notify_accepted(sub, exc)
            return False
        except Exception as exc:  # noqa: BLE001 - one bad request must not stop the engine thread
            log.error("add_request failed for %s\n%s", sub.request_id, traceback.format_exc())
            self._notify_accepted(sub, EngineFailure(f"internal error while adding the request: {exc}"))
            return False
        self._live[sub.request_id] = sub
        self._notify_accepted(sub, None)
        return True

    def _admit_parked(self) -> None:
        while self._parked:
            sub = self._parked[0]
            try:
                self.engine.add_request(sub.prompt, sub.params, request_id=sub.request_id)
            except CapacityError as exc:
                if self.engine.has_unfinished() or self._live:
                    return  # still full; try again after the next step
                self._parked.popleft()
                self._deliver(sub, exc)
                continue
            except Exception as exc:  # noqa: BLE001
                self._parked.popleft()
                self._deliver(sub, exc if isinstance(exc, FluxionError) else EngineFailure(str(exc)))
                continue
            self._parked.popleft()
            self._live[sub.request_id] = sub

    def _abort(self, request_id: str) -> None:
        for sub in self._parked:
            if sub.request_id == request_id:
                self._parked.remove(sub)
                return
        if self._live.pop(request_id, None) is not None:
            try:
                self.engine.abort(request_id)
                self.aborts_done += 1
            except Exception:  # noqa: BLE001
                log.error("abort of %s failed\n%s", request_id, traceback.format_exc())

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - fail the batch, keep serving
            log.error("engine step failed; failing %d running request(s)\n%s", len(self._live), traceback.format_exc())
            failure = EngineFailure(f"internal engine error: {exc}")
            for request_id, sub in list(self._live.items()):
                self._deliver(sub, failure)
                try:
                    self.engine.abort(request_id)
                except Exception:  # noqa: BLE001
                    pass
            self._live.clear()
            return
        for out in outputs:
            sub = self._live.get(out.request_id)
            if sub is None:
                continue  # aborted by its client in the meantime
            if out.finished:
                del self._live[out.request_id]
            self._deliver(sub, out)

    def _deliver(self, sub: _Submission, item: Any) -> None:
        try:
            sub.loop.call_soon_threadsafe(sub.outputs.put_nowait, item)
        except RuntimeError:
            pass  # the event loop is closed (shutdown)

    def _notify_accepted(self, sub: _Submission, error: BaseException | None) -> None:
        try:
            sub.loop.call_soon_threadsafe(_resolve, sub.accepted, error)
        except RuntimeError:
            pass

    def _publish_stats(self) -> None:
        try:
            stats = self.engine.stats()
        except Exception:  # noqa: BLE001
            return
        # One dict assignment: readers on other threads see either the old or the new snapshot.
        self._stats = {
            "ready": 1,
            "running": getattr(stats, "running", 0),
            "waiting": getattr(stats, "waiting", 0) + len(self._parked) + self._inbox.qsize(),
            "kv_bytes_host": getattr(stats, "kv_bytes_host", 0),
            "kv_bytes_gpu": getattr(stats, "kv_bytes_gpu", 0),
            "prefix_cache_bytes": getattr(stats, "prefix_cache_bytes", 0),
            "sparse": dict(getattr(stats, "sparse", {}) or {}),
            "steps": dict(getattr(stats, "steps", {}) or {}),
            "live_requests": len(self._live),
            "aborts_done": self.aborts_done,
        }

    def _shutdown(self) -> None:
        for request_id, sub in list(self._live.items()):
            try:
                self.engine.abort(request_id)
            except Exception:  # noqa: BLE001
                pass
            self._deliver(sub, EngineFailure("the server is shutting down"))
        self._live.clear()
