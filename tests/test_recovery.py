"""Training-free recovery in the engine (Recovery): selective recompute by two selectors, APE
attention scaling, boundary recompute, and their combinations, against independent references:
recomputing nothing is plain lazy, recomputing everything is a plain causal forward, lazy equals
block for the same tokens, each selector picks exactly the tokens its definition names (computed
here from plain HF forwards), and APE equals an HF forward whose attention is the APE formula."""
import random

import pytest
import torch

from helpers import rel_err, small_llm
from lazy_rag import Chunk
from lazy_rag.random_models import IdTokenizer
from lazy_rag.errors import LazyRagError
from lazy_rag.oracle import ape_logits, block_diagonal_logits, causal_logits, visibility_mask
from lazy_rag.engine.recovery import SCORERS, Recovery
from tiny_models import tiny_model


def _ids(rng, n):
    return [rng.randrange(100, 40000) for _ in range(n)]


@pytest.fixture(scope="module")
def llm(device):
    # head_dim 32: on CUDA the kernels serve it (and the graphs), as in production
    return small_llm(tiny_model("llama", "llama3", seed=9, hidden_size=128).to(device), IdTokenizer(), page_size=4)


@pytest.fixture(scope="module")
def prompt():
    rng = random.Random(8)
    chunks = [_ids(rng, n) for n in (1, 7, 30, 45)]
    return [_ids(rng, 5), Chunk(chunks[2]), _ids(rng, 2), Chunk(chunks[0]), _ids(rng, 2), Chunk(chunks[3]),
            _ids(rng, 2), Chunk(chunks[1]), _ids(rng, 7)]


def chosen_positions(llm, monkeypatch):
    """Record the positions every selection recomputes (the planner's recompute calls)."""
    picked = []
    original = llm.engine.planner.recompute

    def spy(seq, positions):
        picked.append(sorted(positions))
        return original(seq, positions)

    monkeypatch.setattr(llm.engine.planner, "recompute", spy)
    return picked


def test_names_parse_round_trip_and_bad_ones_are_refused():
    for name in ("epic16", "prophet20", "cacheblend15", "ape0.8", "ape0.8s1.2", "epic4+prophet20+ape0.9", "auto",
                 "epic4+auto"):
        assert Recovery.parse(name).name() == name
    assert Recovery.parse("prophet20") == Recovery(select="question_attention", ratio=0.2)
    assert not Recovery.parse("").any and not Recovery.parse(None).any
    for bad in ("magic5", "prophet150", "ape0", "epic-3", "auto+prophet20"):
        with pytest.raises(LazyRagError):
            Recovery.parse(bad)


def test_a_method_is_one_row_that_the_quality_configurations_take_too():
    """Each of engine.recovery.METHODS parses, names itself back, and is a configuration suffix of
    the quality runs (``lazy+epic16``) setting its part of the Recovery."""
    from lazy_rag.engine.recovery import METHODS
    from lazy_rag.quality.configs import SUFFIXES, Config

    examples = {"epic": "epic8", "prophet": "prophet12.5", "cacheblend": "cacheblend30", "ape": "ape0.7s1.1",
                "auto": "auto"}
    assert set(examples) == set(METHODS)
    for name, method in METHODS.items():
        assert Recovery.parse(examples[name]).name() == examples[name]
        assert (SUFFIXES[name].pattern, SUFFIXES[name].recovery) == (method.pattern, method.part)
        assert Config.parse(f"lazy+{examples[name]}").generate_options == {"recovery": examples[name]}


@pytest.mark.parametrize("selector", ["prophet", "cacheblend"])
def test_recomputing_nothing_is_lazy_and_everything_is_full(llm, prompt, selector, monkeypatch):
    # nothing or everything needs no ranking: the selector's scoring pass (an extra forward) is skipped
    monkeypatch.setitem(SCORERS, Recovery.parse(f"{selector}50").select, lambda *a: pytest.fail("scored"))
    layout = llm.prepare(prompt)
    lazy = block_diagonal_logits(llm.model, layout)[-1]
    full = causal_logits(llm.model, layout.token_ids)[-1]
    none = llm.generate(prompt, max_new_tokens=1, recovery=f"{selector}0", output_first_logits=True)
    assert rel_err(none.first_logits, lazy) < 1e-4 and none.stats.recomputed_tokens == 0
    for mode in ("lazy", "block"):
        every = llm.generate(prompt, max_new_tokens=1, mode=mode, recovery=f"{selector}100", output_first_logits=True)
        assert rel_err(every.first_logits, full) < 1e-4
        assert every.stats.recomputed_tokens == 83 and every.stats.cached_tokens == 0
        # admitted as full re-encoding: no chunk is read (the pool holds them from the run above)
        assert every.stats.chunk_sources == {}, mode
    assert llm.stats()["pages_private"] == 0


