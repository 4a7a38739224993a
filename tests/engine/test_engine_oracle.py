"""The engine against the independent reference (an HF forward with a 4-D mask and position ids):
every mode, many requests in flight sharing chunks at different offsets, through ``LazyLLM``.
On the CPU the engine's attention is its vectorised torch path; on CUDA it is the Triton
kernels, SDPA for fresh prefills and CUDA-graph decode (tests/gpu_parity.sh).

A generated token is *oracle-consistent* when, teacher-forcing the engine's own tokens through
the oracle, each one is the oracle's argmax or within ``tol`` of it (a near-tie that fp32
reassociation may flip). The first token's logits must also match the oracle's closely.
"""
import random

import pytest
import torch

from helpers import rel_err
from lazy_rag import Chunk, LazyLLM
from lazy_rag.random_models import IdTokenizer
from lazy_rag.oracle import oracle_gaps, teacher_forced_logits
from tiny_models import tiny_model

MODES = ("lazy", "block", "prefix", "full")


def requests(rng, n, num_chunks, chunk_len, vocab, max_new):
    chunks = [[rng.randrange(100, vocab) for _ in range(rng.randint(*chunk_len))] for _ in range(num_chunks)]
    head = [rng.randrange(100, vocab) for _ in range(7)]
    reqs = []
    for _ in range(n):
        picked = rng.sample(range(num_chunks), 3)   # shared chunks, each at many offsets
        segs = [head] + [Chunk(chunks[c], chunk_id=f"c{c}") for c in picked]
        segs.append([rng.randrange(100, vocab) for _ in range(rng.randint(3, 9))])
        reqs.append((segs, rng.randint(1, max_new)))
    return reqs


def assert_oracle_consistent(llm, reqs, results, mode, logit_tol, tol):
    for (segs, m), res in zip(reqs, results):
        assert len(res.token_ids) == m and res.finish_reason == "length"
        first = teacher_forced_logits(llm, segs, mode, res.token_ids[:1])[0].cpu()
        assert rel_err(res.first_logits, first) < logit_tol, mode
        assert max(oracle_gaps(llm, segs, mode, res.token_ids)) <= tol, mode


def run_concurrently(llm, reqs, mode):
    eng = llm.engine
    handles = [eng.submit(s, mode=mode, max_new_tokens=m, output_first_logits=True) for s, m in reqs]
    eng.run_until_done()
    eng.pm.check()
    return [h.result for h in handles]


@pytest.fixture(scope="module")
def tiny_llm(tokenizer, device):
    # head_dim 32 (the Triton kernels need a multiple of 32), no EOS among random draws
    model = tiny_model("llama", "llama3", seed=5, hidden_size=128).to(device)
    llm = LazyLLM(model, tokenizer, num_pages=160, page_size=8, max_num_seqs=16, max_batched_tokens=256)
    llm.eos_ids = set()  # a random model may pick an EOS id; these tests count tokens
    return llm


@pytest.mark.parametrize("mode", MODES)
def test_engine_is_oracle_consistent_under_concurrency(tiny_llm, mode):
    rng = random.Random(11)
    reqs = requests(rng, 24, num_chunks=6, chunk_len=(5, 30), vocab=40000, max_new=6)
    results = run_concurrently(tiny_llm, reqs, mode)
    assert_oracle_consistent(tiny_llm, reqs, results, mode, logit_tol=1e-4, tol=1e-5)
    st = tiny_llm.engine.stats()
    assert st["pages_private"] == 0
    if mode == "lazy":
        assert st["chunk_hits"] > 0
        # on the kernels, decode steps read the chunks several requests hold once for all of them
        assert (st["shared_chunk_steps"] > 0) == (tiny_llm.engine.pool.device.type == "cuda")


