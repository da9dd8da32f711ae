"""OpenAI-compatible Starlette app over the fluxion-lite Engine, and `serve(args)` for `fluxion-lite serve`.

Endpoints: POST /v1/chat/completions, POST /v1/completions (stream and non-stream), GET /v1/models, GET /health,
GET /metrics, POST /tokenize, POST /detokenize, GET /props, and the chat page at /.
Every error is a JSON object `{"error": {"message", "type", "code", "param"}}` with a 4xx/5xx status.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import time
import traceback
from dataclasses import dataclass, field
from importlib import resources
from typing import Any, AsyncIterator, Awaitable, Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from fluxion_lite.errors import CapacityError, FluxionError, RequestError
from fluxion_lite.settings import Settings

from fluxion_lite.server.async_engine import AsyncEngine, EngineFailure, EngineNotReadyError, QueueFullError, RequestStream
from fluxion_lite.server.metrics import Metrics
from fluxion_lite.server.protocol import ApiError, ChatRequest, CompletionRequest, SamplingFields, invalid, parse_chat
from fluxion_lite.server.protocol import parse_completion, parse_detokenize, parse_tokenize

log = logging.getLogger("fluxion_lite.server")

OPEN_PATHS = {"/health", "/", "/favicon.ico"}  # reachable without the API key (the page asks for the key itself)


@dataclass
class ServerConfig:
    model_id: str  # the public name in /v1/models and responses
    aliases: set[str] = field(default_factory=set)  # other names accepted in the "model" field
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    keepalive_s: float = 5.0  # SSE comment interval while a request waits (queue, long prefill)
    default_max_tokens: int | None = None  # None: the rest of the context window
    retry_after_s: int = 2
    device: str = "auto"
    dtype: str = "auto"
    max_batch: int = 16


# ----------------------------------------------------------------------------------------------------------------------
# Helpers


def error_response(error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def read_json(request: Request, limit: int) -> Any:
    """Body as JSON, refusing bodies over `limit` bytes before reading them all."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"Request body is {declared} bytes; the limit is {limit} bytes",
                       code="request_too_large")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"Request body exceeds the limit of {limit} bytes", code="request_too_large")
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        raise invalid("The request body is empty; expected a JSON object", None, code="invalid_json")
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise invalid(f"We could not parse the JSON body of your request: {exc}", None, code="invalid_json") from None


