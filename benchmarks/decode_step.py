"""A decode step's wall time per architecture (random weights), side by side in one run: e.g. a
mixture-of-experts shape against the dense model of the same active parameters.

For each ``--random-weights`` name and ``--batch`` size: that many lazy requests, each ``--k``
chunks of ``--chunk-tokens`` drawn from ``--docs`` documents + a 32-token question, prefilled,
then the median wall time of ``--steps`` decode steps (host-synchronised, after a few untimed
steps so the batch's CUDA graph is captured), the engine's graph replays, and the ratio of each
architecture's step to the first one's.

    python benchmarks/decode_step.py --random-weights qwen3-a3b-dense,qwen3-30b-a3b --batch 1,32

``--experts`` picks what runs the mixture-of-experts shapes' routed experts (lazy_rag.experts):
``auto`` (the default: the Triton kernel on CUDA), transformers' ``grouped_mm`` and/or lazy-rag's
Triton kernel (kernels/moe.py). With several, each MoE shape runs once per choice, side by side;
each record names the implementation that ran (``experts``, None for a dense shape):

    python benchmarks/decode_step.py --random-weights qwen3-a3b-dense,qwen3-30b-a3b --batch 1,32 \
        --experts grouped_mm,triton
"""
from __future__ import annotations

import argparse
import gc
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from lazy_rag.bench.records import environment, format_table, write_records
from lazy_rag.experts import DEFAULT_EXPERTS, experts_in_use
from lazy_rag.random_models import ARCHITECTURES, IdTokenizer, random_model

RESULTS = Path(__file__).resolve().parent / "results"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--random-weights", default="qwen3-a3b-dense,qwen3-30b-a3b",
                    help="comma-separated architectures (lazy_rag.random_models); ratios are to the first")
    ap.add_argument("--layers", type=int, default=None, help="depth of every architecture (default: its own)")
    ap.add_argument("--batch", default="1,32")
    ap.add_argument("--docs", type=int, default=64)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--chunk-tokens", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--experts", default=DEFAULT_EXPERTS,
                    help="comma-separated: what runs a mixture-of-experts shape's routed experts, each in turn "
                         "(auto, grouped_mm, triton: lazy_rag.experts.EXPERTS; a record names the one that ran)")
    ap.add_argument("--out", default="decode_step")
    ap.add_argument("--results-dir", type=Path, default=RESULTS)
    args = ap.parse_args()

    from lazy_rag import Chunk
    from lazy_rag.engine import Engine, EngineConfig
    from lazy_rag.model_host import ModelHost

    env = environment()
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    batches = [int(b) for b in args.batch.split(",")]
    experts_choices = args.experts.split(",")
    # (architecture, experts choice): a MoE shape once per choice, a dense one once (None)
    runs = [(name, experts) for name in args.random_weights.split(",")
            for experts in (experts_choices if ARCHITECTURES.get(name, {}).get("num_experts") else [None])]
    records, first = [], {}
    for name, experts in runs:
        model = random_model(name, args.device, layers=args.layers, experts=experts)   # (None: the default)
        moe = experts is not None
        host = ModelHost(model, IdTokenizer())
        rng = np.random.default_rng(0)
        vocab = model.config.vocab_size
        docs = [rng.integers(1000, vocab - 1000, args.chunk_tokens).tolist() for _ in range(args.docs)]

        def request():
            picked = rng.choice(args.docs, args.k, replace=False)
            return [Chunk(docs[c], chunk_id=f"d{c}") for c in picked] + [rng.integers(1000, vocab - 1000, 32).tolist()]

        eng = Engine(host, EngineConfig(kv_bytes=24 << 30, page_size=64, max_num_seqs=max(batches)))
        eng.generate([dict(segments=request(), max_new_tokens=2) for _ in range(2)])
        for batch in batches:
            for _ in range(batch):
                eng.submit(request(), max_new_tokens=args.steps + 16)
            while any(s.needs_prefill for s in eng.scheduler.running) or eng.scheduler.waiting:
                eng.step()
            for _ in range(4):   # this batch's decode graph captured
                eng.step()
            replays = eng.stats()["graph_replays"]
            walls = []
            for _ in range(args.steps):
                sync()
                t0 = time.perf_counter()
                eng.step()
                sync()
                walls.append((time.perf_counter() - t0) * 1e3)
            wall = statistics.median(walls)
            first.setdefault(batch, wall)
            rec = {"benchmark": "decode_step", "mode": "lazy", "device": env["device"], "architecture": name,
                   "moe": moe, "experts": experts_in_use(model),
                   "parameters_b": round(sum(p.numel() for p in model.parameters()) / 1e9, 3),
                   "layers": model.config.num_hidden_layers, "batch": batch, "k": args.k,
                   "chunk_tokens": args.chunk_tokens, "step_wall_ms": round(wall, 3),
                   "step_ms_vs_first": round(wall / first[batch], 3),
                   "output_tokens_per_s": round(batch / wall * 1e3, 1),
                   "graph_replays_in_timed_steps": eng.stats()["graph_replays"] - replays,
                   "timed_steps": args.steps, "torch": env["torch"], "transformers": env["transformers"],
                   "date": env["date"], "command": "python benchmarks/decode_step.py " + " ".join(
                       f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "results_dir" and v is not None)}
            records.append(rec)
            print(rec, flush=True)
            write_records(args.results_dir / f"{args.out}.json", records)   # partial results kept
            eng.run_until_done()
        del eng, host, model
        gc.collect()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    print(format_table(records, ["architecture", "experts", "batch", "step_wall_ms", "step_ms_vs_first", "output_tokens_per_s",
                                 "graph_replays_in_timed_steps"]))


if __name__ == "__main__":
    main()