@pytest.mark.parametrize("recovery", ["prophet25", "cacheblend30", "epic3+prophet30", "epic2+cacheblend20+ape0.8s1.2"])
def test_lazy_equals_block_for_the_same_recovery_and_the_pool_is_untouched(llm, prompt, recovery):
    a = llm.generate(prompt, max_new_tokens=5, recovery=recovery, output_first_logits=True)
    b = llm.generate(prompt, max_new_tokens=5, mode="block", recovery=recovery, output_first_logits=True)
    assert rel_err(a.first_logits, b.first_logits) < 1e-4 and a.token_ids == b.token_ids
    assert a.stats.recovery == recovery and a.stats.recomputed_tokens > 0
    assert a.stats.cached_tokens + a.stats.computed_tokens == a.stats.prompt_tokens
    # the shared chunk pages were never written: a plain request still matches the oracle
    plain = llm.next_token_logits(prompt)
    assert rel_err(plain, block_diagonal_logits(llm.model, llm.prepare(prompt))[-1]) < 1e-4
    st = llm.stats()
    assert st["pages_private"] == 0  # reserved and compact-run pages all returned
    llm.engine.pm.check()


def test_question_attention_picks_the_tokens_the_question_attends_to_most(llm, prompt, monkeypatch):
    """ProphetKV's rule, computed independently: an eager HF forward under the visibility mask
    (the reused KV), softmax attention of the question tokens (after the last chunk) to each
    chunk token, averaged over layers, heads and question tokens; the top 25% are recomputed."""
    picked = chosen_positions(llm, monkeypatch)
    llm.generate(prompt, max_new_tokens=1, recovery="prophet25")
    layout = llm.prepare(prompt)
    model = llm.model
    allow = visibility_mask(layout).to(model.device)
    mask = torch.zeros(allow.shape, dtype=model.dtype, device=model.device).masked_fill(~allow, torch.finfo(model.dtype).min)
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = model(input_ids=torch.tensor([layout.token_ids], device=model.device), output_attentions=True,
                        position_ids=torch.arange(len(layout.token_ids), device=model.device)[None],
                        attention_mask=mask[None, None])
    finally:
        model.set_attn_implementation(previous)
    last_end = max(s.end for s in layout.spans)
    candidates = [p for s in layout.spans for p in range(s.start, s.end)]
    score = torch.stack([a[0, :, last_end:, candidates].double().mean((0, 1)) for a in out.attentions]).mean(0)
    want = sorted(candidates[j] for j in torch.topk(score, round(0.25 * len(candidates))).indices.tolist())
    assert picked == [want]


def test_kv_deviation_picks_the_tokens_whose_cached_kv_deviates_most(llm, prompt, monkeypatch):
    """CacheBlend's rule, computed independently: layer-1 K/V of a plain causal HF forward over
    the prompt vs each chunk's own KV encoded alone (both at logical rotation), relative squared
    deviation of K plus that of V; the top 30% are recomputed."""
    picked = chosen_positions(llm, monkeypatch)
    llm.generate(prompt, max_new_tokens=1, recovery="cacheblend30")
    layout = llm.prepare(prompt)
    model, dev = llm.model, llm.model.device
    with torch.no_grad():
        cache = model(input_ids=torch.tensor([layout.token_ids], device=dev), use_cache=True).past_key_values
    full_k, full_v = cache.layers[1].keys[0].transpose(0, 1).double(), cache.layers[1].values[0].transpose(0, 1).double()
    rope = llm.host.pool_rope
    positions, dev_scores = [], []
    for span in layout.spans:
        kv = llm.encode_chunk(span.token_ids)
        pos = torch.arange(span.start, span.end, device=dev)
        k = rope.rotate(kv.k[1].to(dev), pos).double()
        v = kv.v[1].to(dev).double()
        fk, fv = full_k[span.start:span.end], full_v[span.start:span.end]
        dev_scores.append((fk - k).pow(2).sum((1, 2)) / k.pow(2).sum((1, 2)) + (fv - v).pow(2).sum((1, 2)) / v.pow(2).sum((1, 2)))
        positions += list(range(span.start, span.end))
    score = torch.cat(dev_scores)
    want = sorted(positions[j] for j in torch.topk(score, round(0.3 * len(positions))).indices.tolist())
    assert picked == [want]


