"""Every mode against the independent HF oracle, on tiny random models of every family (through
the engine: on the CPU its vectorised torch attention; on CUDA the Triton kernels)."""
import random

import pytest
import torch

from helpers import rel_err, small_llm
from lazy_rag import Chunk
from lazy_rag.oracle import block_diagonal_logits, causal_logits, greedy_block_diagonal
from tiny_models import tiny_model

CASES = [("llama", "default"), ("llama", "llama3"), ("llama", "linear"), ("llama", "yarn"),
         ("qwen2", "default"), ("qwen3", "default"), ("mistral", "default")]


def _ids(rng, n):
    return [rng.randrange(100, 40000) for _ in range(n)]


def _prompt(rng, chunks, order, head=5, gap=2, tail=7):
    segs = [_ids(rng, head)]
    for i in order:
        segs.append(Chunk(chunks[i]))
        segs.append(_ids(rng, gap))
    segs.append(_ids(rng, tail))
    return segs


@pytest.fixture(scope="module", params=CASES, ids=[f"{f}-{r}" for f, r in CASES])
def tiny(request, tokenizer, device):
    family, rope = request.param
    return small_llm(tiny_model(family, rope).to(device), tokenizer)


def test_lazy_and_block_match_oracle_in_any_order_and_offset(tiny):
    rng = random.Random(1)
    # a 1-token chunk, short ones, and one longer than any block (prefix block 16, kernel tiles 64+)
    chunks = [_ids(rng, n) for n in (1, 9, 33, 150)]
    for trial, order in enumerate(([0, 1, 2, 3], [3, 1, 0, 2], [2, 3])):
        segs = _prompt(rng, chunks, order, head=3 + trial * 11)
        ref = block_diagonal_logits(tiny.model, tiny.prepare(segs))[-1]
        for mode in ("lazy", "block"):
            assert rel_err(tiny.next_token_logits(segs, mode=mode), ref) < 1e-4, (mode, order)
    assert tiny.stats()["tier_encoded"] == 4  # every reuse after the first came from the pool


def test_full_and_prefix_match_plain_forward(tiny):
    rng = random.Random(2)
    chunks = [_ids(rng, n) for n in (20, 45)]
    first = _prompt(rng, chunks, [0, 1])
    ref = causal_logits(tiny.model, tiny.prepare(first).token_ids)[-1]
    assert rel_err(tiny.next_token_logits(first, mode="full"), ref) < 1e-4
    assert rel_err(tiny.next_token_logits(first, mode="prefix"), ref) < 1e-4
    # same beginning, different ending: prefix mode reuses whole blocks and still matches
    second = first[:3] + [_ids(rng, 30)]
    ref2 = causal_logits(tiny.model, tiny.prepare(second).token_ids)[-1]
    res = tiny.generate(second, max_new_tokens=1, mode="prefix", output_first_logits=True)
    page = tiny.engine.pool.page_size
    assert res.stats.cached_tokens >= page and res.stats.cached_tokens % page == 0
    assert rel_err(res.first_logits, ref2) < 1e-4


def test_greedy_generation_matches_oracle(tiny):
    rng = random.Random(3)
    chunks = [_ids(rng, n) for n in (17, 40)]
    segs = _prompt(rng, chunks, [1, 0])
    want = greedy_block_diagonal(tiny.model, tiny.prepare(segs), 6)
    for mode in ("lazy", "block"):
        res = tiny.generate(segs, max_new_tokens=6, mode=mode)
        assert res.token_ids == want, mode
        assert res.stats.cached_tokens == 57 and res.stats.computed_tokens == res.stats.prompt_tokens - 57
    full = tiny.generate(segs, max_new_tokens=6, mode="full").token_ids
    assert tiny.generate(segs, max_new_tokens=6, mode="prefix").token_ids == full


