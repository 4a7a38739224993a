"""Faults inside the engine hit only the request they belong to: a chunk store that raises on
read, an exception in one request's forward, out of memory while preparing one request, a
request too large for the pool. That request fails with a clear error; every other request's
greedy tokens equal its uninterrupted ones; no page leaks; the engine goes on serving. And a
soak: hundreds of random requests over a tight pool with aborts and injected faults."""
import random

import pytest
import torch

from lazy_rag.engine import Engine, EngineConfig
from lazy_rag.errors import RequestFailedError
from lazy_rag.requests import ChunkSource
from lazy_rag.segments import Chunk
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
    eng.pm.check()
    st = eng.stats()
    assert st["pages_private"] == 0 and st["pages_in_use"] == st["pages_cached"]
    eng.clear_cache()
    assert eng.stats()["pages_in_use"] == 0


class RaisingStore:
    """A chunk store whose disk is gone."""
    precomputed = True
    shared_prefix_ids = ()

    def read(self, chunk_id, token_ids):
        raise OSError(5, "Input/output error", f"kv/{chunk_id}.safetensors")

    def write_back(self, chunk_id, token_ids, kv):
        raise AssertionError("never reached")


def run_all(eng, specs):
    handles = [eng.submit(**s) for s in specs]
    eng.run_until_done()
    return handles


@pytest.mark.parametrize("fault", ["store", "forward", "oom", "too_large"])
def test_a_fault_fails_only_its_request(llm, fault, monkeypatch):
    reqs = workload(6, seed=7)
    want = solo_tokens(llm, reqs)
    eng = engine(llm)
    specs = [dict(segments=s, mode="lazy", max_new_tokens=m) for s, m in reqs]
    bad = 2
    if fault == "store":
        # a chunk no other request holds (chunks are shared by content): only the store has it
        specs[bad]["segments"] = specs[bad]["segments"][:1] + [Chunk(list(range(7000, 7011)), chunk_id="on-disk")] \
            + specs[bad]["segments"][1:]
        specs[bad]["source"] = ChunkSource((), RaisingStore())
    elif fault == "too_large":
        specs[bad]["segments"] = [list(range(300, 300 + 900))]  # 900 tokens > the 200 x 4-token pool
    handles = [eng.submit(**s) for s in specs]
    bad_id = handles[bad].seq.id
    if fault == "forward":
        real = eng.runner.run

        def run(seqs):
            if any(s.id == bad_id for s in seqs) and len(handles[bad].seq.output) >= 1:
                raise RuntimeError("CUDA error: an illegal memory access (injected)")
            return real(seqs)

        monkeypatch.setattr(eng.runner, "run", run)
    elif fault == "oom":
        real = eng.planner.materialize

        def materialize(seq):
            if seq.id == bad_id:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
            return real(seq)

        monkeypatch.setattr(eng.planner, "materialize", materialize)
    eng.run_until_done()
    for i, h in enumerate(handles):
        if i == bad:
            assert h.result is None and isinstance(h.error, RequestFailedError)
        else:
            assert h.error is None and h.result.token_ids == want[i], i
    expected = {"store": "Input/output error", "forward": "illegal memory access",
                "oom": "out of memory", "too_large": "does not fit"}[fault]
    assert expected in str(handles[bad].error)
    with pytest.raises(RequestFailedError, match=expected):  # the caller's view: one clear error
        list(eng.pieces(handles[bad]))
    assert eng.stats()["failed_requests"] == 1
    monkeypatch.undo()
    assert_no_leak(eng)
    # and the engine goes on serving
    assert eng.generate([dict(segments=reqs[0][0], mode="lazy", max_new_tokens=reqs[0][1])])[0].token_ids == want[0]
    with pytest.raises(RequestFailedError, match="1 of 2 requests failed"):
        eng.generate([dict(segments=reqs[1][0], max_new_tokens=2),
                       dict(segments=[list(range(300, 1200))], max_new_tokens=2)])


def test_soak_random_requests_aborts_and_faults_over_a_tight_pool(llm, monkeypatch):
    rng = random.Random(11)
    reqs = workload(60, seed=11, num_chunks=10)
    modes = [rng.choice(("lazy", "block", "prefix", "full")) for _ in reqs]
    roomy = engine(llm, num_pages=600)
    want = [roomy.generate([dict(segments=s, mode=md, max_new_tokens=m)])[0].token_ids
            for (s, m), md in zip(reqs, modes)]
    # about three requests' worth of pages (preemption, eviction) and a host tier of ~4 chunks
    eng = engine(llm, num_pages=40, max_num_seqs=6, host_bytes=4 * 13 * llm.shape.kv_bytes_per_token * 4)
    faulty = set(rng.sample(range(len(reqs)), 6))
    real = eng.planner.materialize
    ids = {}

    def materialize(seq):
        if ids.get(seq.id) in faulty:
            raise RuntimeError("injected fault")
        return real(seq)

    monkeypatch.setattr(eng.planner, "materialize", materialize)
    finished = failed = aborted = 0
    for round_ in range(3):  # 180 requests in waves of 20, a third of them read partly and closed
        for start in range(0, len(reqs), 20):
            batch = list(range(start, min(start + 20, len(reqs))))
            handles = {}
            for i in batch:
                h = eng.submit(reqs[i][0], mode=modes[i], max_new_tokens=reqs[i][1])
                ids[h.seq.id] = i
                handles[i] = h
            for i in batch:
                if rng.random() < 0.3 and i not in faulty:
                    it = eng.pieces(handles[i])
                    next(it, None)
                    it.close()  # a client that went away
                    aborted += 1
            eng.run_until_done()
            host = eng.tiers.host
            assert host.bytes <= host.max_bytes and host.bytes == sum(host.size_of(v) for v in host._items.values())
            for i in batch:
                h = handles[i]
                if h.error is not None:
                    assert i in faulty
                    failed += 1
                elif h.result is not None:
                    assert h.result.token_ids == want[i], (round_, i, modes[i])
                    finished += 1
    assert failed == 3 * len(faulty) and finished + aborted + failed == 3 * len(reqs)
    assert eng.tiers.host.evictions > 0  # the bound was exercised
    monkeypatch.undo()
    assert_no_leak(eng)