class ApiKeyMiddleware:
    """Bearer-token check for everything except OPEN_PATHS. Pure ASGI so streaming responses pass through untouched."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.api_key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        auth = headers.get(b"authorization", b"")
        scheme, _, token = auth.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.api_key):
            message = "Missing API key: send 'Authorization: Bearer <key>'" if not auth else "Incorrect API key provided"
            error = ApiError(401, message, type="authentication_error", code="invalid_api_key",
                             headers={"WWW-Authenticate": "Bearer"})
            await error_response(error)(scope, receive, send)
            return
        await self.app(scope, receive, send)


class _ClosingStreamingResponse(StreamingResponse):
    """StreamingResponse that runs `on_close` however the response ends (done, client gone, cancelled).

    Relying on the async generator's own `finally` is not enough: when the client disconnects while the generator is
    suspended at a `yield`, Starlette cancels the send and the generator is only closed later by the garbage collector.
    """

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


@dataclass
class _Generation:
    """Book-keeping for one request while it streams: text, counts, timings."""

    stream: RequestStream
    t_arrival: float
    prompt_tokens: int
    text: list[str] = field(default_factory=list)
    completion_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    attention: dict[str, Any] | None = None  # how the request attended (usage.attention), once finished
    t_first: float | None = None
    t_last: float | None = None
    closed: bool = False

    def absorb(self, out: Any) -> None:
        now = time.perf_counter()
        if out.new_token_ids and self.t_first is None:
            self.t_first = now
        if out.new_token_ids:
            self.t_last = now
        self.text.append(out.new_text)
        self.prompt_tokens = out.prompt_tokens or self.prompt_tokens
        self.completion_tokens = out.completion_tokens
        self.cached_tokens = out.cached_tokens
        if out.finished:
            self.finish_reason = out.finish_reason
            if getattr(out, "attention", ""):
                self.attention = {"mode": out.attention, "epsilon": out.epsilon,
                                  "kv_read_fraction": out.kv_read_fraction}

    def usage(self) -> dict[str, Any]:
        usage = {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                 "total_tokens": self.prompt_tokens + self.completion_tokens,
                 "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}
        if self.attention is not None:  # an extension: dense or fluxion, the request's epsilon, the plan's KV read
            usage["attention"] = self.attention
        return usage


# ----------------------------------------------------------------------------------------------------------------------
# The app


class ChatServer:
    def __init__(self, bridge: AsyncEngine, config: ServerConfig) -> None:
        self.bridge = bridge
        self.config = config
        self.metrics = Metrics()
        self._page = resources.files("fluxion_lite.server").joinpath("static/index.html").read_text("utf-8")

    # -- shared pieces ------------------------------------------------------------------------------------------------

    def _engine(self) -> Any:
        if self.bridge.state == "ready":
            return self.bridge.engine
        if self.bridge.state == "failed":
            raise ApiError(503, self.bridge.load_error or "the model failed to load", type="server_error",
                           code="model_load_failed")
        raise ApiError(503, "The model is still loading; retry shortly", type="unavailable_error",
                       code="model_loading", headers={"Retry-After": str(self.config.retry_after_s)})

    def _check_model(self, requested: str | None) -> str:
        engine = self._engine()
        known = {self.config.model_id, engine.model_name, *self.config.aliases}
        if requested is not None and requested not in known:
            raise ApiError(404, f"The model '{requested}' does not exist; this server serves '{self.config.model_id}'",
                           code="model_not_found", param="model")
        return self.config.model_id

    def _sampling_params(self, fields: SamplingFields, prompt_tokens: int) -> Any:
        from fluxion_lite.engine.sampling import SamplingParams

        context = int(self._engine().context_length)
        if prompt_tokens >= context:
            raise ApiError(400, f"This model's maximum context length is {context} tokens. However, your prompt is "
                           f"{prompt_tokens} tokens, which leaves no room for a completion. Please shorten the prompt.",
                           code="context_length_exceeded", param="messages")
        room = context - prompt_tokens
        kwargs = fields.as_kwargs()
        if fields.max_tokens is None:
            # Unspecified: up to the end of the context (OpenAI semantics), optionally capped by the server default.
            kwargs["max_tokens"] = min(room, self.config.default_max_tokens or room)
        elif prompt_tokens + fields.max_tokens > context:
            raise ApiError(400, f"This model's maximum context length is {context} tokens. However, you requested "
                           f"{prompt_tokens + fields.max_tokens} tokens ({prompt_tokens} in the prompt, "
                           f"{fields.max_tokens} in the completion). Please reduce the prompt or the completion length.",
                           code="context_length_exceeded", param="max_tokens")
        try:
            params = SamplingParams(**kwargs)
            params.validate()
        except (RequestError, ValueError, TypeError) as exc:
            raise invalid(str(exc), None) from None
        return params

    async def _submit(self, prompt_ids: list[int], params: Any, prefix: str) -> RequestStream:
        request_id = self.bridge.new_request_id(prefix)
        try:
            return await self.bridge.submit(prompt_ids, params, request_id)
        except QueueFullError as exc:
            self.metrics.rejected_queue_full += 1
            raise ApiError(503, f"The server is at capacity ({exc}); retry later", type="unavailable_error",
                           code="queue_full", headers={"Retry-After": str(self.config.retry_after_s)}) from None
        except EngineNotReadyError as exc:
            raise ApiError(503, str(exc), type="unavailable_error", code="model_loading",
                           headers={"Retry-After": str(self.config.retry_after_s)}) from None
        except RequestError as exc:
            code = "context_length_exceeded" if "context" in str(exc).lower() else "invalid_value"
            raise invalid(str(exc), None, code=code) from None
        except CapacityError as exc:
            raise ApiError(400, f"The request does not fit in this server's KV memory: {exc}",
                           code="capacity_exceeded") from None
        except FluxionError as exc:
            raise invalid(str(exc), None) from None
        except EngineFailure as exc:
            raise ApiError(500, str(exc), type="server_error", code="internal_error") from None

    def _finish(self, gen: _Generation) -> None:
        """Release the request (aborting it if unfinished) and record its metrics. Idempotent."""
        if gen.closed:
            return
        gen.closed = True
        self.bridge.release(gen.stream)
        if gen.finish_reason is None:
            self.metrics.record_aborted(prompt_tokens=gen.prompt_tokens, completion_tokens=gen.completion_tokens)
            return
        now = time.perf_counter()
        self.metrics.record_finished(
            prompt_tokens=gen.prompt_tokens, completion_tokens=gen.completion_tokens, cached_tokens=gen.cached_tokens,
            finish_reason=gen.finish_reason,
            ttft_s=None if gen.t_first is None else gen.t_first - gen.t_arrival,
            decode_s=0.0 if gen.t_first is None or gen.t_last is None else gen.t_last - gen.t_first,
            e2e_s=now - gen.t_arrival)

    async def _collect(self, request: Request, gen: _Generation) -> None:
        """Non-streaming: run to completion, returning early (so _finish aborts it) if the client disconnects.

        The watcher must really await receive(): uvicorn stops reading the socket once the body is in and only
        resumes inside receive(), so a non-blocking is_disconnected() poll never sees the client leave.
        """

        async def run() -> None:
            while True:
                out = await gen.stream.next()
                gen.absorb(out)
                if out.finished:
                    return

        async def client_gone() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        tasks = [asyncio.ensure_future(run()), asyncio.ensure_future(client_gone())]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if tasks[0] in done:
            tasks[0].result()  # re-raise an engine failure

    def _streaming(self, gen: _Generation, first: dict[str, Any] | None,
                   chunk: Callable[[str | None, str | None], dict[str, Any]],
                   usage_chunk: Callable[[], dict[str, Any]] | None) -> Response:
        keepalive = self.config.keepalive_s

        async def events() -> AsyncIterator[str]:
            try:
                if first is not None:
                    yield _sse(first)
                while True:
                    out = await gen.stream.next(timeout=keepalive)
                    if out is None:
                        yield ": keep-alive\n\n"  # SSE comment: keeps proxies and clients from timing out
                        continue
                    gen.absorb(out)
                    if out.new_text:
                        yield _sse(chunk(out.new_text, None))
                    if out.finished:
                        yield _sse(chunk(None, out.finish_reason))
                        if usage_chunk is not None:
                            yield _sse(usage_chunk())
                        yield "data: [DONE]\n\n"
                        return
            except (asyncio.CancelledError, GeneratorExit):
                raise
            except Exception as exc:  # noqa: BLE001 - headers are sent: report in-band, end the stream cleanly
                log.error("stream %s failed\n%s", gen.stream.request_id, traceback.format_exc())
                yield _sse({"error": {"message": str(exc), "type": "server_error", "code": "internal_error",
                                      "param": None}})
                yield "data: [DONE]\n\n"

        return _ClosingStreamingResponse(events(), on_close=lambda: self._finish(gen))

    # -- endpoints ----------------------------------------------------------------------------------------------------

    async def chat_completions(self, request: Request) -> Response:
        t_arrival = time.perf_counter()
        body = await read_json(request, self.config.max_body_bytes)
        chat: ChatRequest = parse_chat(body)
        model_id = self._check_model(chat.model)
        tokenizer = self._engine().tokenizer
        text = tokenizer.apply_chat_template([{"role": m.role, "content": m.content} for m in chat.messages],
                                             add_generation_prompt=True)
        prompt_ids = list(tokenizer.encode(text, add_special=True))
        params = self._sampling_params(chat.sampling, len(prompt_ids))
        stream = await self._submit(prompt_ids, params, "chatcmpl")
        gen = _Generation(stream, t_arrival, len(prompt_ids))
        created = int(time.time())
        rid = stream.request_id

        if not chat.stream:
            try:
                await self._collect(request, gen)
            finally:
                self._finish(gen)
            return JSONResponse({
                "id": rid, "object": "chat.completion", "created": created, "model": model_id,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(gen.text)},
                             "logprobs": None, "finish_reason": gen.finish_reason}],
                "usage": gen.usage(), "system_fingerprint": None,
            })

        def chunk(content: str | None, finish: str | None) -> dict[str, Any]:
            delta = {} if content is None else {"content": content}
            return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model_id,
                    "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}

        first = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model_id,
                 "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}]}
        usage = (lambda: {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model_id,
                          "choices": [], "usage": gen.usage()}) if chat.include_usage else None
        return self._streaming(gen, first, chunk, usage)

    async def completions(self, request: Request) -> Response:
        t_arrival = time.perf_counter()
        body = await read_json(request, self.config.max_body_bytes)
        req: CompletionRequest = parse_completion(body)
        model_id = self._check_model(req.model)
        engine = self._engine()
        if isinstance(req.prompt, str):
            prompt_ids = list(engine.tokenizer.encode(req.prompt, add_special=True))
        else:
            vocab = _vocab_size(engine)
            bad = [t for t in req.prompt if not 0 <= t < vocab]
            if bad:
                raise invalid(f"'prompt' token id {bad[0]} is outside the vocabulary [0, {vocab})", "prompt")
            prompt_ids = req.prompt
        params = self._sampling_params(req.sampling, len(prompt_ids))
        stream = await self._submit(prompt_ids, params, "cmpl")
        gen = _Generation(stream, t_arrival, len(prompt_ids))
        created = int(time.time())
        rid = stream.request_id

        if not req.stream:
            try:
                await self._collect(request, gen)
            finally:
                self._finish(gen)
            return JSONResponse({
                "id": rid, "object": "text_completion", "created": created, "model": model_id,
                "choices": [{"index": 0, "text": "".join(gen.text), "logprobs": None,
                             "finish_reason": gen.finish_reason}],
                "usage": gen.usage(), "system_fingerprint": None,
            })

        def chunk(text: str | None, finish: str | None) -> dict[str, Any]:
            return {"id": rid, "object": "text_completion", "created": created, "model": model_id,
                    "choices": [{"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}]}

        usage = (lambda: {"id": rid, "object": "text_completion", "created": created, "model": model_id,
                          "choices": [], "usage": gen.usage()}) if req.include_usage else None
        return self._streaming(gen, None, chunk, usage)

    async def models(self, request: Request) -> Response:
        engine = self._engine()
        return JSONResponse({"object": "list", "data": [{
            "id": self.config.model_id, "object": "model", "created": 0, "owned_by": "fluxion-lite",
            "max_model_len": int(engine.context_length), "root": engine.model_name,
        }]})

    async def health(self, request: Request) -> Response:
        state = self.bridge.state
        if state == "ready":
            return JSONResponse({"status": "ok"})
        body: dict[str, Any] = {"status": state}
        if state == "failed":
            body["error"] = self.bridge.load_error
        return JSONResponse(body, status_code=503, headers={"Retry-After": str(self.config.retry_after_s)})

    async def metrics_endpoint(self, request: Request) -> Response:
        return PlainTextResponse(self.metrics.render(self.bridge.stats()),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    async def tokenize(self, request: Request) -> Response:
        content, add_special = parse_tokenize(await read_json(request, self.config.max_body_bytes))
        tokens = list(self._engine().tokenizer.encode(content, add_special=add_special))
        return JSONResponse({"tokens": tokens, "count": len(tokens)})

    async def detokenize(self, request: Request) -> Response:
        engine = self._engine()
        tokens = parse_detokenize(await read_json(request, self.config.max_body_bytes), _vocab_size(engine))
        return JSONResponse({"content": engine.tokenizer.decode(tokens)})

    async def props(self, request: Request) -> Response:
        engine = self._engine()
        return JSONResponse({
            "model": self.config.model_id, "model_name": engine.model_name,
            "context_length": int(engine.context_length), "attention_mode": engine.attention_mode,
            "device": self.config.device, "dtype": self.config.dtype, "max_batch": self.config.max_batch,
            "max_queue": self.bridge.max_queue, "api_key_required": self.config.api_key is not None,
            "load_seconds": self.bridge.load_seconds, "plan_origin": getattr(engine, "plan_origin", None),
            "auto_dense_tokens": getattr(engine, "auto_dense_tokens", None),
        })

    async def page(self, request: Request) -> Response:
        return HTMLResponse(self._page)


def _vocab_size(engine: Any) -> int:
    tokenizer = engine.tokenizer
    for name in ("vocab_size", "n_vocab"):
        value = getattr(tokenizer, name, None)
        if callable(value):
            value = value()
        if isinstance(value, int):
            return value
    return int(getattr(getattr(engine, "config", None), "vocab_size", 1 << 31))


def _endpoint(server: ChatServer, name: str,
              handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    """Turns ApiError into its JSON response, any other exception into a 500, and counts requests by status."""

    async def wrapped(request: Request) -> Response:
        try:
            response = await handler(request)
        except ApiError as exc:
            response = error_response(exc)
        except Exception as exc:  # noqa: BLE001 - one failing request must not take the server down
            log.error("%s failed\n%s", name, traceback.format_exc())
            response = error_response(ApiError(500, f"Internal server error: {type(exc).__name__}: {exc}",
                                               type="server_error", code="internal_error"))
        server.metrics.count_request(name, response.status_code)
        return response

    return wrapped


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    error = ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                     type="invalid_request_error", code=kind)
    return error_response(error)


def create_app(bridge: AsyncEngine, config: ServerConfig, *, manage_engine: bool = True) -> Starlette:
    """The ASGI app. With `manage_engine`, the app's lifespan starts the engine thread (loading the model in the
    background so /health answers 503 meanwhile) and stops it on shutdown."""
    server = ChatServer(bridge, config)
    routes = [
        Route("/", _endpoint(server, "/", server.page), methods=["GET"]),
        Route("/health", _endpoint(server, "/health", server.health), methods=["GET"]),
        Route("/metrics", _endpoint(server, "/metrics", server.metrics_endpoint), methods=["GET"]),
        Route("/props", _endpoint(server, "/props", server.props), methods=["GET"]),
        Route("/tokenize", _endpoint(server, "/tokenize", server.tokenize), methods=["POST"]),
        Route("/detokenize", _endpoint(server, "/detokenize", server.detokenize), methods=["POST"]),
        Route("/v1/models", _endpoint(server, "/v1/models", server.models), methods=["GET"]),
        Route("/v1/chat/completions", _endpoint(server, "/v1/chat/completions", server.chat_completions),
              methods=["POST"]),
        Route("/v1/completions", _endpoint(server, "/v1/completions", server.completions), methods=["POST"]),
    ]

    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if manage_engine:
            bridge.start()
        try:
            yield
        finally:
            if manage_engine:
                await asyncio.get_running_loop().run_in_executor(None, bridge.stop)

    app = Starlette(routes=routes, exception_handlers={HTTPException: _http_error}, lifespan=lifespan)
    app.state.server = server
    if config.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key)
    return app


# ----------------------------------------------------------------------------------------------------------------------
# CLI entry point


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def build_engine_loader(args: Any, settings: Settings | None = None) -> Callable[[], Any]:
    """The server's engine, made in the background: args' model options, and settings (None: args.settings, else
    Settings.load() when the engine is built)."""
    model = getattr(args, "model", None) or "smollm2-135m"
    settings = settings if settings is not None else getattr(args, "settings", None)

    def load() -> Any:
        from fluxion_lite.engine.engine import Engine

        threads = getattr(args, "threads", None)
        if threads:
            # torch's intra-op pool is process-wide. On a small, shared CPU fewer threads than cores can be much
            # faster: OpenMP barriers stall whenever one of its threads is descheduled.
            import torch

            torch.set_num_threads(int(threads))

        kwargs: dict[str, Any] = {
            "device": getattr(args, "device", None) or "auto",
            "dtype": getattr(args, "dtype", None) or "auto",
            "attention": getattr(args, "attention", None) or "auto",
            "max_batch": getattr(args, "max_batch", None) or 16,
            "max_context": getattr(args, "max_context", None),
            "predictor": bool(getattr(args, "predictor", False)),
        }
        prefill_chunk = getattr(args, "prefill_chunk", None)
        if prefill_chunk:
            kwargs["prefill_chunk"] = prefill_chunk
        return Engine(model, settings=settings, **kwargs)

    return load


def server_settings(args: Any) -> Settings:
    """args.settings (the CLI's), else the environment with --api-key over FLUXION_API_KEY."""
    settings = getattr(args, "settings", None)
    if settings is None:
        api_key_flag = getattr(args, "api_key", None)
        settings = Settings.load(flags={"api_key": api_key_flag} if api_key_flag else None)
    return settings


def model_id_of(model: str) -> str:
    """The public name of a served model: a catalog name as is, a .gguf path by its file name without the suffix."""
    return os.path.basename(model)[: -len(".gguf")] if model.endswith(".gguf") else model


def build_server(args: Any, settings: Settings, *, api_key: str | None) -> tuple[Starlette, AsyncEngine, ServerConfig]:
    """One server's app over its own engine (loaded in the background once the bridge starts): what `serve` runs
    under uvicorn, and what each replica of `serve --replicas N` runs behind the cluster's ingress."""
    from fluxion_lite.engine.weights import resolve_device  # torch: imported when a server is built, not with the module

    model = getattr(args, "model", None) or "smollm2-135m"
    max_batch = int(getattr(args, "max_batch", None) or 16)
    config = ServerConfig(
        model_id=model_id_of(model), aliases={model}, api_key=api_key,
        max_body_bytes=int(getattr(args, "max_body_bytes", None) or 1 << 20),
        default_max_tokens=getattr(args, "default_max_tokens", None),
        device=resolve_device(getattr(args, "device", None) or "auto"), dtype=getattr(args, "dtype", None) or "auto",
        max_batch=max_batch,
    )
    bridge = AsyncEngine(build_engine_loader(args, settings), max_batch=max_batch,
                         max_queue=int(getattr(args, "max_queue", None) or 64))
    return create_app(bridge, config), bridge, config


def serve(args: Any) -> int:
    """`fluxion-lite serve`: uvicorn on host:port (127.0.0.1:8080 by default), model loaded in the background."""
    import uvicorn

    settings = server_settings(args)
    host = getattr(args, "host", None) or "127.0.0.1"
    port = int(getattr(args, "port", None) or 8080)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not is_loopback(host) and not settings.api_key:
        log.warning("binding to %s without --api-key: anyone who can reach this address can use the model", host)
    app, _, config = build_server(args, settings, api_key=settings.api_key)
    log.info("serving %s on http://%s:%d (loading the model in the background)", config.model_id, host, port)
    uvicorn.run(app, host=host, port=port, log_level=getattr(args, "log_level", None) or "info",
                timeout_graceful_shutdown=5)
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m fluxion_lite.server.app`: the same as `fluxion-lite serve`, for use before/without the CLI."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m fluxion_lite.server.app")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--attention", default="auto")
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--max-queue", type=int, default=64)
    parser.add_argument("--max-context", type=int, default=None)
    parser.add_argument("--prefill-chunk", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--default-max-tokens", type=int, default=None)
    parser.add_argument("--log-level", default="info")
    return serve(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
