"""The OpenAI request schema as lazy-rag reads it: parse and check a JSON body into a request
object, or raise ``APIError`` with the status, message and parameter an OpenAI client shows.

Bodies are read by hand rather than through pydantic models so that every refusal is a 400 in the
OpenAI error shape naming the field and the fix (FastAPI's own validation answers 422 in another
shape, which OpenAI clients do not understand).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from ..errors import InvalidRequestError
from ..requests import MODES
from ..structured import OutputFormat, ToolPlan, plan_tools
from ..structured import _call_schema as call_schema

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
MAX_N = 128                 # OpenAI's limit on n
MAX_TOP_LOGPROBS = 20       # chat's top_logprobs (OpenAI's limit)
MAX_COMPLETION_LOGPROBS = 5  # the legacy completions' logprobs (OpenAI's limit)
_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


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
    n: int = 1                                 # choices: n requests to the engine
    logprobs: int | None = None                # per-token logprobs with this many alternatives
    tools: ToolPlan | None = None              # tools (and tool_choice): the grammar and the note
    extra: dict = field(default_factory=dict)


# fields an OpenAI client may send that lazy-rag does not implement: (field, allowed value test, why)
_REFUSED = [
    ("best_of", lambda v: v in (None, 1), "best_of > 1 is not supported; use n for several answers"),
    ("functions", lambda v: not v, "the deprecated function calling is not supported; use 'tools'"),
    ("function_call", lambda v: v in (None, "none"),
     "the deprecated function calling is not supported; use 'tools' and 'tool_choice'"),
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


def _assistant_calls(calls: Any, where: str) -> str:
    """An assistant message's ``tool_calls`` as the text the model wrote for them (the call
    format ``tools`` constrains answers to, one call a line)."""
    if not isinstance(calls, list) or not calls:
        raise bad(f"{where}.tool_calls must be a non-empty list of tool calls.", "messages")
    lines = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str):
            raise bad(f"{where}.tool_calls[{j}] must be {{\"id\", \"type\": \"function\", \"function\": "
                      "{\"name\", \"arguments\": JSON text}}.", "messages")
        try:
            args = json.loads(fn["arguments"]) if fn["arguments"].strip() else {}
        except ValueError:
            args = fn["arguments"]  # as the client has it
        lines.append(json.dumps({"name": fn["name"], "arguments": args}, ensure_ascii=False, separators=(",", ":")))
    return "\n".join(lines)


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
            raise bad(f"messages[{i}]: role {role!r} is not supported; use system, developer, user, assistant "
                      "or tool.", "messages")
        if role == "assistant" and m.get("tool_calls"):
            text = _assistant_calls(m["tool_calls"], f"messages[{i}]")
            if m.get("content"):
                text = _text_content(m["content"], f"messages[{i}]") + "\n" + text
        else:
            text = _text_content(m.get("content"), f"messages[{i}]")
        out.append((ROLES[role], text))
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
            "n": _number(body, "n", 1, 1, MAX_N, integer=True), **_lazy_rag_fields(body)}


def _chat_logprobs(body: dict) -> int | None:
    """Chat's ``logprobs`` (true: each token's logprob) and ``top_logprobs`` (0..20 alternatives)."""
    lp, top = body.get("logprobs"), body.get("top_logprobs")
    if lp is not None and not isinstance(lp, bool):
        raise bad(f"'logprobs' must be true or false, got {lp!r} (the number of alternatives is 'top_logprobs').",
                  "logprobs")
    top = _number(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS, integer=True)
    if top is not None and not lp:
        raise bad("'top_logprobs' needs 'logprobs': true.", "top_logprobs")
    return (top or 0) if lp else None


def _tools(body: dict, common: dict) -> ToolPlan | None:
    """``tools`` (OpenAI function definitions) under ``tool_choice``: the grammar and the system
    note of ``lazy_rag.structured.plan_tools``, each tool's parameters checked now."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    ptc = body.get("parallel_tool_calls")
    if ptc is not None and not isinstance(ptc, bool):
        raise bad("'parallel_tool_calls' must be true or false.", "parallel_tool_calls")
    if not tools:
        if choice not in (None, "none"):
            raise bad("'tool_choice' needs 'tools': give the functions the model may call.", "tool_choice")
        if tools is not None and not isinstance(tools, list):
            raise bad("'tools' must be a list of {\"type\": \"function\", \"function\": {...}} objects.", "tools")
        return None
    if not isinstance(tools, list) or len(tools) > 128:
        raise bad("'tools' must be a list of at most 128 {\"type\": \"function\", \"function\": {\"name\", "
                  "\"description\"?, \"parameters\"?}} objects.", "tools")
    names = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise bad(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\", \"parameters\"?}}}}.",
                      "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
            raise bad(f"tools[{i}].function.name must be 1 to 64 letters, digits, _ or -, got {name!r}.", "tools")
        if name in names:
            raise bad(f"tools[{i}]: two tools are named {name!r}.", "tools")
        names.append(name)
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise bad(f"tools[{i}].function.parameters must be a JSON schema object.", "tools")
        try:
            OutputFormat.json(call_schema(fn)).grammar()
        except InvalidRequestError as e:
            raise bad(f"tools[{i}] ({name}): its parameters cannot be enforced: {e}", "tools") from None
    if choice is not None and choice not in ("none", "auto", "required"):
        fn = choice.get("function") if isinstance(choice, dict) else None
        if not isinstance(fn, dict) or choice.get("type") != "function" or fn.get("name") not in names:
            raise bad(f"'tool_choice' must be none, auto, required or {{\"type\": \"function\", \"function\": "
                      f"{{\"name\": ...}}}} naming one of the tools ({', '.join(names)}), got {choice!r}.",
                      "tool_choice")
        choice = fn["name"]
    plan = plan_tools(tools, choice)
    if plan is not None and common["output_format"] is not None:
        raise bad("Give either 'tools' or 'response_format', not both (a tool call is itself constrained JSON); "
                  "or set 'tool_choice' to none.", "response_format")
    return plan


def _with_tools(messages: tuple[tuple[str, str], ...], plan: ToolPlan | None) -> tuple[tuple[str, str], ...]:
    """The tools' note in the system message (added to the caller's first one, if any)."""
    if plan is None:
        return messages
    if messages[0][0] == "system":
        return (("system", f"{messages[0][1]}\n\n{plan.system_note}"), *messages[1:])
    return (("system", plan.system_note), *messages)


def parse_chat(body: Any) -> GenerationRequest:
    common = _common(body)
    messages = _messages(body)
    if (common["documents"] or common["rag_top_k"]) and messages[-1][0] != "user":
        raise bad("With 'documents' or 'rag' the last message must be the user's question.", "messages")
    if common["documents"] and common["rag_top_k"]:
        raise bad("Give either 'documents' or 'rag', not both.", "rag")
    tools = _tools(body, common)
    if tools is not None and common["rag_top_k"]:
        raise bad("'tools' cannot be combined with 'rag' (its prompt is the retrieval template); send the "
                  "passages as 'documents' instead.", "tools")
    return GenerationRequest(kind="chat", messages=_with_tools(messages, tools), tools=tools,
                             logprobs=_chat_logprobs(body), **common)


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
    for name in ("tools", "tool_choice", "top_logprobs"):
        if body.get(name) is not None:
            raise bad(f"'{name}' is a chat field: use /v1/chat/completions.", name, code="unsupported_parameter")
    logprobs = body.get("logprobs")
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)
                                 or not 0 <= logprobs <= MAX_COMPLETION_LOGPROBS):
        raise bad(f"'logprobs' must be an integer from 0 to {MAX_COMPLETION_LOGPROBS} (the alternatives per token), "
                  f"got {logprobs!r}.", "logprobs")
    return GenerationRequest(kind="completion", prompt=prompt, logprobs=logprobs, **common)
