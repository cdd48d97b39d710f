"""OpenAI wire format: request validation and response/error shapes.

Validation is written out by hand rather than left to pydantic so that every rejection is a
400 in OpenAI's error shape that names the offending field (``param``), and so that JSON types
are taken strictly: ``true`` is not a number, ``"5"`` is not an integer, NaN is not a float.

The request parsers return plain dataclasses (``ChatRequest``, ``CompletionRequest``) whose
``settings`` dict holds keyword arguments for ``trapetum.api.GenerationSettings``; the server
never passes a field the engine does not know.
"""
from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from .._version import __version__
from ..jsondepth import MAX_DEPTH, nesting_depth

SYSTEM_FINGERPRINT = f"trapetum-{__version__}"
MAX_STOP = 4


class APIError(Exception):
    """An error answered to the client as ``{"error": {...}}`` with ``status``."""

    def __init__(self, status: int, message: str, *, type: str | None = None, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _default_type(status)
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)

    def content(self) -> bytes:
        """The JSON body as bytes; ASCII-escaped, so that no message text can fail to encode."""
        return json.dumps(self.body(), ensure_ascii=True, separators=(",", ":")).encode("ascii")


def _default_type(status: int) -> str:
    return {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
            404: "invalid_request_error", 405: "invalid_request_error", 408: "invalid_request_error",
            413: "invalid_request_error", 415: "invalid_request_error",
            422: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable"}.get(
                status, "server_error")


