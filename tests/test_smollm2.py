"""The real bundled SmolLM2: oracle parity, token-for-token generation, streaming, bad input;
with its bundled chunk wrapper (the default for text chunks) and with plain chunks."""
import pytest

from helpers import reference_page_copies, rel_err
from lazy_rag import Chunk, build_rag_segments
from lazy_rag.errors import LazyRagError, PromptTooLongError
from lazy_rag.oracle import block_diagonal_logits, causal_logits, greedy_block_diagonal
from lazy_rag.requests import ChunkSource


@pytest.fixture(autouse=True)
def _reference_page_copies():
    with reference_page_copies():
        yield


DOCS = [
    "The Marrow Point Lighthouse was completed in 1871 by the engineer Agnes Thorold.",
    "Kestrel Street Bakery opens at six in the morning and closes on Mondays.",
    "The Hollin Ridge Observatory houses a 61-centimetre reflecting telescope installed in 1962.",
]


def _segments(tok, order, question="Who built the lighthouse?"):
    return build_rag_segments(tok, question, [Chunk(DOCS[i]) for i in order])


@pytest.fixture(params=["bundled_wrapper", "plain"])
def source(request, smollm2):
    """Where the chunks are encoded: inside SmolLM2's bundled wrapper (what a user gets) or plain."""
    if request.param == "plain":
        return ChunkSource()
    assert smollm2.default_source.wrapper is not None and smollm2.default_source.wrapper.name == "smollm2"
    return smollm2.default_source


def _slots(source) -> int:
    return source.wrapper.slots if source.wrapper else 0


def test_chat_segments_put_chunks_inside_the_user_turn(smollm2):
    segs = _segments(smollm2.tokenizer, [0, 1])
    assert segs[0].startswith("<|im_start|>system") and "<|im_start|>user" in segs[0]
    assert isinstance(segs[1], Chunk) and segs[-1].endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("order", [[0, 1, 2], [2, 0, 1], [1, 2]])
def test_lazy_block_match_oracle_and_full_matches_plain(smollm2, source, order):
    segs = _segments(smollm2.tokenizer, order)
    layout = smollm2.prepare(segs, source)
    assert [s.end - s.start for s in layout.spans] == [
        len(smollm2.tokenizer(DOCS[i], add_special_tokens=False).input_ids) + _slots(source) for i in order]
    ref = block_diagonal_logits(smollm2.model, layout, smollm2.host.parts.virtual_rows)[-1]
    assert rel_err(smollm2.next_token_logits(segs, mode="lazy", source=source), ref) < 1e-4
    assert rel_err(smollm2.next_token_logits(segs, mode="block", source=source), ref) < 1e-4
    plain = causal_logits(smollm2.model, smollm2.prepare(segs, source, mode="full").token_ids)[-1]
    assert rel_err(smollm2.next_token_logits(segs, mode="full", source=source), plain) < 1e-4


def test_generation_is_token_for_token_the_oracles(smollm2, source):
    segs = _segments(smollm2.tokenizer, [2, 0])
    want = greedy_block_diagonal(smollm2.model, smollm2.prepare(segs, source), 10, smollm2.eos_ids,
                                 smollm2.host.parts.virtual_rows)
    lazy = smollm2.generate(segs, max_new_tokens=10, mode="lazy", source=source)
    block = smollm2.generate(segs, max_new_tokens=10, mode="block", source=source)
    assert lazy.token_ids == want == block.token_ids
    assert lazy.text == smollm2.tokenizer.decode(want, skip_special_tokens=True)
    chunk_tokens = sum(len(smollm2.tokenizer(DOCS[i], add_special_tokens=False).input_ids) + _slots(source)
                       for i in (2, 0))
    assert lazy.stats.cached_tokens == chunk_tokens
    assert lazy.stats.computed_tokens == lazy.stats.prompt_tokens - chunk_tokens
    assert lazy.stats.ttft_ms > 0


def test_streaming_yields_the_same_text_and_stop_strings_cut(smollm2):
    segs = _segments(smollm2.tokenizer, [0])
    whole = smollm2.generate(segs, max_new_tokens=12)
    stream = smollm2.generate(segs, max_new_tokens=12, stream=True)
    pieces = list(stream)
    assert "".join(pieces) == whole.text == stream.result.text
    word = whole.text.split()[1]
    cut = smollm2.generate(segs, max_new_tokens=12, stop=[word])
    assert word not in cut.text and whole.text.startswith(cut.text) and cut.finish_reason == "stop"


def test_sampling_is_seeded(smollm2):
    segs = _segments(smollm2.tokenizer, [1])
    a = smollm2.generate(segs, max_new_tokens=8, temperature=0.9, top_p=0.9, seed=7)
    b = smollm2.generate(segs, max_new_tokens=8, temperature=0.9, top_p=0.9, seed=7)
    assert a.token_ids == b.token_ids


def test_bad_prompts_get_clear_errors(smollm2):
    with pytest.raises(PromptTooLongError, match=r"8192"):
        smollm2.generate(["word " * 9000], max_new_tokens=4)
    with pytest.raises(LazyRagError, match="ends with a cached chunk"):
        smollm2.generate(["Read:", Chunk(DOCS[0])], max_new_tokens=4)
    with pytest.raises(LazyRagError, match="Unknown mode"):
        smollm2.generate(["hi"], mode="fast")
    with pytest.raises(LazyRagError, match="empty"):
        smollm2.generate([], max_new_tokens=4)
    with pytest.raises(ValueError, match="top_p"):
        smollm2.generate(["hi"], top_p=0.0)


def test_a_gguf_tokenizer_read_unlike_the_file_is_refused(monkeypatch):
    """transformers' GGUF tokenizer conversion has differed between versions (5.17 read Gemma 3's
    with a token fewer and no BOS): a tokenizer whose vocabulary size or BOS differs from what the
    GGUF holds is refused, naming the file and the fix; the one converted here is accepted."""
    from types import SimpleNamespace

    import gguf as gguf_package

    from lazy_rag.models import bundled_gguf, check_gguf_tokenizer, load_tokenizer

    # the three checks below read the same file: its fields parsed once (GGUFReader takes ~2.6 s a
    # parse on CI's CPU, most of this test), each check still reading them through GGUFReader
    parsed, reader = {}, gguf_package.GGUFReader

    def read_once(path, *args, **kwargs):
        if path not in parsed:
            parsed[path] = reader(path, *args, **kwargs)
        return parsed[path]

    monkeypatch.setattr(gguf_package, "GGUFReader", read_once)

    gguf, tok = bundled_gguf("smollm2"), load_tokenizer("smollm2")
    check_gguf_tokenizer(gguf, tok)
    vocab = tok.get_vocab()
    fewer_tok = lambda text: tok(text)  # noqa: E731
    fewer_tok.get_vocab = lambda: dict(list(vocab.items())[:-1])
    with pytest.raises(LazyRagError, match=rf"SmolLM2.*{len(vocab) - 1} tokens where the file has {len(vocab)}.*pip install -U"):
        check_gguf_tokenizer(gguf, fewer_tok)
    with_bos = lambda text: SimpleNamespace(input_ids=[tok.bos_token_id, *tok(text).input_ids])  # noqa: E731
    with_bos.get_vocab = tok.get_vocab
    with pytest.raises(LazyRagError, match="BOS added"):
        check_gguf_tokenizer(gguf, with_bos)
    assert list(parsed) == [str(gguf)]  # (the checks read the bundled file, and only it)
