"""Where a decode step's time goes on a GPU, with shared-chunk attention on and off.

Llama-3.1-8B shape with random bf16 weights; ``--docs`` chunks of 2048 tokens, each request 5 of
them drawn by Zipf(2.1) + a 32-token question, ``--batch`` requests decoding together (every
chunk resident in the pool). Per ``shared_chunks`` value: the wall time of a decode step
(host-synchronised, the median of ``--steps``), the profiler's split of the GPU time of a few
steps (matmuls, the lazy attention kernels, the rest), the host time not covered by the GPU, and
the host functions that take it (cProfile).

    python benchmarks/decode_profile.py [--batch 32,128] [--layers 32] [--modes auto,off]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from lazy_rag.random_models import IdTokenizer, random_llama31_8b
from lazy_rag.bench.records import environment, format_table, write_records
from lazy_rag.bench.roofline import kernel_class

RESULTS = Path(__file__).resolve().parent / "results"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--batch", default="32,128")
    ap.add_argument("--docs", type=int, default=100)
    ap.add_argument("--modes", default="auto,off")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", default="decode_profile")
    ap.add_argument("--results-dir", type=Path, default=RESULTS)
    args = ap.parse_args()
    from torch.profiler import ProfilerActivity, profile

    from lazy_rag import Chunk
    from lazy_rag.engine import Engine, EngineConfig
    from lazy_rag.model_host import ModelHost

    host = ModelHost(random_llama31_8b(args.layers), IdTokenizer())
    rng = np.random.default_rng(0)
    docs = [rng.integers(1000, 120000, 2048).tolist() for _ in range(args.docs)]
    w = 1.0 / np.arange(1, args.docs + 1) ** 2.1
    w /= w.sum()

    def request():
        picked = rng.choice(args.docs, 5, replace=False, p=w)
        return [Chunk(docs[c], chunk_id=f"d{c}") for c in picked] + [rng.integers(1000, 120000, 32).tolist()]

    env = environment()
    records = []
    for mode in args.modes.split(","):
        eng = Engine(host, EngineConfig(kv_bytes=48 << 30, page_size=64, max_num_seqs=max(
            int(b) for b in args.batch.split(",")), shared_chunks=mode))
        eng.generate([dict(segments=request(), max_new_tokens=2) for _ in range(2)])
        for batch in [int(b) for b in args.batch.split(",")]:
            for _ in range(batch):
                eng.submit(request(), max_new_tokens=2 * args.steps + 16)
            while any(s.needs_prefill for s in eng.scheduler.running) or eng.scheduler.waiting:
                eng.step()
            for _ in range(3):                # graphs of this batch captured
                eng.step()
            walls = []
            for _ in range(args.steps):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                eng.step()
                torch.cuda.synchronize()
                walls.append((time.perf_counter() - t0) * 1e3)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    eng.step()
                torch.cuda.synchronize()
            split = {"matmul_ms": 0.0, "attention_ms": 0.0, "other_kernels_ms": 0.0}
            for ev in prof.key_averages():
                if ev.device_type == torch.autograd.DeviceType.CUDA and ev.self_device_time_total > 0:
                    split[kernel_class(ev.key)] += ev.self_device_time_total / 1e3 / 3
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(3):
                eng.step()
            torch.cuda.synchronize()
            pr.disable()
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(8)
            print(f"# host functions, shared_chunks={mode}, batch {batch} (3 steps):\n"
                  + "\n".join(s.getvalue().splitlines()[-14:]), flush=True)
            wall = statistics.median(walls)
            gpu = sum(split.values())
            rec = {"benchmark": "decode_profile", "mode": "lazy", "shared_chunks": mode, "device": env["device"],
                   "batch": batch, "docs": args.docs, "chunks": 5, "chunk_tokens": 2048, "layers": args.layers,
                   "step_wall_ms": round(wall, 2), **{k: round(v, 2) for k, v in split.items()},
                   "gpu_busy_ms": round(gpu, 2), "host_not_overlapped_ms": round(max(0.0, wall - gpu), 2),
                   "output_tokens_per_s": round(batch / wall * 1e3, 1),
                   "shared_chunk_steps": eng.stats()["shared_chunk_steps"],
                   "torch": env["torch"], "date": env["date"]}
            records.append(rec)
            print(rec, flush=True)
            eng.run_until_done()
        del eng
        torch.cuda.empty_cache()
    write_records(args.results_dir / f"{args.out}.json", records)
    print(format_table(records, ["shared_chunks", "batch", "step_wall_ms", "matmul_ms", "attention_ms",
                                 "other_kernels_ms", "gpu_busy_ms", "host_not_overlapped_ms", "output_tokens_per_s"]))


if __name__ == "__main__":
    main()
