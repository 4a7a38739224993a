"""Tool calling over structured outputs, for the adapters: the tools are described to the model in
a system message, and the answer is constrained (``lazy_rag.structured``) to a JSON call
``{"name": TOOL, "arguments": {...}}`` of one of them (``tool_choice`` "required", "any" or a
tool's name), or, with "auto", to such a call or plain text that does not start with "{". Tools
are OpenAI function definitions (``{"type": "function", "function": {"name", "description",
"parameters"}}``), as LangChain's ``convert_to_openai_tool`` and the OpenAI API give them.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from lazy_rag.errors import InvalidRequestError
from lazy_rag.structured import OutputFormat


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