def test_shared_prefix_lazy_equals_block_and_chunk_kv_equals_hf_cache(tokenizer, device):
    model = tiny_model("qwen2", "default", seed=5).to(device)
    rng = random.Random(4)
    prefix = _ids(rng, 11)
    llm = small_llm(model, tokenizer, shared_prefix=prefix)
    chunk = _ids(rng, 23)
    kv = llm.encode_chunk(chunk)
    # HF's own cache for [prefix + chunk] holds keys rotated at their positions: ours, rotated, must match
    with torch.no_grad():
        out = model(input_ids=torch.tensor([prefix + chunk], device=device), use_cache=True)
    pos = torch.arange(len(prefix), len(prefix) + len(chunk), device=device)
    for layer in range(model.config.num_hidden_layers):
        hf_k = out.past_key_values.layers[layer].keys[0, :, len(prefix):].transpose(0, 1)
        hf_v = out.past_key_values.layers[layer].values[0, :, len(prefix):].transpose(0, 1)
        assert rel_err(llm.host.pool_rope.rotate(kv.k[layer].to(device), pos), hf_k) < 1e-5
        assert rel_err(kv.v[layer].to(device), hf_v) < 1e-5
    segs = [prefix, Chunk(_ids(rng, 14)), _ids(rng, 3), Chunk(chunk), _ids(rng, 5)]
    lazy = llm.next_token_logits(segs, mode="lazy")
    block = llm.next_token_logits(segs, mode="block")
    assert rel_err(lazy, block) < 1e-5
    # and the prefix really is seen by chunks: without it the answer differs
    plain = small_llm(model, tokenizer)
    assert rel_err(plain.next_token_logits(segs, mode="lazy"), lazy) > 1e-4
    with pytest.raises(Exception, match="shared prefix"):
        llm.next_token_logits([_ids(rng, 4), Chunk(chunk), _ids(rng, 2)])


def test_positions_far_from_zero_keep_parity(tokenizer, device):
    """A long uncached head pushes chunks to large offsets (RoPE angles far from the encode-time ones)."""
    llm = small_llm(tiny_model("llama", "llama3").to(device), tokenizer)
    rng = random.Random(6)
    segs = [_ids(rng, 3000), Chunk(_ids(rng, 40)), _ids(rng, 4), Chunk(_ids(rng, 12)), _ids(rng, 3)]
    ref = block_diagonal_logits(llm.model, llm.prepare(segs))[-1]
    assert rel_err(llm.next_token_logits(segs, mode="lazy"), ref) < 1e-4


def test_boundary_recompute_lazy_equals_block_and_degenerates_correctly(tokenizer, device):
    """EPIC-style recompute of each chunk's first tokens: lazy and block agree; 0 is plain lazy;
    recomputing whole chunks turns them into ordinary text, i.e. a plain causal forward."""
    llm = small_llm(tiny_model("qwen3", "default", seed=9).to(device), tokenizer)
    rng = random.Random(8)
    segs = _prompt(rng, [_ids(rng, n) for n in (1, 7, 30)], [2, 0, 1])
    layout = llm.prepare(segs, boundary_recompute=4)
    assert layout.cached_tokens == 26 + 0 + 3 and len(layout.uncached) == len(layout.token_ids) - 29
    lazy = llm.next_token_logits(segs, mode="lazy", boundary_recompute=4)
    assert rel_err(lazy, llm.next_token_logits(segs, mode="block", boundary_recompute=4)) < 1e-5
    plain = llm.next_token_logits(segs, mode="lazy")
    assert rel_err(llm.next_token_logits(segs, mode="lazy", boundary_recompute=0), plain) < 1e-6
    assert rel_err(lazy, plain) > 1e-4  # the recompute changes the answer
    everything = llm.next_token_logits(segs, mode="lazy", boundary_recompute=30)
    assert rel_err(everything, causal_logits(llm.model, layout.token_ids)[-1]) < 1e-4
    res = llm.generate(segs, max_new_tokens=4, mode="lazy", boundary_recompute=4)
    assert res.stats.cached_tokens == 29
    assert res.token_ids == llm.generate(segs, max_new_tokens=4, mode="block", boundary_recompute=4).token_ids
