"""Where the engine's time goes on a GPU: one step of a prefill, profiled, per mode.

Llama-3.1-8B shape with random bf16 weights; 5 chunks of 2048 tokens (all resident in the pool:
an earlier request placed them) + a 32-token question; ``--batch`` requests admitted together.
For each mode: the wall time of the prefill step (host-synchronised) and the profiler's split
between GPU kernels (matmuls, attention, the rest) and host time not covered by the GPU.

    python benchmarks/engine_profile.py [--layers 32] [--batch 1,32]
"""
from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

from lazy_rag.random_models import IdTokenizer, random_llama31_8b
from lazy_rag.bench.records import environment, format_table, write_records

RESULTS = Path(__file__).resolve().parent / "results"


def classify(name: str) -> str:
    n = name.lower()
    if "paged_attn" in n or "prefill_runs" in n or "merge" in n:
        return "lazy_kernels_ms"
    if "sdpa" in n or "flash" in n or "attention" in n or "fmha" in n:
        return "sdpa_ms"
    if "gemm" in n or "nvjet" in n or "cutlass" in n or "sm90_xmma" in n:
        return "matmul_ms"
    return "other_kernels_ms"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--batch", default="1,32")
    ap.add_argument("--modes", default="lazy,block,full")
    ap.add_argument("--out", default="engine_profile")
    args = ap.parse_args()
    from torch.profiler import ProfilerActivity, profile

    from lazy_rag import Chunk
    from lazy_rag.engine import Engine, EngineConfig
    from lazy_rag.model_host import ModelHost

    host = ModelHost(random_llama31_8b(args.layers), IdTokenizer())
    rng = random.Random(0)
    chunks = [[rng.randrange(1000, 120000) for _ in range(2048)] for _ in range(10)]
    head = [rng.randrange(1000, 120000) for _ in range(16)]

    def request():
        picked = rng.sample(range(10), 5)
        return [head] + [Chunk(chunks[c], chunk_id=f"c{c}") for c in picked] + [[rng.randrange(1000, 120000) for _ in range(32)]]

    eng = Engine(host, EngineConfig(kv_bytes=48 << 30, page_size=64, max_num_seqs=64))
    for mode in args.modes.split(","):  # place every chunk, compile every kernel
        eng.generate([dict(segments=request(), mode=mode, max_new_tokens=2) for _ in range(2)])
    env = environment()
    records = []
    for batch in [int(b) for b in args.batch.split(",")]:
        for mode in args.modes.split(","):
            for profiled in (True, False):  # profiled first: it also compiles any new kernel variant
                handles = [eng.submit(request(), mode=mode, max_new_tokens=1) for _ in range(batch)]
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                if profiled:
                    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                        eng.run_until_done()
                        torch.cuda.synchronize()
                else:
                    eng.run_until_done()
                    torch.cuda.synchronize()
                wall = (time.perf_counter() - t0) * 1e3
                if not profiled:
                    ttft = sorted(h.ttft_ms for h in handles)[len(handles) // 2]
                    wall_plain = wall
            split = {"matmul_ms": 0.0, "sdpa_ms": 0.0, "lazy_kernels_ms": 0.0, "other_kernels_ms": 0.0}
            for ev in prof.key_averages():
                if ev.device_type == torch.autograd.DeviceType.CUDA and ev.self_device_time_total > 0:
                    split[classify(ev.key)] += ev.self_device_time_total / 1e3
            gpu = sum(split.values())
            rec = {"benchmark": "engine_profile", "mode": mode, "device": env["device"], "batch": batch,
                   "chunks": 5, "chunk_tokens": 2048, "question_tokens": 32, "layers": args.layers,
                   "step_wall_ms": round(wall_plain, 2), "ttft_ms_p50": round(ttft, 2),
                   **{k: round(v, 2) for k, v in split.items()}, "gpu_busy_ms": round(gpu, 2),
                   "host_not_overlapped_ms": round(max(0.0, wall_plain - gpu), 2),
                   "torch": env["torch"], "date": env["date"]}
            records.append(rec)
            print(rec, flush=True)
    write_records(RESULTS / f"{args.out}.json", records)
    print(format_table(records, ["mode", "batch", "step_wall_ms", "ttft_ms_p50", "matmul_ms", "sdpa_ms", "lazy_kernels_ms",
                          "other_kernels_ms", "gpu_busy_ms", "host_not_overlapped_ms"]))


if __name__ == "__main__":
    main()
