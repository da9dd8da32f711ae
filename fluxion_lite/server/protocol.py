"""OpenAI-compatible request parsing and validation.

Everything here is pure: a decoded JSON body goes in, a typed request (or an `ApiError` naming the offending field)
comes out. Nothing touches the engine, so every rule can be tested without a model.

Field policy (mirrors the OpenAI API where it matters):
- supported fields are type- and range-checked; a wrong type is a 400 naming the field;
- OpenAI fields we accept but cannot honour (n > 1, logprobs, tools, logit_bias, ...) are rejected when set to a value
  that would change the result, rather than being silently ignored;
- harmless bookkeeping fields (user, metadata, store, ...) are accepted and ignored;
- anything else is an unknown field -> 400, like OpenAI's "Unrecognized request argument supplied".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


class ApiError(Exception):
    """An error that becomes the HTTP response `{"error": {"message", "type", "code", "param"}}`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "code": self.code, "param": self.param}}


def invalid(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, code=code, param=param)


# ----------------------------------------------------------------------------------------------------------------------
# Typed requests


@dataclass
class SamplingFields:
    """Sampling knobs as sent by the client; None means "use the engine default"."""

    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    epsilon: float | None = None  # fluxion's error bound for this request (an extension; SamplingParams.epsilon)

    def as_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `SamplingParams`, leaving out what the client did not set."""
        kwargs: dict[str, Any] = {"stop": list(self.stop), "ignore_eos": self.ignore_eos}
        for name in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty", "seed", "epsilon"):
            value = getattr(self, name)
            if value is not None:
                kwargs[name] = value
        return kwargs


@dataclass
class ChatMessage:
    role: str
    content: str


@dataclass
class ChatRequest:
    model: str | None
    messages: list[ChatMessage]
    sampling: SamplingFields
    stream: bool = False
    include_usage: bool = False


@dataclass
class CompletionRequest:
    model: str | None
    prompt: str | list[int]
    sampling: SamplingFields
    stream: bool = False
    include_usage: bool = False


# ----------------------------------------------------------------------------------------------------------------------
# Field readers: each returns the value or raises ApiError naming the field.


def _type_name(value: Any) -> str:
    return "null" if value is None else {bool: "boolean", int: "integer", float: "number", str: "string",
                                          list: "array", dict: "object"}.get(type(value), type(value).__name__)


def _wrong_type(name: str, expected: str, value: Any) -> ApiError:
    return invalid(f"'{name}' must be {expected}, got {_type_name(value)}", name, code="invalid_type")


def _opt_int(body: dict[str, Any], name: str, lo: int | None = None, hi: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    # bool is an int subclass in Python; JSON true is not a number.
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise _wrong_type(name, "an integer", value)
    if lo is not None and value < lo:
        raise invalid(f"'{name}' must be >= {lo}, got {value}", name)
    if hi is not None and value > hi:
        raise invalid(f"'{name}' must be <= {hi}, got {value}", name)
    return value


def _opt_float(body: dict[str, Any], name: str, lo: float | None = None, hi: float | None = None) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _wrong_type(name, "a number", value)
    value = float(value)
    if not math.isfinite(value):
        raise invalid(f"'{name}' must be a finite number", name)
    if lo is not None and value < lo:
        raise invalid(f"'{name}' must be >= {lo:g}, got {value:g}", name)
    if hi is not None and value > hi:
        raise invalid(f"'{name}' must be <= {hi:g}, got {value:g}", name)
    return value


def _opt_bool(body: dict[str, Any], name: str) -> bool | None:
    value = body.get(name)
    if value is None or isinstance(value, bool):
        return value
    raise _wrong_type(name, "a boolean", value)


def _stop(body: dict[str, Any]) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise _wrong_type("stop", "a string or an array of strings", value)
    if len(value) > 16:
        raise invalid(f"'stop' may hold at most 16 strings, got {len(value)}", "stop")
    if any(s == "" for s in value):
        raise invalid("'stop' strings must not be empty", "stop")
    return list(value)


def _model(body: dict[str, Any]) -> str | None:
    value = body.get("model")
    if value is not None and not isinstance(value, str):
        raise _wrong_type("model", "a string", value)
    return value


def _stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = bool(_opt_bool(body, "stream"))
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict):
        raise _wrong_type("stream_options", "an object", options)
    unknown = set(options) - {"include_usage", "continuous_usage_stats"}
    if unknown:
        raise invalid(f"Unrecognized field in 'stream_options': {sorted(unknown)[0]}", "stream_options",
                      code="unknown_parameter")
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise _wrong_type("stream_options.include_usage", "a boolean", include_usage)
    if not stream:
        raise invalid("'stream_options' is only allowed when 'stream' is true", "stream_options")
    return stream, include_usage


def _sampling(body: dict[str, Any], max_tokens_field: str = "max_tokens") -> SamplingFields:
    max_tokens = _opt_int(body, "max_tokens", lo=1)
    if "max_completion_tokens" in body and max_tokens_field == "max_tokens":
        mct = _opt_int(body, "max_completion_tokens", lo=1)
        if max_tokens is not None and mct is not None and mct != max_tokens:
            raise invalid("'max_tokens' and 'max_completion_tokens' disagree; send one of them",
                          "max_completion_tokens")
        max_tokens = mct if mct is not None else max_tokens
    ignore_eos = _opt_bool(body, "ignore_eos")
    epsilon = _opt_float(body, "epsilon", lo=0.0, hi=100.0)
    if epsilon == 0.0:
        raise invalid("'epsilon' must be > 0 (smaller reads more of the KV; full attention is mode full)", "epsilon")
    return SamplingFields(
        max_tokens=max_tokens,
        temperature=_opt_float(body, "temperature", lo=0.0, hi=2.0),
        top_p=_opt_float(body, "top_p", lo=0.0, hi=1.0),
        top_k=_opt_int(body, "top_k", lo=0),
        min_p=_opt_float(body, "min_p", lo=0.0, hi=1.0),
        repetition_penalty=_opt_float(body, "repetition_penalty", lo=0.0),
        presence_penalty=_opt_float(body, "presence_penalty", lo=-2.0, hi=2.0),
        frequency_penalty=_opt_float(body, "frequency_penalty", lo=-2.0, hi=2.0),
        seed=_opt_int(body, "seed"),
        stop=_stop(body),
        ignore_eos=bool(ignore_eos),
        epsilon=epsilon,
    )


# Fields shared by both endpoints that we check and honour.
_SAMPLING_FIELDS = {"max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                    "frequency_penalty", "seed", "stop", "ignore_eos", "stream", "stream_options", "model", "epsilon"}
# Accepted and ignored: they do not change what is generated.
_IGNORED_FIELDS = {"user", "metadata", "store", "service_tier", "parallel_tool_calls", "prompt_cache_key",
                   "safety_identifier"}


def _check_unknown(body: dict[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(body) - allowed - _SAMPLING_FIELDS - _IGNORED_FIELDS)
    if unknown:
        raise invalid(f"Unrecognized request argument supplied: {unknown[0]}", unknown[0], code="unknown_parameter")


def _reject_unless_default(body: dict[str, Any], name: str, allowed: tuple[Any, ...], why: str) -> None:
    """OpenAI fields we cannot honour: fine at their no-op value, a 400 otherwise (never silently ignored)."""
    if name in body and body[name] not in allowed:
        raise invalid(f"'{name}' is not supported by this server ({why})", name, code="unsupported_parameter")


def _common_unsupported(body: dict[str, Any]) -> None:
    _reject_unless_default(body, "n", (None, 1), "only n=1")
    _reject_unless_default(body, "logit_bias", (None, {}), "logit_bias is not implemented")


def _message_content(index: int, content: Any) -> str:
    name = f"messages[{index}].content"
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise invalid(f"'{name}[{j}]' must be {{\"type\": \"text\", \"text\": string}}; only text parts are "
                              "supported", name, code="invalid_type")
            parts.append(part["text"])
        return "".join(parts)
    raise _wrong_type(name, "a string or an array of text parts", content)


_ROLES = ("system", "developer", "user", "assistant")


def parse_chat(body: Any) -> ChatRequest:
    if not isinstance(body, dict):
        raise invalid("The request body must be a JSON object", None, code="invalid_type")
    _check_unknown(body, {"messages", "max_completion_tokens", "n", "logprobs", "top_logprobs", "logit_bias", "tools",
                          "tool_choice", "response_format", "functions", "function_call", "modalities"})
    _common_unsupported(body)
    _reject_unless_default(body, "logprobs", (None, False), "logprobs are not returned")
    _reject_unless_default(body, "top_logprobs", (None, 0), "logprobs are not returned")
    _reject_unless_default(body, "tools", (None, []), "no tool calling")
    _reject_unless_default(body, "functions", (None, []), "no tool calling")
    _reject_unless_default(body, "tool_choice", (None, "none", "auto"), "no tool calling")
    _reject_unless_default(body, "function_call", (None, "none", "auto"), "no tool calling")
    _reject_unless_default(body, "response_format", (None, {"type": "text"}), "only plain text output")
    _reject_unless_default(body, "modalities", (None, ["text"]), "only text output")

    if "messages" not in body:
        raise invalid("Missing required parameter: 'messages'", "messages", code="missing_required_parameter")
    raw = body["messages"]
    if not isinstance(raw, list):
        raise _wrong_type("messages", "an array", raw)
    if not raw:
        raise invalid("'messages' must contain at least one message", "messages", code="empty_messages")
    messages: list[ChatMessage] = []
    for i, message in enumerate(raw):
        if not isinstance(message, dict):
            raise _wrong_type(f"messages[{i}]", "an object", message)
        role = message.get("role")
        if role not in _ROLES:
            raise invalid(f"'messages[{i}].role' must be one of {', '.join(_ROLES)}; got {role!r}",
                          f"messages[{i}].role")
        unknown = set(message) - {"role", "content", "name"}
        if unknown:
            raise invalid(f"Unrecognized field in 'messages[{i}]': {sorted(unknown)[0]}", f"messages[{i}]",
                          code="unknown_parameter")
        if "content" not in message or message["content"] is None:
            raise invalid(f"'messages[{i}].content' is required", f"messages[{i}].content",
                          code="missing_required_parameter")
        messages.append(ChatMessage(role="system" if role == "developer" else role,
                                    content=_message_content(i, message["content"])))

    stream, include_usage = _stream_flags(body)
    return ChatRequest(model=_model(body), messages=messages, sampling=_sampling(body), stream=stream,
                       include_usage=include_usage)


def parse_completion(body: Any) -> CompletionRequest:
    if not isinstance(body, dict):
        raise invalid("The request body must be a JSON object", None, code="invalid_type")
    _check_unknown(body, {"prompt", "n", "best_of", "echo", "logprobs", "suffix", "logit_bias"})
    _common_unsupported(body)
    _reject_unless_default(body, "best_of", (None, 1), "only best_of=1")
    _reject_unless_default(body, "echo", (None, False), "echo is not implemented")
    _reject_unless_default(body, "logprobs", (None, 0), "logprobs are not returned")
    _reject_unless_default(body, "suffix", (None, ""), "no fill-in-the-middle")

    if "prompt" not in body:
        raise invalid("Missing required parameter: 'prompt'", "prompt", code="missing_required_parameter")
    raw = body["prompt"]
    # OpenAI accepts a batch of prompts; we accept a batch of exactly one (n=1 semantics).
    if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], (str, list)):
        raw = raw[0]
    prompt: str | list[int]
    if isinstance(raw, str):
        prompt = raw
    elif isinstance(raw, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in raw):
        prompt = list(raw)
    elif isinstance(raw, list) and raw and all(isinstance(p, (str, list)) for p in raw):
        raise invalid("Only one prompt per request is supported", "prompt", code="unsupported_parameter")
    else:
        raise _wrong_type("prompt", "a string or an array of token ids", raw)
    if len(prompt) == 0:
        raise invalid("'prompt' must not be empty", "prompt", code="empty_prompt")

    stream, include_usage = _stream_flags(body)
    return CompletionRequest(model=_model(body), prompt=prompt, sampling=_sampling(body), stream=stream,
                             include_usage=include_usage)


def parse_tokenize(body: Any) -> tuple[str, bool]:
    """`{"content": str, "add_special": bool = true}` -> (text, add_special)."""
    if not isinstance(body, dict):
        raise invalid("The request body must be a JSON object", None, code="invalid_type")
    unknown = sorted(set(body) - {"content", "add_special", "model"})
    if unknown:
        raise invalid(f"Unrecognized request argument supplied: {unknown[0]}", unknown[0], code="unknown_parameter")
    if "content" not in body:
        raise invalid("Missing required parameter: 'content'", "content", code="missing_required_parameter")
    content = body["content"]
    if not isinstance(content, str):
        raise _wrong_type("content", "a string", content)
    add_special = _opt_bool(body, "add_special")
    return content, True if add_special is None else add_special


def parse_detokenize(body: Any, vocab_size: int) -> list[int]:
    """`{"tokens": [int, ...]}` -> token ids, each checked against the vocabulary."""
    if not isinstance(body, dict):
        raise invalid("The request body must be a JSON object", None, code="invalid_type")
    unknown = sorted(set(body) - {"tokens", "model"})
    if unknown:
        raise invalid(f"Unrecognized request argument supplied: {unknown[0]}", unknown[0], code="unknown_parameter")
    if "tokens" not in body:
        raise invalid("Missing required parameter: 'tokens'", "tokens", code="missing_required_parameter")
    tokens = body["tokens"]
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise _wrong_type("tokens", "an array of integers", tokens)
    for i, t in enumerate(tokens):
        if not 0 <= t < vocab_size:
            raise invalid(f"'tokens[{i}]' = {t} is outside the vocabulary [0, {vocab_size})", f"tokens[{i}]")
    return tokens
