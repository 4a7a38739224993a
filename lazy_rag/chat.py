"""Build RAG prompts as segments through the model's own chat template.

The template is rendered once around a sentinel user message and split there, so the chunks sit
inside the user turn as ``Chunk`` segments and everything else is ordinary uncached text.
"""
from __future__ import annotations

from typing import Sequence

from .segments import Chunk, Segment

DEFAULT_INSTRUCTION = (
    "Answer the question using only the context below. Reply with a short answer."
)
_SENTINEL = "@@LAZY_RAG_USER_TURN@@"


def render_messages(tokenizer, messages: Sequence[tuple[str, str]], add_generation_prompt: bool = True) -> str:
    """``(role, content)`` pairs rendered with the model's chat template (a plain "role: content"
    transcript for a tokenizer without one)."""
    msgs = [{"role": r, "content": c} for r, c in messages]
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=add_generation_prompt)
    text = "".join(f"{m['role']}: {m['content']}\n" for m in msgs)
    return text + ("assistant: " if add_generation_prompt else "")


def _template_parts(tokenizer, system_prompt: str | None) -> tuple[str, str]:
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages.append({"role": "user", "content": _SENTINEL})
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        head, tail = rendered.split(_SENTINEL)
        return head, tail
    head = f"{system_prompt}\n\n" if system_prompt else ""
    return head, "\nAnswer:"


def rag_prefix(tokenizer, system_prompt: str | None = None, instruction: str = DEFAULT_INSTRUCTION) -> str:
    """The text before the first chunk: usable as the index's shared prefix (attention sink)."""
    head, _ = _template_parts(tokenizer, system_prompt)
    return f"{head}{instruction}\n\nContext:\n"


def build_rag_segments(tokenizer, question: str, chunks: Sequence[Chunk], system_prompt: str | None = None,
                       instruction: str = DEFAULT_INSTRUCTION) -> list[Segment]:
    """[template head + instruction] [chunk] "\\n\\n" [chunk] ... "\\n\\nQuestion: ..." [template tail]."""
    _, tail = _template_parts(tokenizer, system_prompt)
    segments: list[Segment] = [rag_prefix(tokenizer, system_prompt, instruction)]
    for i, c in enumerate(chunks):
        if i:
            segments.append("\n\n")
        segments.append(c)
    segments.append(f"\n\nQuestion: {question.strip()}{tail}")
    return segments
