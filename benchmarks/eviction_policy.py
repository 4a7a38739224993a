"""Which eviction policy for the chunk pages of the GPU pool: LRU, LFU or GDSF, by hit ratio.

Runs the engine's own ``PageManager`` over a ``PagePool`` of the real page count and page size
but one-element pages (no model, CPU, seconds): the paper's request stream (100 documents of
2048 tokens, 5 per request, Zipf a=2.1 or uniform), ``--concurrency`` requests in flight (each
holds its chunks and one private page until it completes, first in first out), a KV budget of
``fit`` chunks plus the private pages. The hit ratio is what decides TTFT under memory pressure
(a miss is a host-to-GPU transfer or an encode).

    python benchmarks/eviction_policy.py [--requests 2000] [--concurrency 32]
"""
from __future__ import annotations

import argparse
from collections import deque
from pathlib import Path

from lazy_rag.bench.records import environment, format_table, write_records

RESULTS = Path(__file__).resolve().parent / "results"


def simulate(policy: str, fit: int, requests, doc_tokens: int, page_size: int, concurrency: int) -> dict:
    from lazy_rag.engine.page_manager import PageManager
    from lazy_rag.engine.page_pool import OutOfPages, PagePool

    pages_per_doc = -(-doc_tokens // page_size)
    pool = PagePool(1, fit * pages_per_doc + concurrency, 1, page_size, 1)
    bm = PageManager(pool, policy)
    running: deque = deque()
    hits = misses = 0

    def finish_oldest():
        held, private = running.popleft()
        bm.release_all(held)
        bm.free(private)

    for doc_ids in requests:
        if len(running) == concurrency:
            finish_oldest()
        held = []
        for d in doc_ids:
            key = ("chunk", d)
            e = bm.lookup(key)
            if e is not None:
                held.append(bm.acquire(e))
                hits += 1
                continue
            misses += 1
            while True:
                try:
                    held.append(bm.insert(key, doc_tokens))
                    break
                except OutOfPages:  # the engine would wait for (or preempt) a running request
                    finish_oldest()
        while True:
            try:
                private = bm.allocate(1)
                break
            except OutOfPages:
                finish_oldest()
        running.append((held, private))
    while running:
        finish_oldest()
    bm.check()
    return {"hits": hits, "misses": misses, "gpu_hit_ratio": round(hits / (hits + misses), 4),
            "evictions": bm.counters["evictions"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--budgets", default="10,25,50,75")
    ap.add_argument("--policies", default="lru,lfu,gdsf")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--out", default="eviction_policy")
    args = ap.parse_args()
    import numpy as np

    from lazy_rag.bench.workload import WorkloadSpec, make_workload

    env = environment()
    records = []
    for popularity in ("zipf", "uniform"):
        spec = WorkloadSpec(requests=args.requests, popularity=popularity, doc_tokens=2048)
        wl = make_workload(spec, np.arange(1000, 2000))
        stream = [r.doc_ids for r in wl.requests]
        for fit in [int(b) for b in args.budgets.split(",")]:
            for policy in args.policies.split(","):
                rec = {"benchmark": "eviction_policy", "mode": "lazy", "device": "simulated (PageManager, CPU)",
                       "policy": policy, "popularity": popularity, "zipf_a": spec.zipf_a, "docs": spec.docs,
                       "doc_tokens": spec.doc_tokens, "k": spec.k, "budget_chunks": fit,
                       "budget_fraction": fit / spec.docs, "concurrency": args.concurrency,
                       "requests": args.requests, "page_size": args.page_size,
                       **simulate(policy, fit, stream, spec.doc_tokens, args.page_size, args.concurrency),
                       "date": env["date"]}
                records.append(rec)
    path = write_records(RESULTS / f"{args.out}.json", records)
    print(f"-> {path}")
    print(format_table(records, ["popularity", "budget_chunks", "policy", "gpu_hit_ratio", "evictions"]))


if __name__ == "__main__":
    main()
