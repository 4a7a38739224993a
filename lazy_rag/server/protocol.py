"""The OpenAI request schema as lazy-rag reads it: parse and check a JSON body into a request
object, or raise ``APIError`` with the status, message and parameter an OpenAI client shows.

Bodies are read by hand rather than through pydantic models so that every refusal is a 400 in the
OpenAI error shape naming the field and the fix (FastAPI's own validation answers 422 in another
shape, which OpenAI clients do not understand).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import InvalidRequestError
from ..requests import MODES
from ..structured import OutputFormat

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


class APIError(Exception):
    """An error the client sees: HTTP status and an OpenAI error object (never a traceback)."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


@dataclass(frozen=True)
class Document:
    """A document given in the request body: its text is encoded once, cached by content and
    reused at any position by later requests."""

    text: str
    title: str | None = None
    id: str | None = None

    @property
    def chunk_text(self) -> str:
        return f"{self.title}\n{self.text}" if self.title else self.text


@dataclass(frozen=True)
class Sampling:
    max_tokens: int | None
    temperature: float
    top_p: float
    stop: tuple[str, ...]
    seed: int | None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0


@dataclass(frozen=True)
class GenerationRequest:
    """One chat or completion request. ``messages`` for chat ((role, text) pairs), ``prompt`` for
    completions. ``documents``, ``rag_top_k``, ``mode`` and ``recovery`` are lazy-rag's fields."""

    kind: str                      # "chat" or "completion"
    model: str
    sampling: Sampling
    stream: bool = False
    include_usage: bool = False
    messages: tuple[tuple[str, str], ...] = ()
    prompt: str = ""
    documents: tuple[Document, ...] = ()
    rag_top_k: int | None = None
    mode: str | None = None
    recovery: str | None = None
    output_format: OutputFormat | None = None  # response_format: JSON mode or a JSON schema
    extra: dict = field(default_factory=dict)


# fields an OpenAI client may send that lazy-rag does not implement: (field, allowed value test, why)
_REFUSED = [
    ("n", lambda v: v in (None, 1), "n > 1 is not supported; send one request per answer"),
    ("best_of", lambda v: v in (None, 1), "best_of > 1 is not supported"),
    ("tools", lambda v: not v, "tool calling is not supported"),
    ("functions", lambda v: not v, "function calling is not supported"),
    ("tool_choice", lambda v: v in (None, "none"), "tool calling is not supported"),
    ("function_call", lambda v: v in (None, "none"), "function calling is not supported"),
    ("logprobs", lambda v: v in (None, False) or v == 0, "logprobs are not supported"),
    ("top_logprobs", lambda v: v in (None, 0), "logprobs are not supported"),
    ("echo", lambda v: not v, "echo is not supported"),
    ("suffix", lambda v: v in (None, ""), "suffix (insertion) is not supported"),
    ("logit_bias", lambda v: not v, "logit_bias is not supported"),
]


def _number(body: dict, name: str, default, lo: float, hi: float, integer: bool = False):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        raise bad(f"'{name}' must be {'an integer' if integer else 'a number'}, got {v!r}.", name)
    if not lo <= v <= hi:
        raise bad(f"'{name}' must be between {lo:g} and {hi:g}, got {v}.", name)
    return v


def _stop(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v) or len(v) > 16:
        raise bad("'stop' must be a non-empty string or a list of at most 16 non-empty strings.", "stop")
    return tuple(v)


def _sampling(body: dict) -> Sampling:
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise bad(f"'{name}' must be a positive integer, got {max_tokens!r}.", name)
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise bad(f"'seed' must be an integer, got {seed!r}.", "seed")
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0:
        raise bad("'top_p' must be greater than 0 (use temperature 0 for greedy answers).", "top_p")
    return Sampling(max_tokens, float(_number(body, "temperature", 1.0, 0.0, 2.0)), float(top_p), _stop(body), seed,
                    float(_number(body, "presence_penalty", 0.0, -2.0, 2.0)),
                    float(_number(body, "frequency_penalty", 0.0, -2.0, 2.0)))


