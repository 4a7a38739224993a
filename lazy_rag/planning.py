"""Prompt planning: from a question (or a finished prompt) and the chunks it is asked over to what
the engine runs, ``Plan(segments, source, recovery, chunk_ids)``: the prompt's segments (text and
``Chunk``s of token ids), where its chunks' KV is (an index's ``ChunkSource``, or None: the
engine's own chunk cache), the quality recovery it runs with, and which chunks it reuses.

One planner for every front: ``LazyIndex.query``/``segments``, the LlamaIndex and LangChain
adapters (``integrations/_runtime.py``) and the server (``server/prompts.py``) call these and only
translate their own types. Three ways to plan:

- ``plan_retrieval``: retrieve the question's chunks from an index and prompt with its RAG
  template (``lazy-rag query``);
- ``plan_chunks``: the question over chunks named by id (served from the index's store) or given
  as text (encoded by the engine and kept in its memory tiers);
- ``plan_prompt``: a finished prompt string in which known chunks are found verbatim
  (``span_match.ChunkMatcher``: transparent reuse).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from .chat import DEFAULT_INSTRUCTION, build_rag_segments
from .errors import LazyRagError
from .engine.recovery import Recovery, resolve_recovery
from .requests import CHUNK_MODES, ChunkSource
from .segments import Chunk, Segment


@dataclass
class Plan:
    """A prompt ready for ``LazyLLM.generate(plan.segments, source=plan.source, recovery=plan.recovery)``.

    ``recovery`` None: the engine's default (none); an adapter whose framework gives the
    generation options with each call (the mode among them) chooses it then, with
    ``choose_recovery``. ``chunk_ids``: the cached chunks, in prompt
    order ("" for a chunk given only as text). ``retrieved``: what ``plan_retrieval`` found (the
    index's ``Source``s). ``reuse``: how the chunks were found ("retrieval", "chunk_ids",
    "span_match", "none"); ``note``: why nothing could be reused, when that is not "no match"."""

    segments: list[Segment]
    source: ChunkSource | None = None
    recovery: Recovery | None = None
    chunk_ids: list[str] = field(default_factory=list)
    retrieved: list = field(default_factory=list)
    reuse: str = "chunk_ids"
    note: str | None = None


def choose_recovery(mode: str, recovery: Recovery | str | None = None, boundary_recompute: int | None = None,
                    default: Recovery | None = None) -> Recovery | None:
    """The recovery of one request: the one it names (``recovery``; ``boundary_recompute=N`` is
    short for "epicN"), else ``default`` (an index's) where the mode reuses chunks (full and
    prefix recompute everything anyway: no recovery), else None."""
    if recovery is None and boundary_recompute is None:
        if default is None:
            return None
        return default if mode in CHUNK_MODES else Recovery()
    return resolve_recovery(recovery, boundary_recompute)


def plan_chunks(tokenizer, question: str, chunks: Sequence[tuple[str | None, str | None]], *, index=None,
                system_prompt: str | None = None, mode: str = "lazy", recovery: Recovery | str | None = None,
                boundary_recompute: int | None = None) -> Plan:
    """The question over ``(chunk_id, text)`` pairs, assembled from token ids with lazy-rag's RAG
    template (the index's system prompt and instruction, if any). A chunk id ``index`` knows is
    served from its store, unless ``text`` is given and differs from the indexed text; any other
    chunk is encoded from its text by the engine and kept in its memory tiers."""
    segs: list[Chunk] = []
    ids: list[str] = []
    uses_index = False
    for cid, text in chunks:
        rec = index.by_id.get(cid) if (index is not None and cid is not None) else None
        if rec is not None and (text is None or text == rec.text):
            segs.append(Chunk(rec.token_ids, chunk_id=rec.id))
            uses_index = True
        elif text:
            segs.append(Chunk(text))
        else:
            where = f" at {index.path}" if index is not None else ""
            raise LazyRagError(f"Chunk {cid!r} is not in the index{where} and has no text.")
        ids.append(cid if cid is not None else "")
    instruction = DEFAULT_INSTRUCTION
    if index is not None:
        system_prompt, instruction = index.prompt_settings(system_prompt)
    segments = build_rag_segments(tokenizer, question, segs, system_prompt, instruction)
    # chunks encoded after a shared prefix fix the prompt's head: the index's source either way
    prefix = index.manifest.get("shared_prefix") if index is not None else None
    source = index.chunk_source if (uses_index or prefix) else None
    default = index.recovery if index is not None else None
    return Plan(segments, source, choose_recovery(mode, recovery, boundary_recompute, default), ids)


def plan_retrieval(index, question: str, top_k: int = 4, *, system_prompt: str | None = None, mode: str = "lazy",
                   recovery: Recovery | str | None = None, boundary_recompute: int | None = None) -> Plan:
    """Retrieve ``top_k`` chunks of ``index`` for ``question`` and prompt with them
    (``plan_chunks`` over their ids); ``plan.retrieved`` holds what was found."""
    found = index.retrieve(question, top_k)
    plan = plan_chunks(index.llm.tokenizer, question, [(s.chunk_id, None) for s in found], index=index,
                       system_prompt=system_prompt, mode=mode, recovery=recovery,
                       boundary_recompute=boundary_recompute)
    # a retrieval's prompt is the index's (its source even when the index had nothing to find)
    plan.source, plan.retrieved, plan.reuse = index.chunk_source, found, "retrieval"
    return plan


def plan_prompt(matcher, prompt: str, *, index=None, chunk_ids: Sequence[str] | None = None, mode: str = "lazy",
                recovery: Recovery | str | None = None, boundary_recompute: int | None = None) -> Plan:
    """A finished prompt with every chunk ``matcher`` knows that occurs verbatim in it reused
    (only ``chunk_ids`` when given); ``index``: the index whose chunks the matcher holds (their KV
    is read from its store, and its default recovery applies where they are used). The caller
    holds the lock of the matcher's tokenizer."""
    m = matcher.split(prompt, chunk_ids)
    source = index.chunk_source if m.uses_index else None
    default = index.recovery if m.uses_index else None
    return Plan(m.segments, source, choose_recovery(mode, recovery, boundary_recompute, default), m.chunk_ids,
                reuse="span_match", note=m.note)