def test_lazyllm_generate_and_stream_go_through_the_engine(tiny_llm):
    rng = random.Random(3)
    (segs, _), = requests(rng, 1, num_chunks=3, chunk_len=(10, 20), vocab=40000, max_new=1)
    res = tiny_llm.generate(segs, max_new_tokens=5, mode="lazy", output_first_logits=True)
    assert res.stats.cached_tokens > 0
    assert sum(res.stats.chunk_sources.values()) == 3
    first = teacher_forced_logits(tiny_llm, segs, "lazy", res.token_ids[:1])[0].cpu()
    assert rel_err(res.first_logits, first) < 1e-4
    stream = tiny_llm.generate(segs, max_new_tokens=5, mode="lazy", stream=True)
    assert "".join(stream) == res.text and stream.result.token_ids == res.token_ids
    assert stream.result.stats.chunk_sources == {"pool": 3}  # all three chunks stayed in the pool
    # a consumer that stops early leaves nothing behind in the engine
    partial = tiny_llm.generate(segs, max_new_tokens=5, mode="block", stream=True)
    next(partial)
    partial.close()
    assert not tiny_llm.engine.scheduler.has_work and tiny_llm.engine.stats()["pages_private"] == 0


def test_boundary_recompute_in_the_engine(tiny_llm):
    """EPIC: each chunk's first tokens recomputed privately while the shared pages hide their
    cached copies for this request only. lazy equals block (which copies, then overwrites);
    recomputing nothing is plain lazy; recomputing everything is a plain causal forward; and
    the shared pages are left as they were (a later plain request still matches the oracle)."""
    rng = random.Random(12)
    reqs = requests(rng, 6, num_chunks=4, chunk_len=(5, 30), vocab=40000, max_new=4)
    eng = tiny_llm.engine
    for skip in (0, 3, 11, 64):
        lazy = eng.generate([dict(segments=s, mode="lazy", max_new_tokens=m, boundary_recompute=skip,
                                  output_first_logits=True) for s, m in reqs])
        block = eng.generate([dict(segments=s, mode="block", max_new_tokens=m, boundary_recompute=skip,
                                   output_first_logits=True) for s, m in reqs])
        for (segs, _), a, b in zip(reqs, lazy, block):
            assert rel_err(a.first_logits, b.first_logits) < 1e-4, skip
            assert a.token_ids == b.token_ids
            layout = tiny_llm.prepare(segs, boundary_recompute=skip)
            assert a.stats.cached_tokens == layout.cached_tokens
            if skip == 0:
                ref = teacher_forced_logits(tiny_llm, segs, "lazy", a.token_ids[:1])[0].cpu()
                assert rel_err(a.first_logits, ref) < 1e-4
            if skip == 64:  # longer than every chunk: everything computed, a causal forward
                ref = teacher_forced_logits(tiny_llm, segs, "full", a.token_ids[:1])[0].cpu()
                assert rel_err(a.first_logits, ref) < 1e-4 and a.stats.cached_tokens == 0
    eng.pm.check()
    assert_oracle_consistent(tiny_llm, reqs, run_concurrently(tiny_llm, reqs, "lazy"), "lazy", 1e-4, 1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="real-shape model on CUDA (tests/gpu_parity.sh)")
@pytest.mark.parametrize("mode", MODES)
def test_real_shape_model_64_concurrent_requests(mode, real_shape_llm):
    rng = random.Random(7)
    reqs = requests(rng, 64, num_chunks=12, chunk_len=(60, 300), vocab=120000, max_new=8)
    results = run_concurrently(real_shape_llm, reqs, mode)
    assert_oracle_consistent(real_shape_llm, reqs, results, mode, logit_tol=1e-3, tol=1e-4)
    st = real_shape_llm.engine.stats()
    assert st["graph_replays"] > 0 and st["pages_private"] == 0
    if mode in ("lazy", "block"):  # their prefill steps were replayed from append graphs
        assert st["append_graph_replays"] > 0
    if mode == "lazy":            # shared-chunk decode steps, replayed from graphs too
        assert st["shared_chunk_steps"] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="real-shape model on CUDA (tests/gpu_parity.sh)")