def _text_content(content: Any, where: str) -> str:
    """A message's content: a string, or a list of text parts (the newer OpenAI shape)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad(f"{where}: only text content parts are supported, got {kind!r}.", "messages")
            parts.append(part["text"])
        return "".join(parts)
    raise bad(f"{where}: 'content' must be a string or a list of text parts.", "messages")


def _messages(body: dict) -> tuple[tuple[str, str], ...]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("'messages' must be a non-empty list of {role, content} objects.", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be an object with 'role' and 'content'.", "messages")
        role = m.get("role")
        if role not in ROLES:
            raise bad(f"messages[{i}]: role {role!r} is not supported; use system, developer, user or assistant "
                      "(tool messages are not supported).", "messages")
        out.append((ROLES[role], _text_content(m.get("content"), f"messages[{i}]")))
    return tuple(out)


def _documents(body: dict) -> tuple[Document, ...]:
    docs = body.get("documents")
    if docs is None:
        return ()
    if not isinstance(docs, list):
        raise bad("'documents' must be a list of strings or of {text, title?, id?} objects.", "documents")
    out = []
    for i, d in enumerate(docs):
        if isinstance(d, str):
            d = {"text": d}
        if not isinstance(d, dict) or not isinstance(d.get("text"), str) or not d["text"].strip():
            raise bad(f"documents[{i}] must be a non-empty string or an object with a non-empty 'text'.", "documents")
        for key in ("title", "id"):
            if d.get(key) is not None and not isinstance(d[key], (str, int)):
                raise bad(f"documents[{i}].{key} must be a string.", "documents")
        out.append(Document(d["text"], None if d.get("title") is None else str(d["title"]),
                            None if d.get("id") is None else str(d["id"])))
    return tuple(out)


def _lazy_rag_fields(body: dict) -> dict:
    mode = body.get("mode")
    if mode is not None and mode not in MODES:
        raise bad(f"'mode' must be one of {', '.join(MODES)}, got {mode!r}.", "mode")
    recovery = body.get("recovery")
    if recovery is not None and not isinstance(recovery, str):
        raise bad("'recovery' must be a string such as 'prophet20' or 'epic16+ape0.8'.", "recovery")
    rag = body.get("rag")
    top_k = None
    if rag is not None:
        if rag is True:
            rag = {}
        if not isinstance(rag, dict):
            raise bad("'rag' must be an object, e.g. {\"top_k\": 4}.", "rag")
        top_k = rag.get("top_k", 4)
        if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= 64:
            raise bad(f"'rag.top_k' must be an integer from 1 to 64, got {top_k!r}.", "rag")
    return {"mode": mode, "recovery": recovery, "rag_top_k": top_k}


def _response_format(body: dict) -> OutputFormat | None:
    """OpenAI's ``response_format``: ``text`` (the default), ``json_object`` (JSON mode: any JSON
    object) or ``json_schema`` (``{"json_schema": {"name", "schema", "strict"?}}``), enforced token by
    token (``lazy_rag.structured``)."""
    rf = body.get("response_format")
    if rf is None:
        return None
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return OutputFormat.json()
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise bad("'response_format.json_schema.schema' must be a JSON schema object, as in "
                      "{\"type\": \"json_schema\", \"json_schema\": {\"name\": \"answer\", \"schema\": {...}}}.",
                      "response_format")
        try:
            fmt = OutputFormat.json(spec["schema"])
            fmt.grammar()  # a schema that cannot be enforced: said now, as a 400
        except InvalidRequestError as e:
            raise bad(f"'response_format': {e}", "response_format") from None
        return fmt
    raise bad("'response_format.type' must be text, json_object or json_schema.", "response_format")


def _common(body: Any) -> dict:
    if not isinstance(body, dict):
        raise bad("The request body must be a JSON object.")
    for name, ok, why in _REFUSED:
        if not ok(body.get(name)):
            raise bad(f"'{name}': {why}.", name, code="unsupported_parameter")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("'model' is required: the name GET /v1/models lists.", "model")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("'stream' must be true or false.", "stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise bad("'stream_options' must be an object.", "stream_options")
    return {"model": model, "stream": stream, "include_usage": bool(opts.get("include_usage")),
            "sampling": _sampling(body), "documents": _documents(body), "output_format": _response_format(body),
            **_lazy_rag_fields(body)}


def parse_chat(body: Any) -> GenerationRequest:
    common = _common(body)
    messages = _messages(body)
    if (common["documents"] or common["rag_top_k"]) and messages[-1][0] != "user":
        raise bad("With 'documents' or 'rag' the last message must be the user's question.", "messages")
    if common["documents"] and common["rag_top_k"]:
        raise bad("Give either 'documents' or 'rag', not both.", "rag")
    return GenerationRequest(kind="chat", messages=messages, **common)


def parse_completion(body: Any) -> GenerationRequest:
    common = _common(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise bad("'prompt' must be a non-empty string (one prompt per request; token-id prompts and batches "
                  "are not supported).", "prompt")
    if common["rag_top_k"]:
        raise bad("'rag' needs a question: use /v1/chat/completions.", "rag")
    return GenerationRequest(kind="completion", prompt=prompt, **common)
