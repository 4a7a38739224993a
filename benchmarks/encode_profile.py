"""Where an index build's encode time goes on a GPU (issue 24): ``Engine.encode_chunks`` as the
build calls it (``cache=False``: the KV to pinned host memory), batch after batch, profiled.

Llama-3.1-8B shape with random bf16 weights (or ``--model qwen2.5-0.5b-shape``); chunks of
``--chunk`` tokens packed ``--batch-tokens`` per forward, as ``build_pipeline`` packs them.
For each batch: wall time (host-synchronised), tokens/s and its share of the prefill roofline
(bf16 matmul rate measured here over 2 x parameters FLOPs per token), and for the profiled
batches the profiler's split: matmuls, attention kernels, device-to-host copies, other
kernels, and host time not covered by the GPU. The first batches pay one-off costs (kernel
compiles, pinned-memory allocation) and are reported apart.

    python benchmarks/encode_profile.py [--batches 6] [--batch-tokens 16384] [--chunk 256]
"""
from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

from lazy_rag.random_models import IdTokenizer, random_model
from lazy_rag.bench.records import environment, format_table, write_records
from lazy_rag.bench.roofline import kernel_class, matmul_tflops

RESULTS = Path(__file__).resolve().parent / "results"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b", help="a lazy_rag.random_models architecture")
    ap.add_argument("--batches", type=int, default=6)
    ap.add_argument("--batch-tokens", type=int, default=16384)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--profile", type=int, default=2, help="profile the last N batches")
    ap.add_argument("--out", default="encode_profile")
    args = ap.parse_args()
    from torch.profiler import ProfilerActivity, profile

    from lazy_rag.engine import Engine, EngineConfig
    from lazy_rag.model_host import ModelHost

    model = random_model(args.model, "cuda", torch.bfloat16)
    params = sum(p.numel() for n, p in model.named_parameters() if "embed" not in n)
    host = ModelHost(model, IdTokenizer())
    eng = Engine(host, EngineConfig(kv_bytes=8 << 30, page_size=64, max_batched_tokens=args.batch_tokens))
    rng = random.Random(0)
    per_batch = args.batch_tokens // args.chunk
    roof_tok_s = matmul_tflops("cuda") * 1e12 / (2 * params)
    env = environment()
    records = []
    for i in range(args.batches):
        chunks = [[rng.randrange(1000, 30000) for _ in range(args.chunk)] for _ in range(per_batch)]
        profiled = i >= args.batches - args.profile
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if profiled:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                eng.encode_chunks(chunks, cache=False)
                torch.cuda.synchronize()
        else:
            eng.encode_chunks(chunks, cache=False)
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        tokens = per_batch * args.chunk
        rec = {"benchmark": "encode_profile", "mode": "encode_chunks", "device": env["device"],
               "model": f"random:{args.model}", "batch_index": i, "batch_tokens": tokens,
               "chunk_tokens": args.chunk, "profiled": profiled, "wall_ms": round(wall * 1e3, 1),
               "tokens_per_s": round(tokens / wall), "pct_of_prefill_roofline": round(100 * tokens / wall / roof_tok_s, 1),
               "torch": env["torch"], "date": env["date"]}
        if profiled:
            split = {"matmul_ms": 0.0, "attention_ms": 0.0, "d2h_ms": 0.0, "other_kernels_ms": 0.0}
            for ev in prof.key_averages():
                if ev.device_type == torch.autograd.DeviceType.CUDA and ev.self_device_time_total > 0:
                    split[kernel_class(ev.key, copies=True)] += ev.self_device_time_total / 1e3
            gpu = sum(split.values())
            rec.update({k: round(v, 1) for k, v in split.items()}, gpu_busy_ms=round(gpu, 1),
                       host_not_overlapped_ms=round(max(0.0, wall * 1e3 - gpu), 1))
            top = sorted((ev for ev in prof.key_averages() if ev.device_type == torch.autograd.DeviceType.CPU),
                         key=lambda e: -e.self_cpu_time_total)[:8]
            rec["top_host_ops"] = "; ".join(f"{e.key} {e.self_cpu_time_total / 1e3:.0f}ms" for e in top)
        records.append(rec)
        print(rec, flush=True)
    write_records(RESULTS / f"{args.out}.json", records)
    print(format_table(records, ["batch_index", "wall_ms", "tokens_per_s", "pct_of_prefill_roofline", "matmul_ms",
                                 "attention_ms", "d2h_ms", "other_kernels_ms", "host_not_overlapped_ms"]))


if __name__ == "__main__":
    main()
