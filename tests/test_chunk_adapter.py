"""Chunk adapters: LoRA deltas on while a chunk is encoded, off for every other token. The
oracle extends to them (the same HF forward, the adapter gated on the chunk spans); full and
prefix stay the checkpoint; the adapter's bytes are in the wrapper's digest and file."""
import random

import pytest
import torch

from helpers import chunked_prompt, random_ids, rel_err, small_llm
from lazy_rag import Chunk
from lazy_rag.chunk_adapter import ChunkAdapters, new_adapter
from lazy_rag.oracle import block_diagonal_logits, causal_logits, greedy_block_diagonal
from lazy_rag.requests import ChunkSource
from lazy_rag.wrapper import ChunkWrapper, WrapperError
from tiny_models import tiny_model


def _adapted_wrapper(model, seed=0, rank=4, targets=None):
    """A wrapper whose adapter changes the model (B random, not zero)."""
    g = torch.Generator().manual_seed(seed)
    kw = {"targets": targets} if targets else {}
    adapter = new_adapter(model, rank=rank, alpha=2.0 * rank, seed=seed, **kw)
    adapter.weights = {n: (a.detach().cpu(), (torch.randn(b.shape, generator=g) * 0.3))
                       for n, (a, b) in adapter.weights.items()}
    vectors = torch.randn(5, model.config.hidden_size, generator=g) * 0.5
    return ChunkWrapper(vectors, 3, 2, adapter=adapter)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_adapted_chunks_match_the_gated_oracle(tokenizer, device, family):
    model = tiny_model(family, seed=3).to(device)
    llm = small_llm(model, tokenizer)
    fingerprint = dict(llm.fingerprint)
    adapted = _adapted_wrapper(model)
    source = ChunkSource(wrapper=adapted)
    rng = random.Random(0)
    segs = chunked_prompt(rng, [random_ids(rng, n) for n in (1, 12, 40)])
    layout = llm.prepare(segs, source)
    lazy = llm.next_token_logits(segs, mode="lazy", source=source)  # registers the wrapper and its adapter
    assert llm.fingerprint == fingerprint  # hooks, not new modules: the checkpoint's fingerprint holds
    ref = block_diagonal_logits(model, layout, llm.host.parts.virtual_rows)[-1]
    assert rel_err(lazy, ref) < 1e-4
    assert rel_err(llm.next_token_logits(segs, mode="block", source=source), ref) < 1e-4
    want = greedy_block_diagonal(model, layout, 5, virtual_rows=llm.host.parts.virtual_rows)
    assert llm.generate(segs, max_new_tokens=5, mode="lazy", source=source).token_ids == want
    # the adapter is really in the chunks' KV: the same vectors without it answer differently
    plain = ChunkWrapper(adapted.vectors, 3, 2)
    assert plain.digest != adapted.digest
    assert rel_err(llm.next_token_logits(segs, mode="lazy", source=ChunkSource(wrapper=plain)), lazy) > 1e-3
    # full never sees it: the plain causal forward, adapter hooks installed or not
    full = llm.next_token_logits(segs, mode="full", source=source)
    assert rel_err(full, causal_logits(model, llm.prepare(segs, mode="full").token_ids)[-1]) < 1e-4
    adapters = ChunkAdapters.find(model)
    assert adapters.gate is None and not adapters._hooks  # hooks only while chunks are encoded
    assert all(not m._forward_hooks for m in model.modules())


def test_two_adapters_in_one_engine_each_reach_only_their_chunks(tokenizer, device):
    model = tiny_model("llama", seed=4).to(device)
    llm = small_llm(model, tokenizer)
    a = _adapted_wrapper(model, seed=1)
    b = _adapted_wrapper(model, seed=2, rank=2, targets=("q_proj", "v_proj"))
    rng = random.Random(1)
    c1, c2 = random_ids(rng, 20), random_ids(rng, 9)
    segs = chunked_prompt(rng, [c1, c2])
    first = {}
    for w in (a, b, a):
        got = llm.next_token_logits(segs, source=ChunkSource(wrapper=w))
        ref = block_diagonal_logits(model, llm.prepare(segs, ChunkSource(wrapper=w)), llm.host.parts.virtual_rows)[-1]
        assert rel_err(got, ref) < 1e-4
        if w.digest in first:
            assert rel_err(got, first[w.digest]) < 1e-6
        first[w.digest] = got
    assert rel_err(first[a.digest], first[b.digest]) > 1e-3