def error_body(message: str, *, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def invalid(param: str, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


# ----------------------------------------------------------------------------- JSON field readers

def parse_json_body(raw: bytes) -> dict:
    if not raw.strip():
        raise APIError(400, "The request body is empty; expected a JSON object.", code="invalid_json")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise APIError(400, "The request body is not valid UTF-8.", code="invalid_json") from None
    if nesting_depth(text) > MAX_DEPTH:
        raise APIError(400, f"The JSON body is nested too deeply (more than {MAX_DEPTH} levels).",
                       code="invalid_json")
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except (json.JSONDecodeError, ValueError) as e:
        raise APIError(400, f"We could not parse the JSON body of your request ({e}).",
                       code="invalid_json") from None
    if not isinstance(obj, dict):
        raise APIError(400, f"The request body must be a JSON object, not {_jtype(obj)}.", code="invalid_json")
    where = _surrogate_at(obj, "")
    if where is not None:       # anywhere: a field we echo (model, user) would fail to encode in the reply
        raise invalid(where, f"Invalid value for '{where}': the text holds an unpaired UTF-16 surrogate "
                      "escape; it is not valid Unicode.")
    return obj


def _bad_text(s: str) -> bool:
    try:
        s.encode("utf-8")
        return False
    except UnicodeEncodeError:
        return True


def _surrogate_at(x: Any, path: str) -> str | None:
    """The JSON path of the first string (or key) holding a lone surrogate, or None (depth is bounded by
    MAX_DEPTH, checked before parsing)."""
    if isinstance(x, str):
        return path if _bad_text(x) else None
    if isinstance(x, dict):
        for k, v in x.items():
            p = f"{path}.{k}" if path else k
            if _bad_text(k):
                return path or "body"        # the key itself cannot be shown
            found = _surrogate_at(v, p)
            if found is not None:
                return found
    elif isinstance(x, list):
        for i, v in enumerate(x):
            found = _surrogate_at(v, f"{path}[{i}]")
            if found is not None:
                return found
    return None


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _jtype(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, int):
        return "an integer"
    if isinstance(v, float):
        return "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "an array"
    if isinstance(v, dict):
        return "an object"
    return type(v).__name__


def _type_error(name: str, want: str, v: Any) -> APIError:
    return invalid(name, f"Invalid type for '{name}': expected {want}, but got {_jtype(v)}.", "invalid_type")


def get_int(body: dict, name: str, *, lo: int | None = None, hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _type_error(name, "an integer", v)
    if isinstance(v, float):
        if not math.isfinite(v) or v != int(v):
            raise _type_error(name, "an integer", v)
        v = int(v)
    _check_range(name, v, lo, hi)
    return v


def get_float(body: dict, name: str, *, lo: float | None = None, hi: float | None = None,
              lo_open: bool = False) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _type_error(name, "a number", v)
    try:
        v = float(v)
    except OverflowError:       # an integer literal past the float range (JSON allows 10**400)
        v = math.inf
    if not math.isfinite(v):
        raise invalid(name, f"Invalid value for '{name}': must be a finite number.")
    if lo_open and lo is not None and v <= lo:
        raise invalid(name, f"Invalid value for '{name}': {v} is not greater than {lo}.")
    _check_range(name, v, None if lo_open else lo, hi)
    return v


def _check_range(name: str, v, lo, hi) -> None:
    if lo is not None and v < lo:
        raise invalid(name, f"Invalid value for '{name}': {v} is less than the minimum of {lo}.")
    if hi is not None and v > hi:
        raise invalid(name, f"Invalid value for '{name}': {v} is greater than the maximum of {hi}.")


def get_bool(body: dict, name: str) -> bool | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, bool):
        raise _type_error(name, "a boolean", v)
    return v


def get_str(body: dict, name: str) -> str | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, str):
        raise _type_error(name, "a string", v)
    return v


def text_ok(name: str, s: str) -> str:
    """JSON may carry lone UTF-16 surrogates ("\\ud800"); no tokenizer can encode them."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise invalid(name, f"Invalid value for '{name}': the text holds an unpaired UTF-16 surrogate "
                      "escape; it is not valid Unicode.") from None
    return s


def get_stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise _type_error("stop", "a string or an array of strings", v)
    if len(v) > MAX_STOP:
        raise invalid("stop", f"Invalid value for 'stop': at most {MAX_STOP} sequences, got {len(v)}.")
    if any(s == "" for s in v):
        raise invalid("stop", "Invalid value for 'stop': stop sequences must not be empty.")
    return [text_ok("stop", s) for s in v]


# ----------------------------------------------------------------------------- requests

@dataclass
class GenRequest:
    model: str | None
    stream: bool
    include_usage: bool
    max_tokens: int | None          # None: the rest of the context
    settings: dict = field(default_factory=dict)   # GenerationSettings kwargs except max_new_tokens


@dataclass
class ChatRequest(GenRequest):
    messages: list[dict] = field(default_factory=list)


@dataclass
class CompletionRequest(GenRequest):
    prompt: str | list[int] = ""


_UNSUPPORTED_TRUTHY = {
    "logprobs": "log probabilities are not supported by this server",
    "top_logprobs": "log probabilities are not supported by this server",
    "tools": "tool calls are not supported by this server",
    "functions": "function calls are not supported by this server",
    "tool_choice": "tool calls are not supported by this server",
    "function_call": "function calls are not supported by this server",
    "logit_bias": "'logit_bias' is not supported by this server",
    "suffix": "'suffix' is not supported by this server",
    "audio": "audio output is not supported by this server",
    "prediction": "predicted outputs are not supported by this server",
}


def _common(body: dict, default_max_tokens: int | None) -> dict:
    """Fields shared by both endpoints; returns GenRequest kwargs."""
    model = get_str(body, "model")
    for name, why in _UNSUPPORTED_TRUTHY.items():
        v = body.get(name)
        if v not in (None, False, 0, [], {}, "", "none", "auto"):
            raise invalid(name, f"Unsupported parameter '{name}': {why}.", "unsupported_parameter")
    n = get_int(body, "n", lo=1, hi=128)
    if n is not None and n != 1:
        raise invalid("n", f"Invalid value for 'n': this server generates one choice per request (n = 1); "
                      f"got n = {n}. Send {n} requests instead.", "unsupported_value")
    best_of = get_int(body, "best_of", lo=1, hi=20)
    if best_of is not None and best_of != 1:
        raise invalid("best_of", "Invalid value for 'best_of': only 1 is supported.", "unsupported_value")
    for name in ("presence_penalty", "frequency_penalty"):
        v = get_float(body, name, lo=-2.0, hi=2.0)
        if v not in (None, 0.0):
            raise invalid(name, f"Unsupported value for '{name}': only 0 is supported; use "
                          "'repetition_penalty' instead.", "unsupported_value")
    fmt = body.get("response_format")
    if fmt is not None:
        if not isinstance(fmt, dict):
            raise _type_error("response_format", "an object", fmt)
        if fmt.get("type", "text") != "text":
            raise invalid("response_format", "Unsupported 'response_format': only {\"type\": \"text\"}.",
                          "unsupported_value")
    stream = bool(get_bool(body, "stream"))
    include_usage = False
    so = body.get("stream_options")
    if so is not None:
        if not isinstance(so, dict):
            raise _type_error("stream_options", "an object", so)
        if not stream:
            raise invalid("stream_options", "'stream_options' is only allowed when 'stream' is true.")
        iu = so.get("include_usage")
        if iu is not None and not isinstance(iu, bool):
            raise _type_error("stream_options.include_usage", "a boolean", iu)
        include_usage = bool(iu)

    max_tokens = get_int(body, "max_tokens", lo=1)
    mct = get_int(body, "max_completion_tokens", lo=1)
    if max_tokens is not None and mct is not None and max_tokens != mct:
        raise invalid("max_completion_tokens", "Set 'max_tokens' or 'max_completion_tokens', not both "
                      f"with different values ({max_tokens} and {mct}).")
    max_tokens = mct if mct is not None else max_tokens
    if max_tokens is None:
        max_tokens = default_max_tokens

    settings: dict[str, Any] = {}
    t = get_float(body, "temperature", lo=0.0, hi=2.0)
    if t is not None:   # left out: the server's defaults (serve/defaults.py: the model's, else 0.7), not OpenAI's 1.0
        settings["temperature"] = t
    tp = get_float(body, "top_p", lo=0.0, hi=1.0, lo_open=True)
    if tp is not None:
        settings["top_p"] = tp
    # Extensions (llama.cpp / vLLM names), the rest of trapetum.api.GenerationSettings.
    tk = get_int(body, "top_k", lo=0)
    if tk is not None:
        settings["top_k"] = tk
    mp = get_float(body, "min_p", lo=0.0, hi=1.0)
    if mp is not None:
        settings["min_p"] = mp
    # at least runtime/sampling.py's MIN_REPETITION_PENALTY: smaller divisors overflow the float32 logits
    rp = get_float(body, "repetition_penalty", lo=0.01, hi=10.0)
    if rp is not None:
        settings["repetition_penalty"] = rp
    ie = get_bool(body, "ignore_eos")
    if ie is not None:
        settings["ignore_eos"] = ie
    seed = get_int(body, "seed", lo=-(2 ** 63), hi=2 ** 64 - 1)
    if seed is not None:
        settings["seed"] = seed
    settings["stop"] = get_stop(body)
    get_str(body, "user")   # accepted and ignored, but typed
    return dict(model=model, stream=stream, include_usage=include_usage, max_tokens=max_tokens,
                settings=settings)


_ROLES = ("system", "developer", "user", "assistant")


def _message_text(i: int, content: Any) -> str:
    name = f"messages[{i}].content"
    if isinstance(content, str):
        return text_ok(name, content)
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict):
                raise _type_error(f"{name}[{j}]", "an object", part)
            if part.get("type") != "text":
                raise invalid(f"{name}[{j}].type", f"Unsupported content part type {part.get('type')!r}: "
                              "this server reads text only.", "unsupported_value")
            text = part.get("text")
            if not isinstance(text, str):
                raise _type_error(f"{name}[{j}].text", "a string", text)
            parts.append(text_ok(f"{name}[{j}].text", text))
        return "".join(parts)
    raise _type_error(name, "a string or an array of content parts", content)


def parse_chat_request(body: dict) -> ChatRequest:
    msgs = body.get("messages")
    if msgs is None:
        raise invalid("messages", "Missing required parameter: 'messages'.", "missing_required_parameter")
    if not isinstance(msgs, list):
        raise _type_error("messages", "an array", msgs)
    if not msgs:
        raise invalid("messages", "Invalid 'messages': empty array. Expected at least one message.", "empty_array")
    messages = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise _type_error(f"messages[{i}]", "an object", m)
        role = m.get("role")
        if not isinstance(role, str):
            raise _type_error(f"messages[{i}].role", "a string", role)
        if role not in _ROLES:
            raise invalid(f"messages[{i}].role", f"Invalid value for 'messages[{i}].role': {role!r}; supported "
                          f"roles are {', '.join(_ROLES)}.")
        content = m.get("content")
        if content is None and role != "assistant":
            raise invalid(f"messages[{i}].content", f"Missing required parameter: 'messages[{i}].content'.",
                          "missing_required_parameter")
        text = "" if content is None else _message_text(i, content)
        messages.append({"role": "system" if role == "developer" else role, "content": text})
    return ChatRequest(**_common(body, default_max_tokens=None), messages=messages)


def parse_completion_request(body: dict) -> CompletionRequest:
    p = body.get("prompt")
    if p is None:
        raise invalid("prompt", "Missing required parameter: 'prompt'.", "missing_required_parameter")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]      # a batch of one
    if isinstance(p, list):
        if not p:
            raise invalid("prompt", "Invalid 'prompt': empty array.", "empty_array")
        if all(isinstance(x, str) for x in p):
            raise invalid("prompt", f"Invalid 'prompt': a batch of {len(p)} prompts; this server takes one "
                          "prompt per request.", "unsupported_value")
        if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in p):
            raise _type_error("prompt", "a string, or an array of non-negative token ids", p)
    elif not isinstance(p, str):
        raise _type_error("prompt", "a string or an array of token ids", p)
    else:
        text_ok("prompt", p)
    if get_bool(body, "echo"):
        raise invalid("echo", "Unsupported parameter 'echo': prompts are not echoed by this server.",
                      "unsupported_parameter")
    return CompletionRequest(**_common(body, default_max_tokens=16), prompt=p)


def context_error(ctx: int, prompt_tokens: int, max_tokens: int, *, where: str) -> APIError:
    param = "messages" if where == "messages" else "prompt"
    return APIError(
        400, f"This model's maximum context length is {ctx} tokens. However, you requested "
             f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the {where}, {max_tokens} in the "
             f"completion). Please reduce the length of the {where} or completion.",
        param=param, code="context_length_exceeded")


# ----------------------------------------------------------------------------- responses

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def timings(c, queue_s: float | None) -> dict:
    """Trapetum extension carried beside OpenAI's fields: server-side speed of this request."""
    return {"queue_s": None if queue_s is None else round(queue_s, 4),
            "ttft_s": _round(getattr(c, "ttft_s", None)), "tokens_per_s": _round(getattr(c, "tokens_per_s", None))}


def _round(x):
    return None if x is None else round(float(x), 4)


def _envelope(rid: str, model: str, created: int, obj: str, choices: list, **extra) -> dict:
    """The fields every OpenAI response and chunk share."""
    return {"id": rid, "object": obj, "created": created, "model": model, "system_fingerprint": SYSTEM_FINGERPRINT,
            "choices": choices, **extra}


def _final(c, queue_s: float | None) -> dict:
    return {"usage": usage(c.prompt_tokens, c.completion_tokens), "timings": timings(c, queue_s)}


def chat_response(rid: str, model: str, created: int, c, queue_s: float | None) -> dict:
    choice = {"index": 0, "message": {"role": "assistant", "content": c.text, "refusal": None},
              "logprobs": None, "finish_reason": c.finish_reason}
    return _envelope(rid, model, created, "chat.completion", [choice], **_final(c, queue_s))


def chat_chunk(rid: str, model: str, created: int, delta: dict, finish_reason: str | None = None,
               *, with_usage_field: bool = False) -> dict:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    extra = {"usage": None} if with_usage_field else {}
    return _envelope(rid, model, created, "chat.completion.chunk", [choice], **extra)


def completion_response(rid: str, model: str, created: int, c, queue_s: float | None) -> dict:
    choice = {"index": 0, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason}
    return _envelope(rid, model, created, "text_completion", [choice], **_final(c, queue_s))


def completion_chunk(rid: str, model: str, created: int, text: str, finish_reason: str | None = None,
                     *, with_usage_field: bool = False) -> dict:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    extra = {"usage": None} if with_usage_field else {}
    return _envelope(rid, model, created, "text_completion", [choice], **extra)


def usage_chunk(rid: str, model: str, created: int, obj: str, c, queue_s: float | None) -> dict:
    return _envelope(rid, model, created, obj, [], **_final(c, queue_s))


def sse(obj: dict | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n".encode("utf-8")


def model_object(name: str, created: int, extra: dict | None = None) -> dict:
    d = {"id": name, "object": "model", "created": created, "owned_by": "trapetum"}
    if extra:
        d.update(extra)
    return d


def now() -> int:
    return int(time.time())