@pytest.mark.parametrize("family, hidden", [("llama", 64), ("qwen2", 64), ("qwen3", 64), ("llama", 128)])
def test_ape_matches_an_hf_forward_with_ape_attention(family, hidden, device):
    # head_dim 16 takes the engine's torch attention everywhere; head_dim 32 the kernels on CUDA
    llm = small_llm(tiny_model(family, "default", seed=4, hidden_size=hidden).to(device), IdTokenizer(), page_size=4)
    rng = random.Random(2)
    segs = [_ids(rng, 5), Chunk(_ids(rng, 30)), _ids(rng, 2), Chunk(_ids(rng, 9)), _ids(rng, 7)]
    layout = llm.prepare(segs)
    plain = block_diagonal_logits(llm.model, layout)[-1]
    assert rel_err(llm.next_token_logits(segs, recovery="ape1"), plain) < 1e-4
    for t, s in ((0.8, 1.0), (0.6, 1.5)):
        got = llm.next_token_logits(segs, recovery=f"ape{t}s{s}")
        assert rel_err(got, ape_logits(llm.model, layout, t, s)[-1]) < 1e-4
        assert rel_err(got, plain) > 1e-3  # it does change the answer
    # generated tokens attend APE-style too: greedy tokens equal the oracle's, step by step
    res = llm.generate(segs, max_new_tokens=4, recovery="ape0.7s1.3")
    for i, tok in enumerate(res.token_ids):
        fed = llm.prepare(segs + [res.token_ids[:i]]) if i else layout
        assert int(ape_logits(llm.model, fed, 0.7, 1.3)[-1].argmax()) == tok


def test_recovery_needs_a_chunk_mode(llm, prompt):
    with pytest.raises(LazyRagError, match="use mode lazy or block"):
        llm.generate(prompt, max_new_tokens=1, mode="full", recovery="prophet20")
    with pytest.raises(LazyRagError, match="disagrees"):
        llm.generate(prompt, max_new_tokens=1, recovery="epic4", boundary_recompute=8)


def test_an_index_records_its_default_recovery_and_queries_can_override_it(tmp_path, smollm2):
    from typer.testing import CliRunner

    from lazy_rag import LazyIndex
    from lazy_rag.cli import app

    docs = ["The Marrow Point Lighthouse was completed in 1871 by the engineer Agnes Thorold.",
            "Kestrel Street Bakery opens at six in the morning and closes on Mondays."]
    index = LazyIndex.from_texts(docs, tmp_path / "idx", llm=smollm2, split=False, progress=False, recovery="prophet50")
    assert index.manifest["query_defaults"] == {"recovery": "prophet50"}
    q = "When was the lighthouse completed?"
    res = index.query(q, top_k=2, max_new_tokens=3)
    assert res.stats["recovery"] == "prophet50" and res.stats["recomputed_tokens"] > 0
    assert index.query(q, top_k=2, max_new_tokens=3, mode="full").stats["recovery"] == ""  # nothing to recover
    assert index.query(q, top_k=2, max_new_tokens=3, recovery="none").stats["recomputed_tokens"] == 0
    assert index.query(q, top_k=2, max_new_tokens=3, boundary_recompute=2).stats["recovery"] == "epic2"
    # an index written before recovery options recorded only boundary_recompute
    index.manifest["query_defaults"] = {"boundary_recompute": 4}
    assert index.recovery == Recovery(boundary=4)
    out = CliRunner().invoke(app, ["query", str(tmp_path / "idx"), q, "--max-new-tokens", "2", "--recovery",
                                   "cacheblend50+ape0.9", "--device", "cpu"])
    assert out.exit_code == 0 and "(lazy+cacheblend50+ape0.9)" in out.output, out.output
    out = CliRunner().invoke(app, ["query", str(tmp_path / "idx"), q, "--recovery", "magic"])
    assert out.exit_code == 2 and "Unknown recovery option 'magic'" in out.output
