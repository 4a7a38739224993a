"""NCCL all-reduce latency between the GPUs of one host, at the sizes a tensor-parallel step
all-reduces after o_proj and down_proj (rows x hidden in bf16: decode batches and the paper
request's 82 new tokens, Llama-3.1-8B's hidden 4096 and 70B's 8192), issued eagerly and captured
64 to a CUDA graph (as the engine's steps replay them). One process per GPU; NVLink multicast off.

    python3 benchmarks/device/allreduce_latency.py --out $OUT/nccl_allreduce.json

Writes flat records (``all_reduce_us_eager``, ``all_reduce_us_graph`` per size).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")   # NVLink multicast stays off on the shared GPU machines

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lazy_rag.bench.records import environment, format_table, write_records  # noqa: E402

SIZES = [(hidden, rows) for hidden in (4096, 8192) for rows in (1, 32, 82, 512)]


def timed_us(fn, n: int) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def work(rank: int, size: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=size, device_id=torch.device("cuda", rank))
    records = []
    for hidden, rows in SIZES:
        x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
        for _ in range(20):
            dist.all_reduce(x)
        eager = timed_us(lambda: dist.all_reduce(x), 200)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):   # NCCL's warm-up before capture, off the default stream
            for _ in range(3):
                dist.all_reduce(x)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(64):
                dist.all_reduce(x)
        graph.replay()
        graphed = timed_us(graph.replay, 10) / 64
        records.append({"hidden": hidden, "rows": rows, "bytes": x.numel() * x.element_size(),
                        "all_reduce_us_eager": eager, "all_reduce_us_graph": graphed})
    if rank == 0:
        env = environment()
        records = [{"benchmark": "nccl_allreduce", "mode": "bf16", "device": f"{size}x {env['device']}",
                    "ranks": size, **r, "torch": env["torch"], "date": env["date"]} for r in records]
        print(format_table(records, ["hidden", "rows", "bytes", "all_reduce_us_eager", "all_reduce_us_graph"]))
        print("->", write_records(Path(out), records))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/nccl_allreduce.json")
    args = ap.parse_args()
    mp.spawn(work, args=(args.ranks, args.out), nprocs=args.ranks)


if __name__ == "__main__":
    main()
