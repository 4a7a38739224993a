"""A request's cold chunks read from a quantised store, one by one against all at once
(``ChunkTiers.read_ahead``): the host's part of a cold query, on this machine's disk and CPU.

An fp8 or int4 index's chunks are always read (its answers are its stored KV), so a cold query
waits for its chunks' records: preadv, CRC and copy each. ``--chunks`` records of a model shape's
random KV in ``--kv-dtype``, written by the store; then, ``--rounds`` times each, the engine's tier
fetch of all of them after dropping them from the page cache (cold) or with them in it (page
cache), in turn (``serial``) or read ahead (``read_ahead``). No GPU: placement into a pool is
not timed.

    python3 benchmarks/chunk_reads.py --shape llama-3.1-8b --kv-dtype int4 --chunks 4 --chunk-tokens 256

Records: benchmarks/results/<out>.json (flat: one per mode, cache state and round).
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from lazy_rag.bench.disk import drop_page_cache, read_folder
from lazy_rag.bench.records import environment, format_table, write_records
from lazy_rag.chunk_kv import ChunkKV
from lazy_rag.engine.chunk_tiers import READ_AHEAD_THREADS, ChunkTiers, chunk_key
from lazy_rag.kv_record import kv_dtype_named
from lazy_rag.random_models import ARCHITECTURES
from lazy_rag.store import ChunkStore

RESULTS = Path(__file__).resolve().parent / "results"


def fetch_all(tiers: ChunkTiers, store: ChunkStore, chunks, ahead: bool) -> float:
    """Seconds to fetch every chunk from the store (the host tier emptied first)."""
    tiers.host.clear()
    t0 = time.perf_counter()
    if ahead:
        tiers.read_ahead(store, chunks)
    for key, ids, cid in chunks:
        kv, tier = tiers.fetch(key, ids, cid, store)
        if tier != "disk":
            raise RuntimeError(f"chunk {cid} came from {tier!r}, not the store")
    tiers.drop_read_ahead()
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.1-8b", help="a lazy_rag.random_models architecture")
    ap.add_argument("--kv-dtype", default="int4", choices=("int4", "fp8"))
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", help="where the store goes (default: a temporary folder)")
    ap.add_argument("--out", default="chunk_reads")
    args = ap.parse_args()

    cfg = ARCHITECTURES[args.shape]
    layers, heads = cfg["num_hidden_layers"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        store = ChunkStore(Path(tmp), "bench", kv_dtype=kv_dtype_named(args.kv_dtype, torch.bfloat16),
                           precomputed=True)
        gen = torch.Generator().manual_seed(0)
        chunks = []
        for i in range(args.chunks):
            ids = list(range(1000 * i, 1000 * i + args.chunk_tokens))
            k, v = (torch.randn(layers, args.chunk_tokens, heads, head_dim, generator=gen).to(torch.bfloat16)
                    for _ in range(2))
            store.write(f"c{i}", ids, ChunkKV(k, v))
            chunks.append((chunk_key(ids, stored=store.kv_format), ids, f"c{i}"))
        store.flush()
        tiers = ChunkTiers(host_bytes=64 << 30, pin=torch.cuda.is_available())
        record_bytes = sum(store.stored_bytes(cid) for _, _, cid in chunks)
        env = environment()
        records = []
        for cache in ("cold", "page_cache"):
            for mode in ("serial", "read_ahead"):
                for r in range(args.rounds):
                    if cache == "cold":
                        drop_page_cache(store.kv_dir)
                    else:
                        read_folder(store.kv_dir)
                    s = fetch_all(tiers, store, chunks, mode == "read_ahead")
                    records.append({"benchmark": "chunk_reads", "mode": mode, "device": env["device"],
                                    "cache": cache, "shape": args.shape, "kv_dtype": args.kv_dtype,
                                    "chunks": args.chunks, "chunk_tokens": args.chunk_tokens,
                                    "record_bytes": record_bytes, "read_ahead_threads": READ_AHEAD_THREADS,
                                    "round": r, "fetch_ms": round(s * 1e3, 2),
                                    "gb_per_s": round(record_bytes / s / 1e9, 2), **env})
        store.close()
    summary = [{"cache": c, "mode": m, "fetch_ms_median": statistics.median(
        r["fetch_ms"] for r in records if r["cache"] == c and r["mode"] == m)}
        for c in ("cold", "page_cache") for m in ("serial", "read_ahead")]
    print(format_table(summary, ["cache", "mode", "fetch_ms_median"]))
    print(f"{args.chunks} records, {record_bytes / 1e6:.1f} MB in all")
    print("->", write_records(RESULTS / f"{args.out}.json", records))


if __name__ == "__main__":
    main()
