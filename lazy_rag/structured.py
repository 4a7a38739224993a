"""Structured outputs: a grammar that every generated token must keep the text inside (a JSON
schema, any JSON object, a regular expression or a Lark grammar), enforced in the engine's sampler
by llguidance.

Why llguidance (issue 65, measured 2026-11-28 on the 2-core CPU machine): its wheel is 3 MB with no
dependencies and computes the allowed-token mask of SmolLM2's 49k vocabulary in ~0.1 ms per token;
xgrammar requires Triton on Linux x86-64 (~1 GB, which a CPU install leaves out); outlines brings
a large dependency tree for the same job.

``OutputFormat`` says what the output must be (the user's choice, checked before any work);
``GrammarMatcher`` is one request's state: before each token the engine masks the logits to the
tokens the grammar allows (``mask``), then advances it with the token taken (``advance``). The
end-of-sequence token is allowed exactly when the text is complete, so a greedy answer ends as
soon as the model prefers to end.
"""
from __future__ import annotations

import importlib
import json
import threading
import uuid
from dataclasses import dataclass

import torch

from .deps import require
from .errors import InvalidRequestError, LazyRagError

KINDS = ("json_schema", "json_object", "regex", "lark")
_ANY_JSON_OBJECT = {"type": "object"}


def _llguidance(part: str = ""):
    """llguidance (or its ``hf`` / ``torch`` module), with the install command when it is missing."""
    module = require("llguidance")
    return importlib.import_module(f"llguidance.{part}") if part else module


@dataclass(frozen=True)
class OutputFormat:
    """``kind``: json_schema (``spec`` a JSON schema, a dict or its JSON text), json_object (any
    JSON object), regex (``spec`` a regular expression the whole output matches) or lark (``spec``
    a Lark grammar). JSON is generated compact (no free whitespace between tokens)."""

    kind: str
    spec: object = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise InvalidRequestError(f"Unknown output format {self.kind!r}; choose one of {', '.join(KINDS)}.")
        if self.kind in ("regex", "lark") and not isinstance(self.spec, str):
            raise InvalidRequestError(f"An output format of kind {self.kind} needs its {self.kind} as a string.")
        if self.kind == "json_schema":
            schema = json.loads(self.spec) if isinstance(self.spec, str) else self.spec
            if not isinstance(schema, dict):
                raise InvalidRequestError("A json_schema output format needs the schema as a JSON object (a dict).")
            object.__setattr__(self, "spec", schema)

    @classmethod
    def json(cls, schema: dict | str | None = None) -> "OutputFormat":
        return cls("json_schema", schema) if schema is not None else cls("json_object")

    def grammar(self) -> str:
        """The llguidance grammar (its top-level JSON form); a grammar it refuses is an error naming why."""
        llg = _llguidance()
        options = {"whitespace_flexible": False}
        try:
            if self.kind in ("json_schema", "json_object"):
                schema = self.spec if self.kind == "json_schema" else _ANY_JSON_OBJECT
                return llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=options)
            if self.kind == "regex":
                return llg.LLMatcher.grammar_from_regex(self.spec)
            return llg.LLMatcher.grammar_from_lark(self.spec)
        except (ValueError, TypeError) as e:
            raise InvalidRequestError(f"The {self.kind} output format cannot be enforced: {e}") from None


_tokenizers: dict[int, tuple[object, object]] = {}  # id(tokenizer) -> (tokenizer, llguidance's view of it)
_tokenizers_lock = threading.Lock()


def _llg_tokenizer(tokenizer, vocab_rows: int, eos_ids):
    """llguidance's view of a tokenizer (seconds to build: once per tokenizer, vocabulary size and
    end tokens)."""
    key = (id(tokenizer), vocab_rows, tuple(sorted(eos_ids)))
    with _tokenizers_lock:
        hit = _tokenizers.get(key)
        if hit is None:
            llg_hf = _llguidance("hf")
            hit = _tokenizers[key] = (tokenizer, llg_hf.from_tokenizer(tokenizer, n_vocab=vocab_rows,
                                                                    eos_token=sorted(eos_ids)))
        return hit[1]


