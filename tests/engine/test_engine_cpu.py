"""The whole engine with a tiny model (on the CPU its attention is the vectorised torch path):
every mode's greedy tokens equal the HF oracle's, alone, under concurrency, eviction and
preemption; streaming, stop strings, the decode-graph inputs and admission accounting."""
import asyncio
import random

import pytest
import torch

from lazy_rag.bench.soak import chunk_workload
from tests.helpers import small_llm
from lazy_rag.engine import Engine, EngineConfig
from lazy_rag.errors import InvalidRequestError
from lazy_rag.oracle import greedy_block_diagonal, greedy_causal
from lazy_rag.requests import SamplingParams
from lazy_rag.segments import Chunk
from tests.tiny_models import tiny_model

MODES = ("lazy", "block", "prefix", "full")


@pytest.fixture(scope="module")
def llm(tokenizer, device):
    # head_dim 32: the Triton kernels need a multiple of 32 (the decode-graph inputs run them, and
    # this file also runs on CUDA)
    llm = small_llm(tiny_model("llama", "llama3", seed=3, hidden_size=128).to(device), tokenizer)
    llm.eos_ids = set()  # a random model may pick an EOS id; these tests count tokens
    return llm


def engine(llm, **options) -> Engine:
    return Engine(llm.host, EngineConfig(**options))


def workload(n, seed=0, num_chunks=6):
    return chunk_workload(n, seed, num_chunks, max_chunk_len=13, max_new=6)


def oracle(llm, reqs, mode):
    """Greedy tokens of the independent HF reference (the whole prompt recomputed every step)."""
    if mode in ("lazy", "block"):
        return [greedy_block_diagonal(llm.model, llm.prepare(s), m) for s, m in reqs]
    return [greedy_causal(llm.model, llm.prepare(s).token_ids, m) for s, m in reqs]


@pytest.mark.parametrize("mode", MODES)
def test_engine_matches_lazyllm_in_every_mode_with_eviction_and_preemption(llm, mode):
    reqs = workload(6, seed=1)
    want = oracle(llm, reqs, mode)
    # a roomy pool, then one that holds about two requests: evictions and preemptions happen
    for num_pages, max_seqs in ((400, 8), (24, 8)):
        eng = engine(llm, num_pages=num_pages, page_size=4, max_num_seqs=max_seqs, max_batched_tokens=96)
        got = [r.token_ids for r in eng.generate(
            [dict(segments=s, mode=mode, max_new_tokens=m) for s, m in reqs])]
        assert got == want, (mode, num_pages)
        eng.pm.check()
        st = eng.stats()
        assert st["pages_private"] == 0 and st["pages_in_use"] == st["pages_cached"]
        if num_pages == 24 and mode != "full":  # full mode has nothing to evict
            assert st["preemptions"] + st.get("evictions", 0) > 0
    if mode == "lazy":
        assert st["chunk_hits"] > 0 and st["tier_encoded"] <= 6
    if mode == "prefix":
        assert st["prefix_hit_tokens"] > 0


def test_stream_and_stop_strings(llm):
    segs, _ = workload(1, seed=5)[0]
    ref = llm.generate(segs, max_new_tokens=6)
    eng = engine(llm, num_pages=64, page_size=4)
    h = eng.submit(segs, max_new_tokens=6)

    async def collect():
        return [p async for p in eng.stream(h)]

    pieces = asyncio.run(collect())
    assert "".join(pieces) == ref.text and h.result.token_ids == ref.token_ids
    if len(ref.text) > 2:
        stop = ref.text[1:3]
        want = llm.generate(segs, max_new_tokens=6, stop=stop)
        got = eng.generate([dict(segments=segs, max_new_tokens=6, stop=stop)])[0]
        assert (got.text, got.finish_reason) == (want.text, want.finish_reason)


def test_sampling_params_are_the_one_set_of_sampling_options_and_defaults(llm):
    """``sampling=SamplingParams(...)`` and its keyword shorthand give the same request, at every
    layer; a keyword given beside ``sampling`` replaces that field; the defaults are
    SamplingParams' (128 new tokens, greedy) in LazyLLM.generate and Engine.submit alike."""
    segs, _ = workload(1, seed=6)[0]
    sampling = SamplingParams(max_new_tokens=4, stop=("zz",))
    by_params = llm.generate(segs, sampling=sampling)
    assert by_params.token_ids == llm.generate(segs, max_new_tokens=4, stop="zz").token_ids
    assert len(llm.generate(segs, sampling=sampling, max_new_tokens=2).token_ids) == 2
    eng = engine(llm, num_pages=64, page_size=4)
    assert eng.submit(segs).seq.params == SamplingParams() and SamplingParams().max_new_tokens == 128
    assert eng.submit(segs, temperature=0.5, sampling=sampling).seq.params == \
        SamplingParams(max_new_tokens=4, temperature=0.5, stop=("zz",))
    with pytest.raises(InvalidRequestError, match="max_new_tokens"):
        eng.submit(segs, max_new_tokens=0)


