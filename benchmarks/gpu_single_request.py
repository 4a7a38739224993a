"""Single-request TTFT of LazyLLM on a GPU, at the paper's request size, every mode.

Llama-3.1-8B shape (``--arch``: any of ``random_models.ARCHITECTURES``) with random bf16 weights
built on the device (the GPU machine has no model hub), 5 chunks of 2048 tokens from a pool of
10, a 32-token question, chunk KV already cached (resident in the engine's page pool, placed by an
earlier request that retrieved the same chunks in another order). ``prefix``: a fresh pool in
which only that earlier request is cached. ``--eager`` adds block and lazy with their prefill
step run eagerly (the engine's append CUDA graphs off, as ``append_graph_tokens=0`` does), in the
same run. ``--tensor-parallel N``: the model split over N GPUs (cuda:0..N-1), each rank building
its own share; the KV pool's 16 GiB are per rank.

    python benchmarks/gpu_single_request.py [--arch llama-3.1-8b] [--layers N] [--reps 5] [--eager]
    python benchmarks/gpu_single_request.py --arch llama-3.1-70b --tensor-parallel 2
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from lazy_rag.random_models import ARCHITECTURES, IdTokenizer, random_model
from lazy_rag.bench.paper_request import PaperRequests
from lazy_rag.bench.records import environment, format_table, write_records

RESULTS = Path(__file__).resolve().parent / "results"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="llama-3.1-8b", choices=sorted(ARCHITECTURES))
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: the architecture's)")
    ap.add_argument("--tensor-parallel", type=int, default=1, help="ranks (GPUs) the model is split over")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--chunk-tokens", type=int, default=2048)
    ap.add_argument("--out", default="gpu_single_request")
    ap.add_argument("--eager", action="store_true", help="also block and lazy without append graphs")
    args = ap.parse_args()
    if args.eager and args.tensor_parallel > 1:
        ap.error("--eager switches rank 0's append graphs only; the ranks would leave lockstep (run it at TP 1)")
    from lazy_rag import LazyLLM

    # engine pool: 16 GiB (the paper's request is 1.25 GiB of KV; per rank under tensor parallelism)
    model = random_model(args.arch, "cuda", torch.bfloat16, args.layers, tensor_parallel=args.tensor_parallel)
    layers = model.config.num_hidden_layers
    llm = LazyLLM(model, IdTokenizer(), kv_bytes=16 << 30, tensor_parallel=args.tensor_parallel)
    requests = PaperRequests(chunk_tokens=args.chunk_tokens)

    def ttft(segs, mode):
        torch.cuda.synchronize()
        r = llm.generate(segs, max_new_tokens=1, mode=mode)
        torch.cuda.synchronize()
        return r.stats

    env = environment()
    records = []
    runs = [(m, True) for m in ("full", "prefix", "block", "lazy")]
    if args.eager:
        runs += [("block", False), ("lazy", False)]
    graphs = llm.engine.runner.append_graphs
    for mode, append_graphs in runs:
        llm.engine.runner.append_graphs = graphs if append_graphs else None
        times, st = [], None
        for rep in range(args.reps + 1):
            chosen, q = requests.choose(), requests.question()
            if mode == "prefix":  # an earlier request retrieved the same chunks in another order
                llm.engine.clear_cache()  # only that earlier request is cached
                ttft(requests.prompt(chosen[1:] + chosen[:1], q), "prefix")
            else:
                ttft(requests.prompt(chosen[::-1], q[::-1]), mode)  # chunks resident in the pool
            st = ttft(requests.prompt(chosen, q), mode)
            if rep:  # the first is warm-up
                times.append(st.ttft_ms)
        records.append({"benchmark": "gpu_single_request", "mode": mode, "device": env["device"],
                        "append_graphs": append_graphs and graphs is not None,
                        "model": f"{args.arch}-shape ({layers} layers, random bf16)", "chunks": 5,
                        "tensor_parallel": args.tensor_parallel,
                        "chunk_tokens": args.chunk_tokens, "prompt_tokens": st.prompt_tokens,
                        "cached_tokens": st.cached_tokens, "computed_tokens": st.computed_tokens,
                        "chunk_sources": json.dumps(st.chunk_sources, sort_keys=True),
                        "ttft_ms": statistics.median(times), "ttft_ms_min": min(times), "reps": args.reps,
                        "torch": env["torch"], "transformers": env["transformers"], "date": env["date"]})
    full = next(f for f in records if f["mode"] == "full")
    for r in records:
        r["speedup_vs_full"] = full["ttft_ms"] / r["ttft_ms"]
    path = write_records(RESULTS / f"{args.out}.json", records)
    print(f"\n{env['device']}, torch {env['torch']}, transformers {env['transformers']} -> {path}")
    print(format_table(records, ["mode", "tensor_parallel", "append_graphs", "prompt_tokens", "cached_tokens", "computed_tokens", "chunk_sources",
                                 "ttft_ms", "ttft_ms_min", "speedup_vs_full"]))


if __name__ == "__main__":
    main()
