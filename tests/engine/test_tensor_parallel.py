"""Tensor parallelism on the CPU (gloo, 2 ranks): for every supported family's tiny random model,
every mode's first-token logits and greedy tokens are the single-process engine's and the HF
oracle's, with recovery on too; sampled answers agree across the ranks; sizes that do not split
the heads are refused before any process starts.

Tolerances: against the single-process engine 1e-5 (relative to the largest logit): the ranks
compute the same fp32 arithmetic except that o_proj's and down_proj's partial sums over each
rank's heads / MLP columns are added by the all-reduce, a different summation order (measured
<= 1.2e-6); against the oracle 1e-4, test_families.py's and test_parity.py's tolerance.
The two worker processes are spawned once for the whole run (``RankPool``), whatever the family.
"""
import random

import pytest
import torch

from helpers import rel_err
from lazy_rag import Chunk, LazyLLM
from lazy_rag.errors import LazyRagError
from lazy_rag.oracle import block_diagonal_logits, causal_logits, greedy_block_diagonal, greedy_causal
from lazy_rag.random_models import IdTokenizer
from tiny_models import FAMILIES, MOE_FAMILIES, tiny_model

TP_TOL, ORACLE_TOL = 1e-5, 1e-4
NEW = 4


def _ids(rng, n):
    return [rng.randrange(100, 40000) for _ in range(n)]


@pytest.fixture(scope="module", params=sorted({**FAMILIES, **MOE_FAMILIES}))
def pair(request):
    """(the engine over 2 ranks, the single-process engine) of one family's tiny model."""
    model = tiny_model(request.param, "default", hidden_size=128)   # head_dim 32, 4 heads / 2 KV heads
    tp = LazyLLM(model, IdTokenizer(), tensor_parallel=2, num_pages=64, page_size=16)
    one = LazyLLM(model, IdTokenizer(), num_pages=64, page_size=16)
    tp.eos_ids = one.eos_ids = set()   # every answer runs its NEW tokens
    return tp, one


def _both(pair, segs, **kw):
    tp, one = pair
    a = tp.generate(segs, max_new_tokens=NEW, output_first_logits=True, **kw)
    b = one.generate(segs, max_new_tokens=NEW, output_first_logits=True, **kw)
    assert rel_err(a.first_logits, b.first_logits) < TP_TOL, kw
    assert a.token_ids == b.token_ids, kw
    return a, b


def test_every_mode_matches_single_process_and_oracle(pair):
    tp, _ = pair
    rng = random.Random(1)
    chunks = [_ids(rng, n) for n in (9, 33, 20)]   # one longer than two pages
    segs = [_ids(rng, 5), Chunk(chunks[0]), _ids(rng, 2), Chunk(chunks[1]), _ids(rng, 3), Chunk(chunks[2]),
            _ids(rng, 7)]
    model = tp.model
    for mode in ("lazy", "block", "full", "prefix"):
        a, _ = _both(pair, segs, mode=mode)
        layout = tp.prepare(segs, mode=mode)
        if mode in ("lazy", "block"):
            ref = block_diagonal_logits(model, layout)[-1]
            want = greedy_block_diagonal(model, layout, NEW)
        else:
            ref = causal_logits(model, layout.token_ids)[-1]
            want = greedy_causal(model, layout.token_ids, NEW)
        assert rel_err(a.first_logits, ref) < ORACLE_TOL, mode
        assert a.token_ids == want, mode
    stats = tp.stats()
    assert stats["chunk_hits"] > 0 and stats["tensor_parallel"] == 2
    # rank 0's waits for the other ranks (gloo on the CPU: every collective) and its sends
    assert stats["tp_control_s"] > 0 and stats["tp_send_s"] > 0 and "tp_settle_s" not in stats


