"""Faults inside the engine hit only the request they belong to: a chunk store that raises on
read, an exception in one request's forward, out of memory while preparing one request, a
request too large for the pool. That request fails with a clear error; every other request's
greedy tokens equal its uninterrupted ones; no page leaks; the engine goes on serving. And a
soak: hundreds of random requests over a tight pool with aborts and injected faults (soak.py)."""
import gc
import random

import pytest
import torch

from lazy_rag.engine import Engine, EngineConfig
from lazy_rag.errors import RequestFailedError
from lazy_rag.bench.soak import (FAULT_MESSAGES, FAULTS, FaultInjector, faulty_request, page_leaks, run_soak,
                                 uninterrupted_tokens, with_random_modes)
from tests.engine.test_engine_cpu import workload
from tests.helpers import small_llm
from tests.tiny_models import tiny_model


@pytest.fixture(scope="module")
def llm(tokenizer, device):
    llm = small_llm(tiny_model("llama", "llama3", seed=3, hidden_size=128).to(device), tokenizer)
    llm.eos_ids = set()
    return llm


def engine(llm, **options) -> Engine:
    return Engine(llm.host, EngineConfig(**{"num_pages": 200, "page_size": 4, "max_num_seqs": 8,
                                            "max_batched_tokens": 96, **options}))


def solo_tokens(llm, reqs):
    eng = engine(llm, num_pages=400)
    return [eng.generate([dict(segments=s, mode="lazy", max_new_tokens=m)])[0].token_ids for s, m in reqs]


def assert_no_leak(eng):
    assert page_leaks(eng) == {"pages_private": 0, "pages_unaccounted": 0, "pages_in_use_after_clear": 0}


def run_all(eng, specs):
    handles = [eng.submit(**s) for s in specs]
    eng.run_until_done()
    return handles


def reuse_output_buffers(eng):
    """Make the runner return logits the way a CUDA-graph decode does, on any device: in a buffer
    that its next run overwrites (one per shape, as one graph per batch shape)."""
    run, buffers = eng.runner.run, {}

    def run_into_buffer(seqs):
        out = run(seqs)
        buf = buffers.setdefault(tuple(out.shape), torch.empty_like(out))
        return buf.copy_(out)

    eng.runner.run = run_into_buffer


@pytest.mark.parametrize("fault", ["store", "forward", "forward_reused_outputs", "oom", "too_large"])
def test_a_fault_fails_only_its_request(llm, fault):
    """``forward_reused_outputs``: after a batch's forward fails, the engine runs its requests one
    by one; on CUDA their decodes replay one graph whose output buffer each replay overwrites
    (the CPU test reproduces that), so each request's logits must be kept before the next runs."""
    reqs = workload(6, seed=7)
    want = solo_tokens(llm, reqs)
    eng = engine(llm)
    if fault == "forward_reused_outputs":
        reuse_output_buffers(eng)
        fault = "forward"
    specs = [dict(segments=s, mode="lazy", max_new_tokens=m) for s, m in reqs]
    bad = 2
    pool_tokens = eng.pool.num_pages * eng.pool.page_size
    specs[bad]["segments"], source, _ = faulty_request(fault, specs[bad]["segments"], "lazy", pool_tokens, serial=0)
    if source is not None:
        specs[bad]["source"] = source
    handles = [eng.submit(**s) for s in specs]
    injector = FaultInjector(eng)  # forward and oom: injected inside the engine
    injector.fail(handles[bad].seq.id, fault)
    eng.run_until_done()
    for i, h in enumerate(handles):
        if i == bad:
            assert h.result is None and isinstance(h.error, RequestFailedError)
        else:
            assert h.error is None and h.result.token_ids == want[i], i
    expected = FAULT_MESSAGES[fault]
    assert expected in str(handles[bad].error)
    with pytest.raises(RequestFailedError, match=expected):  # the caller's view: one clear error
        list(eng.pieces(handles[bad]))
    assert eng.stats()["failed_requests"] == 1
    injector.remove()
    assert_no_leak(eng)
    # and the engine goes on serving
    assert eng.generate([dict(segments=reqs[0][0], mode="lazy", max_new_tokens=reqs[0][1])])[0].token_ids == want[0]
    with pytest.raises(RequestFailedError, match="1 of 2 requests failed"):
        eng.generate([dict(segments=reqs[1][0], max_new_tokens=2),
                       dict(segments=[list(range(300, 1200))], max_new_tokens=2)])