@pytest.mark.parametrize("shared_chunks", ["off", "on"])
def test_decode_graph_inputs_reproduce_the_eager_step(llm, shared_chunks):
    """The CUDA-graph decode path minus the capture: packing a step into one buffer (padded to
    its batch bucket, page table padded to its pages bucket, padding rows on the scratch page)
    and running the packed forward gives the eager step's logits and leaves owned pages alone.
    shared_chunks="on": the step's chunks go through the shared-chunk decode (grouped by chunk,
    its arrays padded to their buckets) and still give the eager per-sequence step's logits."""
    from lazy_rag.engine.cuda_graphs import DecodeGraphs, batch_bucket
    from lazy_rag.engine.page_table import is_decode_step, write_targets

    assert [batch_bucket(n) for n in (1, 2, 3, 5, 8, 9, 17)] == [1, 2, 4, 8, 8, 16, 24]
    reqs = workload(3, seed=4)
    eng = engine(llm, num_pages=200, page_size=4, max_num_seqs=8)
    for segs, _ in reqs:
        eng.submit(segs, mode="lazy", max_new_tokens=8)
    while True:  # run until a step is decodes only
        step = eng.scheduler.schedule()
        seqs = step.prefill + step.decode
        if not step.prefill and is_decode_step(seqs):
            break
        for seq in step.prefill:
            eng.planner.materialize(seq)
        logits = eng.runner.run(seqs).cpu()
        for seq in step.prefill:
            seq.needs_prefill = False
            eng.planner.publish_encoded(seq)  # the chunks its prefill encoded go to the cache (Engine.step)
        for row, seq in zip(logits, seqs):
            seq.kv_len = seq.num_tokens
            eng._accept(seq, row)
    graphs = DecodeGraphs(eng.runner, page_step=4, shared_chunks=shared_chunks)
    pool = eng.pool
    owned = [p for p in range(pool.num_pages) if pool.is_used(p)]
    before = pool.k[:, owned].clone()
    buf, key = graphs.pack(seqs)
    B, P, shared_key = key
    assert B == batch_bucket(len(seqs)) == 4 and P % 4 == 0
    assert (shared_key is None) == (shared_chunks == "off")
    packed = graphs.packed_forward(buf.to(pool.device), key)[:len(seqs)]
    # the eager step writes the same K/V again (same tokens, same slots) and must agree
    eng.runner.graphs = None
    eager = eng.runner.run(seqs)
    assert (packed - eager).abs().max() < 1e-5
    slots = {(page, slot) for s in seqs for page, slot, _ in write_targets(s, s.compute_pos, 4)}
    after = pool.k[:, owned]
    for i, page in enumerate(owned):  # only the new tokens' slots changed
        for off in range(4):
            if (page, off) not in slots:
                # bitwise: a never-written slot of the CPU pool (allocated uninitialised) may hold NaNs
                assert torch.equal(after[:, i, :, off].contiguous().view(torch.uint8),
                                   before[:, i, :, off].contiguous().view(torch.uint8))


def _first_prefill_step(eng, reqs, mode):
    for segs, _ in reqs:
        eng.submit(segs, mode=mode, max_new_tokens=4)
    step = eng.scheduler.schedule()
    for seq in step.prefill:
        eng.planner.materialize(seq)
    return step.prefill + step.decode


