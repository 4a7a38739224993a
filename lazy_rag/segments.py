"""Prompt segments and their assembly into one token layout with logical positions.

A prompt is a list of segments: ``str`` or ``list[int]`` is uncached text, ``Chunk(...)`` is a
cached chunk whose KV is encoded alone (no BOS) and reused wherever it lands. Logical positions
run contiguously from 0 over the assembled prompt.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Sequence, Union

from .errors import LazyRagError


@dataclass(frozen=True)
class Chunk:
    """A cached chunk: text (tokenized alone, without BOS) or token ids used verbatim.

    ``chunk_id`` lets a KV provider (e.g. a ``LazyIndex``) find the stored KV without hashing.
    """

    content: Union[str, Sequence[int]]
    chunk_id: str | None = None


Segment = Union[str, Sequence[int], Chunk]


@dataclass
class PromptLayout:
    """The assembled prompt: every token, its logical position and where its KV comes from.

    ``pieces`` lists cached spans in prompt order as ``(start, token_ids, chunk_id)``; ``start``
    is the logical position of the span's first token. ``uncached`` holds the positions of
    tokens that must be computed at query time, in order.
    """

    token_ids: list[int]
    pieces: list[tuple[int, tuple[int, ...], str | None]] = field(default_factory=list)
    uncached: list[int] = field(default_factory=list)
    prefix_len: int = 0  # tokens of the shared prefix at the very start (served from cache)

    @property
    def cached_tokens(self) -> int:
        return self.prefix_len + sum(len(ids) for _, ids, _ in self.pieces)

    @property
    def chunk_spans(self) -> list[tuple[int, int]]:
        return [(start, start + len(ids)) for start, ids, _ in self.pieces]


def token_ids_key(ids: Sequence[int]) -> str:
    """Stable content hash of a token-id sequence (used to key chunk KV)."""
    h = hashlib.sha256()
    h.update(len(ids).to_bytes(8, "little"))
    for t in ids:
        h.update(int(t).to_bytes(4, "little", signed=False))
    return h.hexdigest()


def _is_token_list(seg) -> bool:
    return isinstance(seg, (list, tuple)) and all(isinstance(t, int) for t in seg)


def tokenize_text(tokenizer, text: str, *, first: bool) -> list[int]:
    """Tokenize one uncached string alone.

    Only the prompt's first string gets the tokenizer's BOS (if it adds one and the text does
    not already start with it, as chat-template text does); later strings get no specials.
    """
    ids = tokenizer(text, add_special_tokens=False).input_ids
    bos = getattr(tokenizer, "bos_token_id", None)
    if first and bos is not None and (not ids or ids[0] != bos):
        with_specials = tokenizer(text, add_special_tokens=True).input_ids
        if with_specials and with_specials[0] == bos:
            ids = [bos] + ids
    return ids


def chunk_token_ids(tokenizer, chunk: Chunk) -> tuple[int, ...]:
    if isinstance(chunk.content, str):
        return tuple(tokenizer(chunk.content, add_special_tokens=False).input_ids)
    if _is_token_list(chunk.content):
        return tuple(int(t) for t in chunk.content)
    raise LazyRagError(
        f"Chunk content must be a str or a list of int token ids, got {type(chunk.content).__name__}"
    )


def assemble(tokenizer, segments: Sequence[Segment], shared_prefix: Sequence[int] = ()) -> PromptLayout:
    """Turn segments into a ``PromptLayout``.

    With a non-empty ``shared_prefix`` (the tokens every chunk was encoded after), the prompt
    must start with exactly those tokens; they are then served from cache like a chunk.
    """
    if not segments:
        raise LazyRagError("The prompt is empty: pass at least one segment (a str, token ids or Chunk).")
    if isinstance(segments, (str, Chunk)) or _is_token_list(segments):
        segments = [segments]
    layout = PromptLayout(token_ids=[])
    for i, seg in enumerate(segments):
        pos = len(layout.token_ids)
        if isinstance(seg, Chunk):
            ids = chunk_token_ids(tokenizer, seg)
            if not ids:
                continue  # an empty chunk contributes nothing
            layout.pieces.append((pos, ids, seg.chunk_id))
            layout.token_ids.extend(ids)
        elif isinstance(seg, str):
            ids = tokenize_text(tokenizer, seg, first=(i == 0))
            layout.uncached.extend(range(pos, pos + len(ids)))
            layout.token_ids.extend(ids)
        elif _is_token_list(seg):
            ids = [int(t) for t in seg]
            layout.uncached.extend(range(pos, pos + len(ids)))
            layout.token_ids.extend(ids)
        else:
            raise LazyRagError(
                f"Segment {i} has type {type(seg).__name__}; use a str, a list of int token ids, "
                "or Chunk(str | list[int])."
            )
    if not layout.token_ids:
        raise LazyRagError("The prompt tokenizes to zero tokens; give it some text.")
    shared_prefix = list(shared_prefix)
    if shared_prefix:
        p = len(shared_prefix)
        if layout.token_ids[:p] != shared_prefix or (layout.pieces and layout.pieces[0][0] < p):
            raise LazyRagError(
                "These chunks were encoded after a shared prefix, so the prompt must start with "
                f"exactly its {p} tokens as uncached text (use lazy_rag.chat.build_rag_segments, or "
                "put the prefix text first)."
            )
        layout.prefix_len = p
        layout.uncached = [q for q in layout.uncached if q >= p]
    return layout