def test_recovery_matches_single_process(pair):
    """EPIC's boundary heads, ProphetKV's question attention and CacheBlend's KV deviation (both
    scores summed over every rank's heads) recompute the same tokens and answer the same."""
    rng = random.Random(2)
    segs = [_ids(rng, 4), Chunk(_ids(rng, 24)), _ids(rng, 2), Chunk(_ids(rng, 30)), _ids(rng, 6)]
    for mode, recovery in (("lazy", "epic4"), ("lazy", "prophet30"), ("block", "cacheblend30")):
        a, b = _both(pair, segs, mode=mode, recovery=recovery)
        assert a.stats.recomputed_tokens == b.stats.recomputed_tokens > 0, recovery


def test_requests_in_flight_together_and_sampling_agree(pair):
    """Several requests sharing chunks at different offsets, packed into the same steps, and
    sampled answers (the seed rank 0 draws is every rank's)."""
    tp, one = pair
    rng = random.Random(3)
    chunks = [_ids(rng, rng.randint(5, 30)) for _ in range(4)]
    reqs = [dict(segments=[_ids(rng, 3)] + [Chunk(chunks[c]) for c in rng.sample(range(4), 2)] + [_ids(rng, 4)],
                 max_new_tokens=3, output_first_logits=True, temperature=0.9 if i % 2 else 0.0, seed=i)
            for i in range(4)]
    got, want = tp.engine.generate(reqs), one.engine.generate(reqs)
    for a, b in zip(got, want):
        assert a.token_ids == b.token_ids and rel_err(a.first_logits, b.first_logits) < TP_TOL
    assert len(tp.generate(reqs[0]["segments"], max_new_tokens=3, temperature=1.0).token_ids) == 3  # seed drawn


def test_sizes_that_do_not_split_the_heads_are_refused():
    llm = LazyLLM(tiny_model("llama"), IdTokenizer(), tensor_parallel=3, num_pages=8)
    with pytest.raises(LazyRagError, match=r"tensor_parallel=3 .*KV heads \(2\).*tensor_parallel in \[1, 2\]"):
        llm.engine
    with pytest.raises(LazyRagError, match="tensor_parallel must be at least 1"):
        LazyLLM(tiny_model("llama"), IdTokenizer(), tensor_parallel=0)


def test_encoded_chunk_kv_holds_every_head_as_one_process_writes_it(pair):
    """What an index build under TP stores: each rank encodes its KV heads, rank 0 returns all of
    them (fp32, fp8 and int4), as the single-process engine encodes them."""
    tp, one = pair
    rng = random.Random(4)
    chunks = [_ids(rng, 11), _ids(rng, 26)]
    for quantize in (None, "fp8", "int4"):
        got = tp.engine.encode_chunks(chunks, cache=False, quantize=quantize)
        want = one.engine.encode_chunks(chunks, cache=False, quantize=quantize)
        for a, b in zip(got, want):
            assert a.k.shape == b.k.shape and a.k.shape[2] == one.shape.num_kv_heads
            for name, t in b.tensors().items():
                if quantize == "int4":   # codes of the same inputs up to TP's rounding: dequantised KV compared
                    continue
                assert rel_err(a.tensors()[name].float(), t.float()) < (TP_TOL if not quantize else 0.07), name
            if quantize == "int4":
                assert a.groups == b.groups and a.int4
                for x, y in zip(a.dequantized(torch.float32), b.dequantized(torch.float32)):
                    assert rel_err(x, y) < 0.07


def test_the_workers_run_rank_0s_experts_implementation():
    """A MoE model whose experts rank 0 runs through lazy-rag's Triton experts (the default on
    CUDA; here the torch reference) makes every rank run them: a worker registers them too, and
    the answers are the single process's."""
    from lazy_rag.experts import experts_in_use, use_experts

    model = use_experts(tiny_model("qwen3_moe", "default", hidden_size=128), "triton")
    assert experts_in_use(model) == "triton"
    tp = LazyLLM(model, IdTokenizer(), tensor_parallel=2, num_pages=64, page_size=16)
    one = LazyLLM(model, IdTokenizer(), num_pages=64, page_size=16)
    tp.eos_ids = one.eos_ids = set()
    rng = random.Random(5)
    segs = [_ids(rng, 5), Chunk(_ids(rng, 21)), _ids(rng, 6)]
    _both((tp, one), segs, mode="lazy")
    assert tp.engine.stats()["tensor_parallel"] == 2