def test_append_graph_inputs_reproduce_the_eager_step(llm):
    """The CUDA-graph append path minus the capture: a prefill step of lazy requests packed into
    one buffer (tokens padded to their bucket by a padding sequence on the scratch page, page table
    and query-tile plan padded) and run through the packed forward (the Triton prefill kernel, in
    the interpreter here) gives the eager step's logits and writes only the new tokens' slots."""
    from lazy_rag.engine.cuda_graphs import TOKEN_BUCKETS, AppendGraphs, token_bucket
    from lazy_rag.engine.page_table import write_targets

    assert [token_bucket(n) for n in (1, 16, 17, 100, 2048, 2049)] == [16, 16, 32, 128, 2048, 3072]
    assert token_bucket(100, max_tokens=64) is None
    assert token_bucket(TOKEN_BUCKETS[-1] + 1) is None
    assert all(b / a <= 1.5 for a, b in zip(TOKEN_BUCKETS[1:], TOKEN_BUCKETS[2:]))
    eng = engine(llm, num_pages=200, page_size=4, max_num_seqs=8)
    reqs = workload(3, seed=6)
    # chunks cached first: a step of requests that encode a chunk in their prefill runs eagerly
    eng.generate([dict(segments=s, mode="lazy", max_new_tokens=1) for s, _ in reqs])
    seqs = _first_prefill_step(eng, reqs, "lazy")
    assert len(seqs) == 3 and all(s.cached_runs and not s.encode_jobs for s in seqs)
    graphs = AppendGraphs(eng.runner, page_step=4)
    packed = graphs.pack(seqs)
    assert packed is not None
    buf, key = packed
    n = sum(len(s.compute_pos) for s in seqs)
    assert key.tokens == token_bucket(n) > n and key.batch == 4 and key.pages % 4 == 0
    pool = eng.pool
    owned = [p for p in range(pool.num_pages) if pool.is_used(p)]
    before = pool.k[:, owned].clone()
    got = graphs.packed_forward(buf.to(pool.device), key)[:len(seqs)]
    eng.runner.graphs = eng.runner.append_graphs = None
    eager = eng.runner.run(seqs)
    assert got.shape == eager.shape and (got - eager).abs().max() < 1e-4
    slots = {(page, slot) for s in seqs for page, slot, _ in write_targets(s, s.compute_pos, 4)}
    after = pool.k[:, owned]
    for i, page in enumerate(owned):  # the padding tokens wrote only the scratch page
        for off in range(4):
            if (page, off) not in slots:
                assert torch.equal(after[:, i, :, off].contiguous().view(torch.uint8),
                                   before[:, i, :, off].contiguous().view(torch.uint8))


@pytest.mark.parametrize("mode", ["full", "prefix"])
def test_fresh_sequences_take_the_append_graphs_up_to_their_limit(llm, mode):
    """A fresh sequence (full mode, a prefix miss) packs into an append graph, the Triton kernel
    over its own pages (the interpreter here), with the eager step's (SDPA's) logits; a step over
    the encoding limit, a batch over the graphs' largest, or an fp8 pool's (whose eager SDPA
    attends to the exact new K/V, the kernel to them quantised) stays eager."""
    from lazy_rag.engine.cuda_graphs import AppendGraphs

    eng = engine(llm, num_pages=200, page_size=4, max_num_seqs=8)
    seqs = _first_prefill_step(eng, workload(2, seed=7), mode)
    n = sum(len(s.compute_pos) for s in seqs)
    graphs = AppendGraphs(eng.runner, page_step=4)
    buf, key = graphs.pack(seqs)
    got = graphs.packed_forward(buf.to(eng.pool.device), key)[:len(seqs)]
    eng.runner.graphs = eng.runner.append_graphs = None
    eager = eng.runner.run(seqs)
    assert got.shape == eager.shape and (got - eager).abs().max() < 1e-4
    assert AppendGraphs(eng.runner, page_step=4, max_encode_tokens=n - 1).pack(seqs) is None
    assert AppendGraphs(eng.runner, page_step=4, max_batch=1).pack(seqs[:1] * 2) is None
    fp8 = engine(llm, num_pages=200, page_size=4, max_num_seqs=8, kv_dtype="fp8")
    assert AppendGraphs(fp8.runner, page_step=4).pack(_first_prefill_step(fp8, workload(2, seed=7), mode)) is None


def test_refused_admission_does_not_turn_its_own_placement_into_a_hit(llm):
    """A chunk placed (from the host tier) by an admission that then ran out of pages is still
    cached; when the same request is admitted later it must count as the miss (and tier) it was,
    not as a pool hit. A lazy request encodes its missing chunks in its own prefill, so a refused
    one has encoded nothing: the chunks are put in the host tier by a first request here."""
    from lazy_rag.engine.sequence import Sequence

    eng = engine(llm, num_pages=6, page_size=4)  # 2 + 2 chunk pages + 2 private (head, question)
    segs = [[300, 301], Chunk(list(range(400, 408)), chunk_id="a"), Chunk(list(range(500, 508)), chunk_id="b"),
            [600, 601, 602]]
    first = eng.generate([dict(segments=segs, mode="lazy", max_new_tokens=1)])[0]
    assert first.stats.chunk_sources == {"encoded": 2}
    eng.pm.evict_unreferenced()            # the pool forgets them; the host tier keeps them
    before = eng.stats()
    seq = Sequence(llm.prepare(segs), "lazy")
    blocker = eng.pm.allocate(3)           # another owner holds 3 of the 6 pages
    assert not eng.planner.admit(seq)      # chunk a placed (2 pages), chunk b does not fit
    assert eng.pm.lookup(next(iter(seq.placed_by_refused))) is not None
    eng.pm.free(blocker)
    assert eng.planner.admit(seq)
    # a: placed by the refused attempt; b: found no pages then, so it was not placed until this one
    assert seq.chunk_sources_seen == ["misses", "from_host", "misses", "from_host"]
    st = eng.stats()
    assert st.get("chunk_hits", 0) == before.get("chunk_hits", 0) == 0
    assert st["chunk_misses"] - before["chunk_misses"] == 2
    assert st["chunk_from_host"] - before.get("chunk_from_host", 0) == 2
    eng.planner.release(seq)
    eng.pm.check()