def test_cold_requests_encode_in_a_graph_and_keep_their_kv(real_shape_llm):
    """A cold lazy request (no tier holds its chunks) encodes them in its own prefill step, which
    replays a CUDA graph with the chunks' K/V captured into a static buffer. Its first token is
    the oracle's, and the KV it kept (host tier) serves a later request exactly."""
    rng = random.Random(9)
    reqs = requests(rng, 4, num_chunks=12, chunk_len=(60, 300), vocab=120000, max_new=1)
    eng = real_shape_llm.engine
    for segs, _ in reqs:
        eng.clear_cache()
        before = eng.stats()["encode_graph_replays"]
        cold = real_shape_llm.generate(segs, max_new_tokens=1, mode="lazy", output_first_logits=True)
        assert eng.stats()["encode_graph_replays"] == before + 1
        assert cold.stats.chunk_sources == {"encoded": 3}
        ref = teacher_forced_logits(real_shape_llm, segs, "lazy", cold.token_ids[:1])[0].cpu()
        assert rel_err(cold.first_logits, ref) < 1e-3
        eng.pm.evict_unreferenced()   # the pool forgets the chunks; the host tier keeps their KV
        again = real_shape_llm.generate(segs, max_new_tokens=1, mode="lazy", output_first_logits=True)
        assert again.stats.chunk_sources == {"host": 3}
        assert rel_err(again.first_logits, ref) < 1e-3
    eng.pm.check()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs (tests/gpu_parity.sh)")
def test_full_prefills_and_recompute_all_replay_a_graph(real_shape_llm):
    """A full-mode prefill of up to 2,048 tokens, and a chunk request recomputing every chunk token
    (admitted as full re-encoding), replay an append graph (the kernel over the request's own
    pages) instead of an eager step; the first token is the oracle's causal forward's."""
    rng = random.Random(13)
    reqs = requests(rng, 3, num_chunks=6, chunk_len=(60, 300), vocab=120000, max_new=1)
    eng = real_shape_llm.engine
    for segs, _ in reqs:
        for opts in (dict(mode="full"), dict(mode="lazy", recovery="prophet100"), dict(mode="block", recovery="prophet100")):
            before = eng.stats()["append_graph_replays"]
            res = real_shape_llm.generate(segs, max_new_tokens=1, output_first_logits=True, **opts)
            assert eng.stats()["append_graph_replays"] == before + 1, opts
            ref = teacher_forced_logits(real_shape_llm, segs, "full", res.token_ids[:1])[0].cpu()
            assert rel_err(res.first_logits, ref) < 1e-3, opts
    eng.pm.check()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused norm runs on CUDA only (tests/gpu_parity.sh)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_rms_norm_rounds_like_every_familys_module(dtype):
    """ModelParts.norm on CUDA (torch's fused rms_norm, then the module's weight multiply) against
    each supported family's own RMSNorm module: equal up to the fp32 sum order (a flipped rounding
    of the normalised value, then of the weight product: <= 2 units in the last place of a 16-bit
    output; fp32, whose last place is finer than the kernel's rsqrt: <= 8), for hidden states
    and per-head q/k shapes."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.mistral.modeling_mistral import MistralRMSNorm
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    from lazy_rag.architecture import ModelParts

    gen = torch.Generator().manual_seed(0)
    for cls in (LlamaRMSNorm, MistralRMSNorm, Qwen2RMSNorm, Qwen3RMSNorm):
        for shape in ((1, 4096), (97, 576), (33, 8, 128), (5, 3, 64)):
            m = cls(shape[-1], eps=1e-6).to("cuda", dtype)
            with torch.no_grad():
                m.weight.copy_(1 + 0.1 * torch.randn(shape[-1], generator=gen))
            x = (3 * torch.randn(*shape, generator=gen)).to("cuda", dtype)
            want, got = m(x), ModelParts.norm(m, x)
            assert got.dtype == want.dtype and got.shape == want.shape
            # fp32: the fused kernel's own rsqrt and sum order, a few units in the last place
            units = 2 if dtype != torch.float32 else 8
            ulp = torch.finfo(dtype).eps * want.float().abs().clamp_min(torch.finfo(dtype).tiny)
            err = ((got.float() - want.float()).abs() / ulp).max().item()
            assert err <= units, (cls.__name__, shape, dtype, f"{err:.1f} units in the last place")


@pytest.fixture(scope="module")
def real_shape_llm():
    """Llama-3.1-8B's layer shapes (GQA 32/8, head_dim 128, llama3 RoPE), 2 layers, random fp32
    weights: the kernels' real tiling and GQA grouping with an exact (fp32) comparison."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=2, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, max_position_embeddings=131072,
                      rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 8192})
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).eval()
    return LazyLLM(model, IdTokenizer(), kv_bytes=4 << 30, page_size=64, max_num_seqs=64)


