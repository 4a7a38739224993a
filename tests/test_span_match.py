"""lazy_rag.span_match: exact, verbatim chunk spans in prompt strings (tokenizer only, no model run)."""
import pytest

from lazy_rag import Chunk, LazyRagError
from lazy_rag.span_match import HEAD, ChunkMatcher, KnownChunk

LONG = "The Grey Heron lighthouse stands on a granite spit north of Port Sallow."
SHORT = "red green blue yellow"  # under HEAD characters: found with str.find


@pytest.fixture
def matcher(tokenizer):
    m = ChunkMatcher(tokenizer)
    ids = tuple(tokenizer(LONG, add_special_tokens=False).input_ids)
    m._add(KnownChunk("heron", LONG, ids, indexed=True))
    m.add(SHORT, "colours")
    return m


def test_verbatim_spans_become_chunks(matcher, tokenizer):
    assert len(SHORT) < HEAD <= len(LONG)
    prompt = f"Context:\n{LONG}\n\nAlso: {SHORT}. Again {LONG} end?"
    m = matcher.split(prompt)
    assert m.chunk_ids == ["heron", "colours", "heron"]
    assert [type(s) for s in m.segments] == [str, Chunk, str, Chunk, str, Chunk, str]
    assert "".join(s if isinstance(s, str) else (LONG if s.chunk_id == "heron" else SHORT) for s in m.segments) \
        == prompt
    heron = m.segments[1]
    assert heron.chunk_id == "heron" and list(heron.content) == tokenizer(LONG, add_special_tokens=False).input_ids
    assert m.segments[3].chunk_id is None  # registered text: served by the LLM's cache, not an index
    assert m.uses_index and m.chunk_tokens == 2 * len(heron.content) + len(m.segments[3].content)


def test_no_fuzzy_matching_and_edges(matcher):
    assert matcher.split(LONG.replace("granite", "basalt") + " ok?").matches == []
    assert matcher.split(LONG.rstrip(".") + " ok?").matches == []  # a prefix of a chunk is not the chunk
    assert matcher.split(f"Q: {LONG}").matches == []  # a chunk that ends the prompt stays text
    assert matcher.split(f"{LONG} ok?").chunk_ids == ["heron"]  # SmolLM2 adds no BOS: a chunk may start it


def test_restrict_to_chunk_ids_and_prefer_longer(matcher, tokenizer):
    prompt = f"A {LONG} B {SHORT} C"
    assert matcher.split(prompt, chunk_ids=["colours"]).chunk_ids == ["colours"]
    assert matcher.split(prompt, chunk_ids=[]).matches == []
    inner = "granite spit north of Port Sallow."
    matcher.add(inner, "inner")
    assert matcher.split(prompt).chunk_ids == ["heron", "colours"]  # overlapping: the longer span wins
    assert matcher.split(f"x {inner} y").chunk_ids == ["inner"]


def test_stripped_form_only_when_tokens_equal(tokenizer):
    m = ChunkMatcher(tokenizer)
    padded = LONG + "\n"
    m.add(padded, "padded")
    # tokenizing the stripped text alone drops the newline token, so it is not the stored chunk
    assert m.split(f"x {LONG} y").matches == []
    assert m.split(f"x {padded} y").chunk_ids == ["padded"]


def test_short_chunks_ids_and_shared_prefix(tokenizer):
    m = ChunkMatcher(tokenizer, min_tokens=4)
    m.add("hi there", "tiny")  # under min_tokens: never matched
    assert m.split("say hi there now").matches == []
    with pytest.raises(LazyRagError, match="not the tokenization"):
        m.add(LONG, "bad", token_ids=[1, 2, 3])
    prefix = tuple(tokenizer("<|im_start|>system\nHi", add_special_tokens=False).input_ids)
    p = ChunkMatcher(tokenizer, shared_prefix_ids=prefix)
    p._add(KnownChunk("heron", LONG, tuple(tokenizer(LONG, add_special_tokens=False).input_ids), indexed=True))
    assert p.split(f"<|im_start|>system\nHi there. {LONG} ok?").chunk_ids == ["heron"]
    refused = p.split(f"Other start. {LONG} ok?")
    assert refused.matches == [] and "shared prefix" in refused.note