def test_page_rows_lists_every_page_of_every_run_in_order():
    """page_rows' bulk path for plain runs against the page-by-page definition: every page holding
    a token of the run, at the run's position + i * page_size, with its fill and the run's shift
    (runs of zero tokens, partial last pages and spare pages beyond the run's length included)."""
    from types import SimpleNamespace

    from lazy_rag.engine.page_table import page_rows
    from lazy_rag.engine.sequence import Run

    rng = random.Random(0)
    for _ in range(500):
        ps = rng.choice([1, 4, 16, 64])
        runs, pos = [], 0
        for _ in range(rng.randint(0, 5)):
            n = rng.randint(0, 200)
            pages = tuple(rng.randrange(1000) for _ in range(-(-n // ps) + rng.randint(0, 2)))
            runs.append(Run(pos, n, pages, rng.choice([0, pos])))
            pos += n
        want = ([], [], [], [])
        for run in runs:
            for i in range(-(-run.length // ps)):
                for col, v in zip(want, (run.pages[i], run.pos + i * ps, min(ps, run.length - i * ps), run.rot_shift)):
                    col.append(v)
        seq = SimpleNamespace(cached_runs=runs[:len(runs) // 2], private_runs=runs[len(runs) // 2:])
        assert page_rows(seq, ps) == (*want, None)


def test_a_dropped_runner_is_freed_at_once_despite_its_graphs(llm):
    """The step graphs refer to their runner weakly: dropping an engine frees its page pool by
    reference counting, without waiting for a garbage collection (on the GPU, gigabytes)."""
    import gc
    import weakref

    from lazy_rag.engine.cuda_graphs import AppendGraphs, DecodeGraphs

    eng = engine(llm, num_pages=16, page_size=4)
    runner = eng.runner
    runner.graphs, runner.append_graphs = DecodeGraphs(runner), AppendGraphs(runner)  # as on CUDA
    assert runner.append_graphs.runner.pool is runner.pool
    pool = weakref.ref(runner.pool)
    gc.disable()
    try:
        del eng, runner
        assert pool() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("mode", ["lazy", "block"])
def test_cache_salt_keeps_callers_chunks_apart_and_shares_indexed_ones(llm, mode):
    """A chunk without an id (text the caller sent) is cached under the request's salt: the same
    salt finds it in the pool, another salt (or none) encodes it again, from no tier; a chunk with
    an id (an index's) is shared whatever the salt. The answers do not depend on the salt."""
    eng = engine(llm, num_pages=200, page_size=4)
    own, shared = Chunk(list(range(400, 412))), Chunk(list(range(500, 509)), chunk_id="index-chunk")
    segs = [[300, 301], own, shared, [600, 601]]

    def run(salt):
        return eng.generate([dict(segments=segs, mode=mode, max_new_tokens=3, cache_salt=salt)])[0]

    first = run("tenant-a")
    assert first.stats.chunk_sources == {"encoded": 2}
    again = run("tenant-a")
    assert again.stats.chunk_sources == {"pool": 2} and again.token_ids == first.token_ids
    for salt in ("tenant-b", ""):  # a cold miss for the caller's chunk (not even the host tier has it)
        other = run(salt)
        assert other.stats.chunk_sources == {"encoded": 1, "pool": 1} and other.token_ids == first.token_ids
    eng.pm.check()


def test_cache_salt_keys_prefix_pages(llm):
    """Prefix mode: a prompt's pages are found again only under the salt that cached them."""
    eng = engine(llm, num_pages=200, page_size=4)
    prompt = list(range(300, 330))

    def run(salt):
        return eng.generate([dict(segments=[prompt], mode="prefix", max_new_tokens=2, cache_salt=salt)])[0]

    first = run("a")
    assert first.stats.cached_tokens == 0
    assert run("a").stats.cached_tokens == 28  # every full page but the one holding the last token
    assert run("b").stats.cached_tokens == 0
    assert run("a").token_ids == run("b").token_ids == first.token_ids
