"""The paper's workload through the serving engine, every mode, a sweep of KV budgets.

Llama-3.1-8B shape with random bf16 weights built on the device; 100 chunks of 2048 tokens; each
request retrieves 5 (Zipf a=2.1) + a 32-token question, 16 output tokens; all requests submitted
at once (offline). KV budget in "chunks that fit" (1 chunk = 2048 tokens of KV). The host tier is
shared by all runs, so each chunk is encoded once (first run) and later served from pinned memory.
Records pool/hit statistics per mode and budget; spot-checks the first requests' tokens against
the HF oracle (teacher-forced, lazy_rag.oracle.oracle_gaps).

    python benchmarks/engine_workload.py [--requests 120] [--budgets 100,10] [--layers 32]
"""
from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import numpy as np
import torch

from lazy_rag.random_models import IdTokenizer, random_llama31_8b
from lazy_rag.bench.records import environment, format_table, write_records

RESULTS = Path(__file__).resolve().parent / "results"


def zipf_pick(rng: np.random.Generator, n: int, k: int, a: float) -> list[int]:
    w = 1.0 / np.arange(1, n + 1) ** a
    return [int(c) for c in rng.choice(n, size=k, replace=False, p=w / w.sum())]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=120)
    ap.add_argument("--budgets", default="100,10")
    ap.add_argument("--modes", default="lazy,block,prefix,full")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--chunks", type=int, default=100)
    ap.add_argument("--chunk-tokens", type=int, default=2048)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--spot-check", type=int, default=4)
    ap.add_argument("--gap-tol", type=float, default=0.02,
                    help="bf16: a token within this fraction of max |logit| of the oracle's best is a near-tie")
    ap.add_argument("--out", default="engine_workload")
    args = ap.parse_args()
    from lazy_rag import Chunk
    from lazy_rag.engine import Engine, EngineConfig
    from lazy_rag.engine.chunk_tiers import ChunkTiers
    from lazy_rag.model_host import ModelHost
    from lazy_rag.oracle import oracle_gaps

    host = ModelHost(random_llama31_8b(args.layers), IdTokenizer())
    rng = random.Random(0)
    nrng = np.random.default_rng(0)
    chunks = [[rng.randrange(1000, 120000) for _ in range(args.chunk_tokens)] for _ in range(args.chunks)]
    head = [rng.randrange(1000, 120000) for _ in range(16)]
    reqs = []
    for _ in range(args.requests):
        segs = [head] + [Chunk(chunks[c], chunk_id=f"c{c}") for c in zipf_pick(nrng, args.chunks, 5, 2.1)]
        reqs.append(segs + [[rng.randrange(1000, 120000) for _ in range(32)]])
    shp = host.shape
    chunk_bytes = args.chunk_tokens * shp.kv_bytes_per_token * 2
    tiers = ChunkTiers(host_bytes=(args.chunks + 2) * chunk_bytes)
    records = []
    for fit in [int(b) for b in args.budgets.split(",")]:
        for mode in args.modes.split(","):
            # the budget: `fit` chunks + the private KV of one whole request (5 chunks + question +
            # output), so that block/full/prefix, which hold a request's whole prompt privately,
            # can always run one request (block also needs its chunks resident while it copies)
            private = (5 * args.chunk_tokens + 64 + args.page_size * 8) * shp.kv_bytes_per_token * 2
            eng = Engine(host, EngineConfig(kv_bytes=fit * chunk_bytes + private, page_size=args.page_size,
                                            max_num_seqs=args.max_num_seqs, max_batched_tokens=16384), tiers=tiers)
            before = dict(tiers.counters)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            res = eng.generate([dict(segments=s, mode=mode, max_new_tokens=16) for s in reqs])
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
            st = eng.stats()
            # oracle consistency: each generated token teacher-forced through the HF 4-D-mask
            # forward; gap = how far below the oracle's best logit it is (relative to max |logit|)
            gaps = [oracle_gaps(host, reqs[i], mode, res[i].token_ids) for i in range(args.spot_check)]
            flat = [g for row in gaps for g in row]
            rec = {"benchmark": "engine_workload", "mode": mode, "budget_chunks": fit, "requests": len(res),
                   "completed": sum(r is not None and len(r.token_ids) == 16 for r in res),
                   "wall_s": round(wall, 2), "req_per_s": round(len(res) / wall, 2),
                   "ttft_ms_p50": round(float(np.median([r.stats.ttft_ms for r in res])), 1),
                   "spot_checked": len(gaps), "spot_check_argmax_pct": round(100 * sum(g == 0 for g in flat) / max(len(flat), 1), 1),
                   "spot_check_max_gap": round(max(flat, default=0.0), 4),
                   "oracle_consistent": all(g <= args.gap_tol for g in flat),
                   **{k: v for k, v in st.items()},
                   **{f"tier_{k}_delta": tiers.counters[k] - before.get(k, 0) for k in tiers.counters}}
            rec.update(environment())
            records.append(rec)
            print(rec, flush=True)
            write_records(RESULTS / f"{args.out}.json", records)  # after every run: a cut-off sweep keeps what it has
            del eng
            torch.cuda.empty_cache()
    print(format_table(records, ["mode", "budget_chunks", "completed", "wall_s", "req_per_s", "pages_total",
                                 "chunk_hits", "chunk_misses", "evictions", "preemptions", "prefix_hit_tokens",
                                 "spot_check_argmax_pct", "spot_check_max_gap", "oracle_consistent"]))


if __name__ == "__main__":
    main()
