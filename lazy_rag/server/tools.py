"""OpenAI tool calls over the server's answers.

The model is told the tools in a system message and its answer is constrained to a call
``{"name": TOOL, "arguments": {...}}`` (compact JSON, "name" first), or, with ``tool_choice``
"auto", to such a call or plain text that does not start with "{" (``lazy_rag.structured
.plan_tools``, the adapters' grammar). ``ToolCallStream`` turns the answer's text pieces into
OpenAI's message deltas: content, or one tool call whose ``arguments`` (the JSON text of the
arguments object) are streamed as they are generated. The whole answer goes through it too, so
that a streamed and a whole answer are the same.
"""
from __future__ import annotations

import json
import re
import uuid

from ..structured import ToolPlan

_PREFIX = re.compile(r'\s*\{"name":("(?:[^"\\]|\\.)*"),"arguments":')


class ToolCallStream:
    """One answer of a request with tools: ``feed`` each text piece, then ``finish``; each returns
    the OpenAI deltas (``{"content": ...}`` or ``{"tool_calls": [...]}``) to send."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.id = f"call_{uuid.uuid4().hex[:24]}"
        self.buf = ""
        self.kind: str | None = None      # "text" or "call", once the first visible character is out
        self.args_at: int | None = None   # where the arguments start in buf, once the name is known
        self.sent = 0                     # argument characters sent

    @property
    def is_call(self) -> bool:
        return self.kind == "call"

    def feed(self, piece: str) -> list[dict]:
        self.buf += piece
        if self.kind is None:
            head = self.buf.lstrip()
            if not head:
                return []
            self.kind = "call" if head[0] == "{" else "text"
            if self.kind == "text":
                return [{"content": self.buf}]
        elif self.kind == "text":
            return [{"content": piece}]
        out = []
        if self.args_at is None:
            m = _PREFIX.match(self.buf)
            if m is None:
                return []
            name = json.loads(m.group(1))
            if name not in self.plan.names:  # (the grammar allows only these)
                return []
            self.args_at = m.end()
            out.append(self._header(name))
        ready = self.buf[self.args_at:-1]  # the last character may be the call's closing brace
        if len(ready) > self.sent:
            out.append(self._arguments(ready[self.sent:]))
            self.sent = len(ready)
        return out

    def finish(self) -> list[dict]:
        """The rest, once the answer is complete (or cut at max_tokens: a call's arguments are then
        incomplete JSON, as OpenAI's are with finish_reason "length")."""
        if self.kind != "call":
            return []
        if self.args_at is None:  # not in the expected shape: parse it whole
            try:
                obj = json.loads(self.buf)
            except ValueError:
                obj = None
            if not isinstance(obj, dict) or obj.get("name") not in self.plan.names:
                self.kind = "text"
                return [{"content": self.buf}]
            args = json.dumps(obj.get("arguments") or {}, ensure_ascii=False, separators=(",", ":"))
            self.sent = len(args)
            return [self._header(obj["name"]), self._arguments(args)]
        rest = self.buf[self.args_at:]
        try:
            json.loads(self.buf)
            rest = rest.rstrip()[:-1]  # complete: drop the call's closing brace
        except ValueError:
            pass
        out = [self._arguments(rest[self.sent:])] if len(rest) > self.sent else []
        self.sent = len(rest)
        return out

    def _header(self, name: str) -> dict:
        return {"tool_calls": [{"index": 0, "id": self.id, "type": "function",
                                "function": {"name": name, "arguments": ""}}]}

    @staticmethod
    def _arguments(text: str) -> dict:
        return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}


def whole_message(plan: ToolPlan | None, text: str) -> dict:
    """The chat completion's ``message`` for a whole answer (a tool call or content)."""
    if plan is None:
        return {"role": "assistant", "content": text}
    s = ToolCallStream(plan)
    deltas = s.feed(text) + s.finish()
    if not s.is_call:
        return {"role": "assistant", "content": "".join(d.get("content", "") for d in deltas)}
    calls = [c for d in deltas for c in d.get("tool_calls", ())]
    head = calls[0]
    args = "".join(c["function"]["arguments"] for c in calls)
    return {"role": "assistant", "content": None,
            "tool_calls": [{"id": head["id"], "type": "function",
                            "function": {"name": head["function"]["name"], "arguments": args}}]}

