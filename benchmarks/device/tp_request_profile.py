"""Where one paper-sized lazy request's time goes on rank 0, at a tensor-parallel size: the
request's wall time (``llm.generate``, 12 requests after 3 of warm-up) and rank 0's GPU time by
kind of kernel from the torch profiler (one request beside the one that placed its chunks: the
profile covers both, halved). The request is gpu_single_request.py's (random Llama-3.1-8B
shape, 5 x 2,048 cached tokens resident in the pool + 82 computed).

    python3 benchmarks/device/tp_request_profile.py --tensor-parallel 1 --out $OUT/tp1.json
    python3 benchmarks/device/tp_request_profile.py --tensor-parallel 2 --out $OUT/tp2.json

The wall time less the GPU time is what the host adds (planning, launches, and under TP the
commands to the other ranks and their lockstep checks: rank 0's waits per request, from
``stats()``'s ``tp_*`` timers, are recorded beside it).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from lazy_rag.bench.paper_request import PaperRequests  # noqa: E402
from lazy_rag.bench.records import environment, format_table, write_records  # noqa: E402
from lazy_rag.bench.roofline import kernel_class  # noqa: E402

def gpu_ms_by_kind(events, requests: int) -> dict:
    """Rank 0's GPU time per request by kind of kernel (``roofline.kernel_class``), and in all."""
    split = {f"gpu_{k}": 0.0 for k in ("matmul_ms", "attention_ms", "all_reduce_ms", "other_kernels_ms")}
    for ev in events:
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.self_device_time_total > 0:
            split[f"gpu_{kernel_class(ev.key, all_reduces=True)}"] += ev.self_device_time_total / 1e3 / requests
    return {**split, "gpu_ms": sum(split.values())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensor-parallel", type=int, default=1)
    ap.add_argument("--arch", default="llama-3.1-8b")
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from torch.profiler import ProfilerActivity, profile

    from lazy_rag import LazyLLM
    from lazy_rag.random_models import IdTokenizer, random_model

    tp = args.tensor_parallel
    model = random_model(args.arch, "cuda", torch.bfloat16, None, tensor_parallel=tp)
    llm = LazyLLM(model, IdTokenizer(), kv_bytes=16 << 30, tensor_parallel=tp)
    requests = PaperRequests()

    def request():
        """(wall ms, stats) of a request whose chunks an earlier one placed in the pool."""
        chosen, q = requests.choose(), requests.question()
        llm.generate(requests.prompt(chosen[::-1], q[::-1]), max_new_tokens=1, mode="lazy")   # places the chunks
        torch.cuda.synchronize()
        t = time.perf_counter()
        stats = llm.generate(requests.prompt(chosen, q), max_new_tokens=1, mode="lazy").stats
        torch.cuda.synchronize()
        return (time.perf_counter() - t) * 1e3, stats

    for _ in range(3):
        request()
    before = llm.engine.stats()
    walls, stats = zip(*[request() for _ in range(args.reps)])
    after = llm.engine.stats()
    # rank 0's waits per timed request (each is two generates: the placing one and the timed one)
    waits = {f"{k[:-2]}_ms_per_request": (after[k] - before.get(k, 0.0)) * 1e3 / (2 * args.reps)
             for k in ("tp_control_s", "tp_settle_s", "tp_send_s") if k in after}
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        request()
    env = environment()
    record = {"benchmark": "tp_request_profile", "mode": "lazy", "device": env["device"], "tensor_parallel": tp,
              "model": f"{args.arch}-shape (random bf16)", "prompt_tokens": stats[-1].prompt_tokens,
              "computed_tokens": stats[-1].computed_tokens,
              "wall_ms_p50": statistics.median(walls), "wall_ms_min": min(walls), "reps": args.reps,
              **gpu_ms_by_kind(prof.key_averages(), 2), **waits, "torch": env["torch"], "date": env["date"]}
    record["host_not_overlapped_ms"] = record["wall_ms_p50"] - record["gpu_ms"]
    print(format_table([record], ["tensor_parallel", "wall_ms_p50", "gpu_ms", "gpu_matmul_ms", "gpu_attention_ms",
                                  "gpu_all_reduce_ms", "gpu_other_kernels_ms", "host_not_overlapped_ms"]))
    print("->", write_records(Path(args.out), [record]))


if __name__ == "__main__":
    main()