def test_prefix_hit_followed_by_a_long_tail_matches_the_oracle(tiny_llm):
    """Prefix mode reuses whole blocks, then computes 150+ tokens: those go through SDPA over
    the gathered pages with a lower-right causal mask (model_runner.contiguous_pages)."""
    rng = random.Random(5)
    shared = [rng.randrange(100, 40000) for _ in range(45)]
    first = [shared, [rng.randrange(100, 40000) for _ in range(5)]]
    second = [shared, [rng.randrange(100, 40000) for _ in range(170)]]
    eng = tiny_llm.engine
    before = eng.stats().get("prefix_hit_tokens", 0)
    results = run_concurrently(tiny_llm, [(first, 2)], "prefix") + run_concurrently(tiny_llm, [(second, 3)], "prefix")
    assert eng.stats()["prefix_hit_tokens"] - before >= 40  # 5 blocks of 8 reused by the second
    assert results[1].stats.cached_tokens >= 40
    assert_oracle_consistent(tiny_llm, [(first, 2), (second, 3)], results, "prefix", logit_tol=1e-4, tol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_teacher_forced_scoring_equals_the_oracle(tiny_llm, mode):
    """score_rows / score_fn: the logits of a prompt's last rows, computed with the prompt's own
    answer appended as uncached text, are the oracle's teacher-forced logits on that answer; the
    scoring requests run batched with ordinary ones, which keep their own first logits."""
    rng = random.Random(17)
    reqs = requests(rng, 6, num_chunks=4, chunk_len=(5, 25), vocab=40000, max_new=1)
    answers = [[rng.randrange(100, 40000) for _ in range(rng.randint(1, 7))] for _ in reqs]
    eng = tiny_llm.engine
    scored = [eng.submit(segs + [ans[:-1]] if len(ans) > 1 else segs, mode=mode, max_new_tokens=1,
                         score_rows=len(ans), score_fn=lambda rows: rows.cpu())
              for (segs, _), ans in zip(reqs, answers)]
    plain = [eng.submit(segs, mode=mode, max_new_tokens=2, output_first_logits=True) for segs, _ in reqs]
    eng.run_until_done()
    eng.pm.check()
    for (segs, _), ans, h, p in zip(reqs, answers, scored, plain):
        want = teacher_forced_logits(tiny_llm, segs, mode, ans).cpu()
        assert h.result.score.shape == want.shape
        assert rel_err(h.result.score, want) < 1e-4, mode
        assert rel_err(p.result.first_logits, want[0]) < 1e-4, mode
        assert p.result.score is None and len(p.result.token_ids) == 2


def test_scoring_rows_must_be_uncached_text(tiny_llm):
    from lazy_rag.errors import LazyRagError

    rng = random.Random(2)
    (segs, _), = requests(rng, 1, num_chunks=3, chunk_len=(5, 9), vocab=40000, max_new=1)
    tail = len(segs[-1])
    with pytest.raises(LazyRagError, match="score_rows"):
        tiny_llm.engine.submit(segs, max_new_tokens=1, score_rows=tail + 1, score_fn=lambda r: r)
    with pytest.raises(LazyRagError, match="score_fn"):
        tiny_llm.engine.submit(segs, max_new_tokens=1, score_rows=1)