class GrammarMatcher:
    """One request's grammar state over a model's vocabulary rows (``vocab_rows``: the logits'
    width, which may exceed the tokenizer's; rows no token has are never allowed)."""

    def __init__(self, output_format: OutputFormat, tokenizer, vocab_rows: int, eos_ids):
        llg = _llguidance()
        self._llg_torch = _llguidance("torch")
        self.matcher = llg.LLMatcher(_llg_tokenizer(tokenizer, vocab_rows, eos_ids), output_format.grammar())
        if self.matcher.is_error():
            raise InvalidRequestError(f"The {output_format.kind} output format cannot be enforced: "
                                      f"{self.matcher.get_error()}")
        self.vocab_rows = vocab_rows
        self._bitmask = self._llg_torch.allocate_token_bitmask(1, vocab_rows)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` [vocab] (host, fp32) with every token the grammar does not allow next at -inf."""
        self._llg_torch.fill_next_token_bitmask(self.matcher, self._bitmask)
        logits = logits.float().clone()
        self._llg_torch.apply_token_bitmask_inplace(logits, self._bitmask)
        return logits

    def advance(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise LazyRagError(f"The output grammar refused token {token}: {self.matcher.get_error()}")

    @property
    def finished(self) -> bool:
        """The text is complete and nothing may follow (e.g. a JSON object's closing brace)."""
        return self.matcher.is_stopped()


# -- tool calling (the adapters and the server) over structured outputs: the tools are described
# to the model in a system message, and the answer is constrained (``lazy_rag.structured``) to a JSON call
# ``{"name": TOOL, "arguments": {...}}`` of one of them (``tool_choice`` "required", "any" or a
# tool's name), or, with "auto", to such a call or plain text that does not start with "{". Tools
# are OpenAI function definitions (``{"type": "function", "function": {"name", "description",
# "parameters"}}``), as LangChain's ``convert_to_openai_tool`` and the OpenAI API give them.


@dataclass(frozen=True)
class ToolPlan:
    system_note: str            # what the model is told about the tools
    output_format: OutputFormat | None
    names: tuple[str, ...]


def _function(tool: dict) -> dict:
    fn = tool.get("function", tool) if isinstance(tool, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise InvalidRequestError(f"A tool must be an OpenAI function definition with a name, got {tool!r}.")
    return fn


def _call_schema(fn: dict) -> dict:
    params = dict(fn.get("parameters") or {"type": "object", "properties": {}})
    # the arguments the tool declares and no others (as OpenAI's strict mode): a model must not invent one
    params.setdefault("additionalProperties", False)
    return {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
            "properties": {"name": {"const": fn["name"]}, "arguments": params}}


def plan_tools(tools: list[dict], tool_choice=None) -> ToolPlan | None:
    """The constraint and the note for ``tools`` under ``tool_choice`` (None or "auto": a call or
    text; "required" / "any" / True: a call; a name or {"function": {"name": ...}}: that tool;
    "none": no tools)."""
    if not tools or tool_choice == "none":
        return None
    fns = [_function(t) for t in tools]
    names = tuple(fn["name"] for fn in fns)
    if isinstance(tool_choice, dict):
        tool_choice = (tool_choice.get("function") or {}).get("name", tool_choice.get("name"))
    if tool_choice in (None, "auto"):
        allowed, optional = fns, True
    elif tool_choice in ("any", "required", True):
        allowed, optional = fns, False
    elif tool_choice in names:
        allowed, optional = [fns[names.index(tool_choice)]], False
    else:
        raise InvalidRequestError(f"tool_choice {tool_choice!r} names no tool given ({', '.join(names)}); use "
                                  "auto, required, none or one of the tools' names.")
    calls = [_call_schema(fn) for fn in allowed]
    call = calls[0] if len(calls) == 1 else {"anyOf": calls}
    if optional:
        fmt = OutputFormat("lark", "start: call | TEXT\ncall: %json " + json.dumps(call) + "\nTEXT: /[^{](.|\\n)*/\n")
    else:
        fmt = OutputFormat.json(call)
    described = json.dumps([{k: fn[k] for k in ("name", "description", "parameters") if k in fn} for fn in allowed])
    how = ("To call a tool, answer with only a JSON object {\"name\": TOOL, \"arguments\": {...}}; otherwise answer "
           "in plain text." if optional else "Answer with only a JSON object {\"name\": TOOL, \"arguments\": {...}}.")
    return ToolPlan(f"You can call these tools: {described}\n{how}", fmt, names)


def parse_tool_call(text: str, plan: ToolPlan) -> dict | None:
    """The call in ``text`` as ``{"id", "name", "arguments"}`` (arguments a dict), or None for text."""
    if not text.lstrip().startswith("{"):
        return None
    try:
        obj = json.loads(text)
    except ValueError:  # cut at max_tokens: not a complete call
        return None
    if not isinstance(obj, dict) or obj.get("name") not in plan.names:
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "name": obj["name"], "arguments": obj.get("arguments") or {}}