def test_adapter_file_round_trip_and_refusals(tmp_path, tokenizer):
    model = tiny_model("qwen2")
    w = _adapted_wrapper(model)
    path = w.save(tmp_path / "w.safetensors")
    back = ChunkWrapper.load(path)
    assert back.digest == w.digest and back.adapter.describe() == w.adapter.describe()
    assert set(back.adapter.weights) == set(w.adapter.weights)
    assert back.describe()["adapter"]["rank"] == 4
    # an adapter of another shape (same hidden size, other MLP width) is refused by name
    other = tiny_model("qwen2", intermediate_size=48)
    llm = small_llm(other, tokenizer)
    bad = ChunkWrapper(torch.zeros(5, other.config.hidden_size), 3, 2, adapter=w.adapter)
    with pytest.raises(WrapperError, match="adapter.*mlp"):
        llm.generate([[5, 6], Chunk([7, 8, 9]), [10]], max_new_tokens=1, source=ChunkSource(wrapper=bad))
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # a flipped byte in the last adapter factor
    (tmp_path / "bad.safetensors").write_bytes(bytes(data))
    with pytest.raises(WrapperError, match="damaged|not a readable|non-finite"):
        ChunkWrapper.load(tmp_path / "bad.safetensors")


def test_only_an_adapted_chunk_takes_a_graphed_step_out_of_its_graph(tokenizer):
    """A chunk adapter gates through hooks, outside any captured graph: a step that encodes an
    adapted chunk runs eagerly, one that encodes a plain wrapper's chunk need not, and where every
    step is eager (no graphs: the CPU) encoding changes nothing."""
    model = tiny_model("llama", seed=4)
    llm = small_llm(model, tokenizer)
    adapted = _adapted_wrapper(model)
    plain = ChunkWrapper(adapted.vectors * 2, 3, 2)
    segs = chunked_prompt(random.Random(2), [random_ids(random.Random(3), 9)])
    ids = {}
    for name, w in (("adapted", adapted), ("plain", plain)):
        llm.next_token_logits(segs, source=ChunkSource(wrapper=w))  # registers the wrapper (and its adapter)
        (span,) = llm.prepare(segs, ChunkSource(wrapper=w)).spans
        ids[name] = span.token_ids
    runner = llm.engine.runner
    if runner.append_graphs is None:
        assert not runner.encode_leaves_graph(ids["adapted"])
        runner.append_graphs = object()  # as on a GPU, where query steps replay captured graphs
    assert runner.encode_leaves_graph(ids["adapted"]) and not runner.encode_leaves_graph(ids["plain"])


def test_the_digest_is_kept_until_a_tensor_changes(monkeypatch):
    """Every request's cache keys read the digest, so it is computed once; an in-place change of
    the vectors or an adapter factor (a trainer's step), or a new tensor, gives a new one."""
    model = tiny_model("llama", seed=4)
    w = _adapted_wrapper(model)
    first = w.digest
    hashed = []
    real = ChunkWrapper._compute_digest
    monkeypatch.setattr(ChunkWrapper, "_compute_digest", lambda self: hashed.append(1) or real(self))
    assert [w.digest for _ in range(3)] == [first] * 3 and hashed == []
    name, (a, b) = next(iter(w.adapter.weights.items()))
    b.add_(0.1)                       # in place: the tensor's version changes
    second = w.digest
    assert second != first and len(hashed) == 1
    w.adapter.weights[name] = (a, b.clone())  # another tensor, equal values: the same digest
    assert w.digest == second and len(hashed) == 2
    w.vectors = w.vectors * 2
    assert w.digest not in (first, second)
