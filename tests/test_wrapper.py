"""Chunk wrappers: trained soft vectors encoded around every chunk. The oracle extends to them (a
plain HF forward over inputs_embeds with the same 4-D mask and positions); full and prefix
never see them; the file format refuses what it cannot trust."""
import random

import pytest
import torch

from helpers import chunked_prompt, random_ids, rel_err, small_llm
from lazy_rag import Chunk
from lazy_rag.errors import LazyRagError
from lazy_rag.oracle import block_diagonal_logits, causal_logits, greedy_block_diagonal
from lazy_rag.requests import ChunkSource
from lazy_rag.wrapper import ChunkWrapper, WrapperError
from tiny_models import tiny_model


def _wrapper(model, header=3, trailer=2, seed=0, fingerprint=""):
    g = torch.Generator().manual_seed(seed)
    hidden = model.config.hidden_size
    return ChunkWrapper(torch.randn(header + trailer, hidden, generator=g) * 0.5, header, trailer, fingerprint)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_wrapped_chunks_match_the_inputs_embeds_oracle(tokenizer, device, family):
    model = tiny_model(family, seed=3).to(device)
    llm = small_llm(model, tokenizer)
    wrapper = _wrapper(model)
    source = ChunkSource(wrapper=wrapper)
    rng = random.Random(0)
    chunks = [random_ids(rng, n) for n in (1, 12, 40)]
    segs = chunked_prompt(rng, chunks)
    layout = llm.prepare(segs, source)
    assert [s.end - s.start for s in layout.spans] == [len(c) + 5 for c in chunks]  # the slots are in the span
    ref = block_diagonal_logits(model, layout, llm.host.parts.virtual_rows)[-1]
    for mode in ("lazy", "block"):
        assert rel_err(llm.next_token_logits(segs, mode=mode, source=source), ref) < 1e-4, mode
    want = greedy_block_diagonal(model, layout, 5, virtual_rows=llm.host.parts.virtual_rows)
    assert llm.generate(segs, max_new_tokens=5, mode="lazy", source=source).token_ids == want
    # the wrapper changes the answer (its KV is really in the chunks), and full ignores it
    plain = llm.next_token_logits(segs, mode="lazy")
    assert rel_err(plain, ref) > 1e-3
    full = llm.next_token_logits(segs, mode="full", source=source)
    assert rel_err(full, causal_logits(model, llm.prepare(segs, mode="full").token_ids)[-1]) < 1e-4
    assert len(llm.prepare(segs, source, mode="full").token_ids) == len(llm.prepare(segs).token_ids)


def test_two_wrappers_in_one_engine_never_share_kv(tokenizer, device):
    model = tiny_model("llama", seed=4).to(device)
    llm = small_llm(model, tokenizer)
    a, b = _wrapper(model, seed=1), _wrapper(model, seed=2)
    rng = random.Random(1)
    segs = chunked_prompt(rng, [random_ids(rng, 20), random_ids(rng, 9)])
    la = llm.next_token_logits(segs, source=ChunkSource(wrapper=a))
    lb = llm.next_token_logits(segs, source=ChunkSource(wrapper=b))
    assert rel_err(la, lb) > 1e-3
    # served again after the other: each from its own pool entry, still its own oracle
    for w, first in ((a, la), (b, lb)):
        again = llm.next_token_logits(segs, source=ChunkSource(wrapper=w))
        assert rel_err(again, first) < 1e-6
    ref = block_diagonal_logits(model, llm.prepare(segs, ChunkSource(wrapper=b)), llm.host.parts.virtual_rows)[-1]
    assert rel_err(lb, ref) < 1e-4


def test_recovery_recomputes_wrapped_chunks_exactly(tokenizer, device):
    """Recomputing every chunk token (slots included) turns a wrapped prompt into a causal forward
    over the same embeddings."""
    model = tiny_model("qwen2", seed=6).to(device)
    llm = small_llm(model, tokenizer)
    source = ChunkSource(wrapper=_wrapper(model, 2, 2))
    rng = random.Random(2)
    segs = chunked_prompt(rng, [random_ids(rng, 7), random_ids(rng, 11)])
    layout = llm.prepare(segs, source)
    every = llm.next_token_logits(segs, source=source, recovery="epic64")
    with torch.inference_mode():
        from lazy_rag.oracle import model_inputs

        causal = model(**model_inputs(model, layout.token_ids, llm.host.parts.virtual_rows)).logits[0, -1].float()
    assert rel_err(every, causal) < 1e-4
    assert rel_err(llm.next_token_logits(segs, source=source, recovery="prophet20"),
                   llm.next_token_logits(segs, source=source, mode="block", recovery="prophet20")) < 1e-4


def test_wrapper_file_round_trip_and_refusals(tmp_path):
    model = tiny_model("llama")
    w = _wrapper(model, fingerprint="abc")
    w.recipe = {"steps": 3}
    path = w.save(tmp_path / "w.safetensors")
    back = ChunkWrapper.load(path)
    assert back.digest == w.digest and back.recipe == {"steps": 3} and (back.header, back.trailer) == (3, 2)
    assert not list(tmp_path.glob(".*.tmp"))
    with pytest.raises(WrapperError, match="fingerprint abc.*has fingerprint xyz"):
        back.check_model({"id": "xyz"}, "m")
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # a flipped byte in the vectors
    (tmp_path / "bad.safetensors").write_bytes(bytes(data))
    with pytest.raises(WrapperError, match="damaged|not a readable"):
        ChunkWrapper.load(tmp_path / "bad.safetensors")
    with pytest.raises(WrapperError, match="No chunk wrapper file"):
        ChunkWrapper.load(tmp_path / "missing.safetensors")
    with pytest.raises(WrapperError, match="header \\+ trailer"):
        ChunkWrapper(torch.zeros(0, 8), 0, 0)


def test_wrapper_of_another_hidden_size_is_refused(tokenizer):
    llm = small_llm(tiny_model("llama"), tokenizer)
    bad = ChunkWrapper(torch.zeros(4, 7), 2, 2)
    with pytest.raises(LazyRagError, match="hidden size"):
        llm.generate([[5, 6], Chunk([7, 8, 9]), [10]], max_new_tokens=1, source=ChunkSource(wrapper=bad))


def test_auto_finds_a_bundled_wrapper_by_name_or_by_fingerprint(tmp_path, monkeypatch):
    """`wrapper="auto"`: the bundled file named like the model; failing that, the bundled file
    trained for the loaded weights' fingerprint (the same model loaded from its .gguf path).
    A file without a fingerprint is never picked by "auto"."""
    import lazy_rag.wrapper as wrapper_mod

    model = tiny_model("llama")
    monkeypatch.setattr(wrapper_mod, "BUNDLED_DIR", tmp_path)
    _wrapper(model, seed=1, fingerprint="f1,f2").save(tmp_path / "some-model.safetensors")
    _wrapper(model, seed=2, fingerprint="").save(tmp_path / "any-model.safetensors")
    by_name = wrapper_mod.resolve_wrapper("auto", "some-model", {"id": "f2"})
    by_path = wrapper_mod.resolve_wrapper("auto", "/models/weights.gguf", {"id": "f1"})
    assert by_name.name == by_path.name == "some-model" and by_name.digest == by_path.digest
    assert wrapper_mod.resolve_wrapper("auto", "/models/weights.gguf", {"id": "other"}) is None
    assert wrapper_mod.resolve_wrapper("auto", "some-model", {"id": "other"}) is None
