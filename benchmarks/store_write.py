"""The index build's write side alone, on this machine's disk (issue 24): how much of the disk's
sequential write bandwidth the KV store's build path reaches when nothing else limits it.

The GPU build of the 8B shape is bound by its writes (BENCHMARKS.md, "The 8B build against the disk's
write bandwidth"). This takes the model out: synthetic KV of a model's shape,
in chunks of ``--chunk-tokens`` tokens, batched as the build batches them (``--batch-tokens``),
goes through the build's own path (``build_pipeline.KVWriter``: records prepared on its thread
pool, appended in order by its writer thread to ``ChunkStore``'s segments, a checkpoint commit
every ``store.CHECKPOINT_BYTES``, the final fsync and commit), fed as fast as the writer takes
it. No GPU is needed, so it runs on the GPU machine's disk in seconds, or on any other.

Against it, in the same run and folder, the disk probe of ``index_build.py``
(``lazy_rag.bench.disk.write_bandwidth``: 2 GiB of buffered 64 MiB writes and an fsync), and the
same probe writing as many bytes as the store did (a disk that is fast in short bursts shows a
lower sustained rate), and that probe starting each block's writeback as it is written, as the
store does (``start_writeback``: the best this method of writing gets from the disk); each
before and after the store, over ``--rounds`` rounds.

    python3 benchmarks/store_write.py --shape llama-3.1-8b --gib 8 --rounds 2 --out store_write_cpu

Records: benchmarks/results/<out>.json (flat: one per probe or store run and round).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class SyntheticChunk:
    id: str
    token_ids: tuple


def synthetic_kv(shape: str, chunk_tokens: int, variants: int = 4) -> list:
    """``variants`` distinct chunks of random bf16 KV, [layers, tokens, kv heads, head dim] each
    for K and V (their bytes cost the same to checksum and write whatever they hold)."""
    import torch

    from lazy_rag.random_models import random_config
    from lazy_rag.chunk_kv import ChunkKV

    c = random_config(shape)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    dims = (c.num_hidden_layers, chunk_tokens, c.num_key_value_heads, head_dim)
    g = torch.Generator().manual_seed(0)
    return [ChunkKV(torch.randn(dims, generator=g).to(torch.bfloat16), torch.randn(dims, generator=g).to(torch.bfloat16))
            for _ in range(variants)]


def store_build(folder: Path, kvs: list, chunks: int, chunk_tokens: int, batch_tokens: int) -> dict:
    """``chunks`` records through the build's write path into a fresh index folder."""
    import torch

    from lazy_rag.build_pipeline import KVWriter, PipelineStats, batches_by_tokens
    from lazy_rag.store import ChunkStore, IndexDB

    db = IndexDB(folder, create=True)
    store = ChunkStore(folder, "store-write-benchmark", kv_dtype=torch.bfloat16, db=db)
    records = [SyntheticChunk(f"c{i}", tuple(range(i, i + chunk_tokens))) for i in range(chunks)]
    per_chunk = kvs[0].nbytes
    stats = PipelineStats()
    t0 = time.perf_counter()
    store.begin_build(resume=False)
    writer = KVWriter(store, [], stats, max_pending_bytes=2 * (batch_tokens // chunk_tokens) * per_chunk)
    committed = False
    try:
        for batch in batches_by_tokens(records, batch_tokens):
            writer.put(batch, [kvs[int(r.id[1:]) % len(kvs)] for r in batch])
        writer.close()
        t_written = time.perf_counter()
        store.flush()
        with db.transaction() as cur:
            store.commit_build(cur)
        committed = True
    finally:
        store.end_build(committed)
        store.close()
        db.close()
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "bytes": chunks * per_chunk, "final_flush_commit_s": round(time.perf_counter() - t_written, 3),
            "write_s": round(stats.write_s, 3), "writer_idle_s": round(stats.writer_idle_s, 3),
            "producer_wait_s": round(stats.encoder_wait_s, 3)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--shape", default="llama-3.1-8b", help="a model shape of lazy_rag.random_models")
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--batch-tokens", type=int, default=16384, help="tokens per encode batch (the GPU engine's)")
    ap.add_argument("--gib", type=float, default=8.0, help="KV the store writes per round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--folder", default=None, help="where to write (default: a temporary folder under /tmp)")
    ap.add_argument("--out", default="store_write")
    ap.add_argument("--results-dir", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)

    import torch

    from lazy_rag import store as store_module
    from lazy_rag.bench.disk import write_bandwidth
    from lazy_rag.bench.records import environment, write_records

    env = environment()
    kvs = synthetic_kv(args.shape, args.chunk_tokens)
    per_chunk = kvs[0].nbytes
    chunks = max(1, int(args.gib * 2**30 // per_chunk))
    parent = Path(args.folder or tempfile.mkdtemp(prefix="store-write-"))
    parent.mkdir(parents=True, exist_ok=True)
    base = {"benchmark": "store_write", "device": f"cpu ({os.cpu_count()} cores), disk of {parent}",
            "shape": args.shape, "chunk_tokens": args.chunk_tokens, "chunk_mib": round(per_chunk / 2**20, 2),
            "batch_tokens": args.batch_tokens, "checkpoint_mib": store_module.CHECKPOINT_BYTES >> 20,
            "checkpoint_min_s": store_module.CHECKPOINT_MIN_S,
            "torch": torch.__version__, "date": env["date"]}
    out = Path(args.results_dir) / f"{args.out}.json"
    records: list[dict] = []
    try:
        for rnd in range(args.rounds):
            folder = parent / f"round{rnd}"
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            nbytes = chunks * per_chunk
            kinds = {"probe_2gib": (2 << 30, False), "probe_same_bytes": (nbytes, False),
                     "probe_same_bytes_writeback": (nbytes, True)}
            probes = {f"{k}_before": write_bandwidth(folder, nbytes=n, start_writeback=w) for k, (n, w) in kinds.items()}
            built = store_build(folder, kvs, chunks, args.chunk_tokens, args.batch_tokens)
            shutil.rmtree(folder)
            folder.mkdir()
            probes.update({f"{k}_after": write_bandwidth(folder, nbytes=n, start_writeback=w)
                           for k, (n, w) in kinds.items()})
            shutil.rmtree(folder)
            gbps = built["bytes"] / built["seconds"] / 1e9
            for name, probe in probes.items():
                records.append({**base, "mode": name, "round": rnd, "gbytes": round(built["bytes"] / 1e9, 2),
                                "gbps": round(probe, 3)})
            mean = {k: (probes[f"{k}_before"] + probes[f"{k}_after"]) / 2 for k in kinds}
            records.append({**base, "mode": "store", "round": rnd, "gbytes": round(built["bytes"] / 1e9, 2),
                            "chunks": chunks, "gbps": round(gbps, 3), "seconds": round(built["seconds"], 2),
                            **{f"pct_of_{k}": round(100 * gbps / v, 1) for k, v in mean.items()},
                            **{k: v for k, v in built.items() if k not in ("seconds", "bytes")}})
            write_records(out, records)
            r = records[-1]
            print(f"round {rnd}: store {gbps:.3f} GB/s = " + ", ".join(f"{r[f'pct_of_{k}']}% of {k} ({v:.3f})"
                                                                      for k, v in mean.items())
                  + f"; writer idle {r['writer_idle_s']} s, producer waited {r['producer_wait_s']} s", flush=True)
    finally:
        if args.folder is None:
            shutil.rmtree(parent, ignore_errors=True)
    cols = [f"pct_of_{k}" for k in ("probe_2gib", "probe_same_bytes", "probe_same_bytes_writeback")]
    print(f"\n{'round':>5} {'mode':<33} {'GB/s':>7} " + " ".join(f"{c:>32}" for c in cols))
    for r in records:
        print(f"{r['round']:>5} {r['mode']:<33} {r['gbps']:>7.3f} " + " ".join(f"{r.get(c, ''):>32}" for c in cols))
    print(f"-> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
