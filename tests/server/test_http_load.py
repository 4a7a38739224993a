"""``lazy_rag.bench.http_load.run_http``, the HTTP load of the server and scale-out benchmarks,
against a real server: its pool hit ratio comes from each answer's chunk tiers, and requests
before ``count_from`` (the warm-up) are left out of every metric."""
import asyncio

from lazy_rag.bench.http_load import run_http


def test_pool_hit_ratio_and_warmup_from_the_answers(smollm2, start_server):
    server = start_server(smollm2, engine_process=False)

    def requests(tag: str) -> list[dict]:
        docs = [f"Ledger {tag}: the ferry to Port Sallow is painted green.",
                f"Ledger {tag}: the Marrow Point Lighthouse was completed in 1871."]
        return [{"documents": docs, "question": f"Which colour is the ferry? ({i})"} for i in range(3)]

    # one client: the first request encodes both documents, the next two find them in the pool
    every, answers = asyncio.run(run_http(server.base_url, requests("a"), clients=1, max_tokens=2, model="smollm2"))
    assert every["errors"] == 0 and every["counted_requests"] == 3 and all(answers)
    assert every["pool_hit_ratio"] == round(4 / 6, 4)
    assert every["throughput_rps"] > 0 and every["ttft_ms_p50"] > 0
    warm, _ = asyncio.run(run_http(server.base_url, requests("b"), clients=1, max_tokens=2, model="smollm2",
                                   count_from=1))
    assert warm["counted_requests"] == 2 and warm["pool_hit_ratio"] == 1.0
    assert warm["chunks_by_tier"] == '{"pool": 4}'
