"""A tensor-parallel rank that dies: the requests fail at once with an error naming the rank and
its exit code (no hang), later requests are refused with the same error, and the next
tensor-parallel LazyLLM starts fresh ranks. (Its own module: it kills the shared workers.)"""
import os
import random
import signal
import time

import pytest

from lazy_rag import Chunk, LazyLLM
from lazy_rag.engine.rank_pool import RankPool
from lazy_rag.errors import LazyRagError, RequestFailedError
from lazy_rag.random_models import IdTokenizer
from tiny_models import tiny_model


def test_a_dead_rank_fails_requests_naming_it_and_a_new_llm_recovers():
    rng = random.Random(0)
    segs = [[rng.randrange(100, 4000) for _ in range(4)], Chunk([rng.randrange(100, 4000) for _ in range(12)]),
            [rng.randrange(100, 4000) for _ in range(5)]]
    llm = LazyLLM(tiny_model("llama"), IdTokenizer(), tensor_parallel=2, num_pages=16)
    want = llm.generate(segs, max_new_tokens=2).token_ids
    worker = RankPool.get(2).procs[0]
    handle = llm.engine.submit(segs, max_new_tokens=2)   # in flight when its rank dies
    os.kill(worker.pid, signal.SIGKILL)
    worker.join(10)
    t0 = time.perf_counter()
    llm.engine.run_until_done()
    assert time.perf_counter() - t0 < 10   # found by the closed connection, not the timeout
    assert isinstance(handle.error, RequestFailedError)
    assert "rank 1 (pid" in str(handle.error) and "exited with code -9" in str(handle.error)
    with pytest.raises(LazyRagError, match="rank 1"):
        llm.generate(segs, max_new_tokens=2)
    again = LazyLLM(tiny_model("llama"), IdTokenizer(), tensor_parallel=2, num_pages=16)
    assert again.generate(segs, max_new_tokens=2).token_ids == want


def test_the_in_process_servers_driver_reports_a_dead_rank_as_not_alive():
    """The server's in-process driver has no process to restart: /ready (``alive``) turns 503
    once a rank is gone, found between steps with no request in flight."""
    from lazy_rag.server.driver import EngineDriver

    llm = LazyLLM(tiny_model("llama"), IdTokenizer(), tensor_parallel=2, num_pages=16)
    driver = EngineDriver(llm.engine)
    try:
        assert driver.alive and llm.engine.failure() is None
        worker = RankPool.get(2).procs[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
        assert not driver.alive
        assert "rank 1 (pid" in str(llm.engine.failure())
    finally:
        driver.close()
