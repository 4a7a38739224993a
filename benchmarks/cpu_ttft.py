"""TTFT of full, prefix, block and lazy on the CPU, side by side in one run.

Workload: the bundled SmolLM2, a question over 4 retrieved chunks of 256 tokens each (SQuAD dev
paragraphs), chat template, chunk KV already stored. Each mode answers the same prompts; we
time the first token (prefill + sampling) and report the median over repetitions.

- ``lazy`` / ``block``: chunk KV resident in the engine's page pool (``*_disk``: a fresh engine,
  so the chunks are read from the index's safetensors files, checksum verified).
- ``prefix``: vLLM-style prefix cache (a fresh engine) warmed by earlier requests over the same
  4 chunks in the other orders, as retrieval returns them: only the common token prefix (the
  template head) is reused. ``prefix_same_order`` is its best case: the same chunks in the same
  order were asked about before, with another question.
- ``full``: everything recomputed.

    python benchmarks/cpu_ttft.py [--reps 5] [--threads 2]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from lazy_rag.bench.records import environment, format_table, write_records  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"

SQUAD = Path(__file__).resolve().parents[2] / "shared" / "data" / "squad_v1.1_dev.json"
QUESTION = ("Based on these passages, which of the events described happened first, and who was "
            "responsible for it according to the text?")


def squad_paragraphs(path: Path, n: int) -> list[str]:
    data = json.loads(path.read_text())
    paras = [p["context"] for art in data["data"] for p in art["paragraphs"]]
    return paras[:n * 8]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--squad", type=Path, default=SQUAD)
    ap.add_argument("--out", default="cpu_ttft", help="results file name (benchmarks/results/NAME.json)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from lazy_rag import Chunk, LazyIndex, LazyLLM, build_rag_segments

    # plain chunks: the recorded TTFT figures compare reuse itself (the bundled chunk wrapper's cost
    # is measured in QUALITY.md)
    llm = LazyLLM.from_pretrained("smollm2", device="cpu", wrapper="none")
    tok = llm.tokenizer
    texts = squad_paragraphs(args.squad, args.chunks) if args.squad.exists() else \
        [p.read_text() for p in sorted((Path(__file__).resolve().parents[1] / "examples" / "corpus").iterdir())]
    # 4 chunks of exactly chunk_tokens tokens each: concatenate paragraphs and cut
    stream = tok("\n\n".join(texts), add_special_tokens=False).input_ids
    if len(stream) < args.chunks * args.chunk_tokens:
        stream = stream * (args.chunks * args.chunk_tokens // len(stream) + 1)
    chunk_ids = [stream[i * args.chunk_tokens:(i + 1) * args.chunk_tokens] for i in range(args.chunks)]
    tmp = tempfile.mkdtemp(prefix="lazy-rag-bench-")
    index = LazyIndex.from_texts([tok.decode(c) for c in chunk_ids], tmp, llm=llm, split=False, progress=False,
                                 ids=[f"c{i}" for i in range(args.chunks)], wrapper="none")
    order = list(range(args.chunks))

    def prompt(rotation: int, question=QUESTION):
        o = order[rotation:] + order[:rotation]
        return build_rag_segments(tok, question, [Chunk(index.by_id[f"c{i}"].token_ids, f"c{i}") for i in o])

    def fresh_engine():
        llm.engine.clear_cache()  # an empty pool and host tier: nothing cached in memory

    def warm_prefix_cache(rotations, question):
        fresh_engine()
        for rot in rotations:
            ttft(prompt(rot, question), "prefix")

    def ttft(segments, mode) -> tuple[float, dict]:
        res = llm.generate(segments, max_new_tokens=1, mode=mode, source=index.chunk_source)
        return res.stats.ttft_ms, res.stats.as_dict()

    ttft(prompt(0), "lazy")  # warm-up: every chunk in the pool
    records = []
    env = environment()
    modes = [("full", "full"), ("prefix", "prefix"), ("prefix_same_order", "prefix"), ("block", "block"),
             ("lazy", "lazy"), ("block_disk", "block"), ("lazy_disk", "lazy")]
    for mode, source_mode in modes:
        times, stats = [], None
        for r in range(args.reps):
            question = QUESTION + f" (variant {r})"  # a new question each time
            if mode.endswith("_disk"):
                fresh_engine()
            if mode == "prefix":
                warm_prefix_cache(range(1, args.chunks), question + " earlier")
            elif mode == "prefix_same_order":
                warm_prefix_cache([0], question + " earlier")
            segs = prompt(0, question)
            t, stats = ttft(segs, source_mode)
            times.append(t)
        records.append({
            "benchmark": "cpu_ttft", "mode": mode, "device": env["device"], "model": "SmolLM2-135M-Instruct",
            "dtype": str(llm.dtype).removeprefix("torch."), "chunks": args.chunks, "chunk_tokens": args.chunk_tokens,
            "prompt_tokens": stats["prompt_tokens"], "cached_tokens": stats["cached_tokens"],
            "computed_tokens": stats["computed_tokens"], "ttft_ms": statistics.median(times),
            "ttft_ms_min": min(times), "ttft_ms_max": max(times), "reps": args.reps,
            "torch": env["torch"], "transformers": env["transformers"], "date": env["date"],
        })
    full = records[0]["ttft_ms"]
    for r in records:
        r["speedup_vs_full"] = full / r["ttft_ms"]
    path = write_records(RESULTS / f"{args.out}.json", records)
    print(f"\n{env['device']}, torch {env['torch']}, transformers {env['transformers']}, {env['date']} -> {path}")
    print(format_table(records, ["mode", "prompt_tokens", "cached_tokens", "computed_tokens", "ttft_ms", "ttft_ms_min",
                                 "ttft_ms_max", "speedup_vs_full"]))


if __name__ == "__main__":
    main()