def test_soak_random_requests_aborts_and_faults_over_a_tight_pool(llm):
    """180 requests over a pool of about three requests' pages (preemption, eviction) and a host
    tier of ~4 chunks, with aborts and every kind of fault (benchmarks/reliability_soak.py runs
    the same soak with thousands of requests and records the figures)."""
    requests = with_random_modes(workload(60, seed=11, num_chunks=10), seed=11)
    want = uninterrupted_tokens(engine(llm, num_pages=600), requests)
    eng = engine(llm, num_pages=40, max_num_seqs=6, host_bytes=4 * 13 * llm.shape.kv_bytes_per_token * 4)
    counts = run_soak(eng, requests, want, 180, random.Random(11), fault_rate=0.1)
    assert (counts.mismatched, counts.failed_unexpected, counts.faults_not_raised,
            counts.host_bound_violations) == (0, 0, 0, 0), counts.examples
    assert set(counts.faults) == set(FAULTS) and counts.failed_injected == sum(counts.faults.values())
    assert counts.finished + counts.aborted + counts.failed_injected == counts.submitted == 180
    assert counts.finished > 100 and counts.aborted > 20 and set(counts.modes) == {"lazy", "block", "prefix", "full"}
    assert eng.tiers.host.evictions > 0  # the bound was exercised
    assert page_leaks(eng) == {"pages_private": 0, "pages_unaccounted": 0, "pages_in_use_after_clear": 0}


def _tokens(eng, reqs):
    return [h.result.token_ids for h in run_all(eng, [dict(segments=s, mode="lazy", max_new_tokens=m)
                                                       for s, m in reqs])]


def _graph_in_a_holder() -> list:
    """[a captured CUDA graph], held by nothing else."""
    x = torch.zeros(1, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x.add_(1)
    return [graph]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs (tests/gpu_parity.sh)")
def test_a_graph_collected_during_a_capture_leaves_the_capture_whole(llm):
    """torch no longer collects garbage before a capture, and a collection inside one that frees
    a graph (a dropped engine's, held in a reference cycle: the fault soak met it) destroys that
    graph mid-capture, which CUDA refuses and which invalidates the capture. Here the first
    decode capture drops a graph into a fresh cycle and asks for a collection at the next
    allocation: the capture must still succeed (the collector waits until it ends)."""
    reqs = workload(4, seed=5)
    want = _tokens(engine(llm, cuda_graphs=False), reqs)
    eng = engine(llm)
    graphs = eng.runner.graphs
    forward, holder, dropped = graphs.packed_forward, _graph_in_a_holder(), []

    def drop_a_graph_in_the_first_capture(buf, key, num_layers=None):
        if torch.cuda.is_current_stream_capturing() and not dropped:
            dropped.append(key)
            cycle = [holder.pop()]
            cycle.append(cycle)      # only the collector can free it now
            del cycle
            threshold = gc.get_threshold()
            gc.set_threshold(1)      # a young-generation collection at the next allocation
            try:
                out = forward(buf, key, num_layers)
            finally:
                gc.set_threshold(*threshold)
            return out
        return forward(buf, key, num_layers)

    graphs.packed_forward = drop_a_graph_in_the_first_capture
    assert _tokens(eng, reqs) == want
    assert len(dropped) == 1 and not holder
    assert not graphs.failed and dropped[0] in graphs.graphs and graphs.replays > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs (tests/gpu_parity.sh)")
def test_a_failed_capture_runs_its_step_eagerly_and_later_captures_take_a_fresh_pool(llm):
    """A capture invalidated by a call CUDA forbids while capturing (here a synchronize inside
    the first decode capture) fails its capture_end, which leaves the graphs' memory pool marked
    as recording: every later capture into it would fail. The step runs eagerly instead (same
    tokens), that shape is not captured again, and the next shape's capture takes a fresh pool."""
    reqs = workload(4, seed=5)
    want = _tokens(engine(llm, cuda_graphs=False), reqs)
    eng = engine(llm)
    graphs = eng.runner.graphs
    forward, injected = graphs.packed_forward, []

    def synchronize_in_the_first_capture(buf, key, num_layers=None):
        if torch.cuda.is_current_stream_capturing() and not injected:
            injected.append(key)
            torch.cuda.synchronize()
        return forward(buf, key, num_layers)

    graphs.packed_forward = synchronize_in_the_first_capture
    assert _tokens(eng, reqs) == want
    assert graphs.failed == set(injected) and len(injected) == 1
    assert graphs.replays > 0 and graphs.graphs and injected[0] not in graphs.graphs
