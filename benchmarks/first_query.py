"""A machine's first build and first queries, with and without `lazy-rag compile` first (issue 24):
what Triton's compile costs a user on a fresh machine, and what the command takes off.

Each arm runs in fresh processes on an empty Triton cache (its own ``TRITON_CACHE_DIR``) and an
empty encode calibration, as on a machine that never ran lazy-rag:

  as_found  a process loads the model, builds a small index (its build compiles what a build
            compiles), then times queries over its chunks: the first cold (the index's KV read
            from disk or re-encoded, as the engine chooses), a second cold one over other
            chunks, then a warm one; and the kernel variants each phase compiled.
  compiled  the same, after ``lazy-rag compile --model MODEL --kv-dtype KV`` in a process of its
            own (``compile_s``: the command's seconds, its Python start-up included).

    python3 benchmarks/first_query.py --model random:llama-3.1-8b --tokenizer DIR [--repeats 2]

GPU only (on a CPU there is nothing to compile). Records: benchmarks/results/<out>.json, one per
arm and repeat (``ttft_*_ms`` from the engine's stats, ``*_variants_compiled``).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COLUMNS = ["mode", "repeat", "compile_s", "build_s", "build_variants_compiled", "query_cold_first_ttft_ms",
           "query_cold_second_ttft_ms", "query_warm_ttft_ms", "query_variants_compiled"]


def child(a) -> dict:
    """One arm's build and queries in this process (the Triton cache and calibration as set)."""
    import torch
    from transformers import AutoTokenizer

    from lazy_rag import LazyIndex, LazyLLM
    from lazy_rag.random_models import random_model
    from lazy_rag.kernel_compile import compiled_variants

    tok = AutoTokenizer.from_pretrained(a.tokenizer)
    name = a.model.split(":", 1)[1]
    llm = LazyLLM(random_model(name, a.device, layers=a.layers), tok)
    words = [f"w{i}" for i in range(5000)]
    texts = [" ".join(words[(97 * i + j * 13) % 5000] for j in range(a.chunk_words)) for i in range(a.chunks)]
    t0 = time.perf_counter()
    with compiled_variants() as in_build:
        idx = LazyIndex.from_texts(texts, Path(a.work) / "index", llm=llm, vectors=False, split=False,
                                   kv_dtype=a.kv_dtype, progress=False)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    build_s = time.perf_counter() - t0
    ids = [idx.records.row(int(r)).id for r in idx.records.rowids()]
    ttft = {}
    with compiled_variants() as in_queries:
        for label, chunks in (("cold_first", ids[:a.top_k]), ("cold_second", ids[a.top_k:2 * a.top_k]),
                              ("warm", ids[:a.top_k])):
            res = llm.generate(idx.segments("What does the passage say about w7?", chunks), max_new_tokens=8,
                               source=idx.chunk_source)
            ttft[f"query_{label}_ttft_ms"] = round(res.stats.ttft_ms, 2)
    idx.close()
    return dict(build_s=round(build_s, 2), build_variants_compiled=len(in_build),
                build_variants="; ".join(in_build), **ttft,
                query_variants_compiled=len(in_queries), query_variants="; ".join(in_queries))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--model", default="random:llama-3.1-8b")
    ap.add_argument("--tokenizer", required=True, help="a tokenizer folder (the random model's prompts are text)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-dtype", default="bf16")
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--chunk-words", type=int, default=200)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--arms", default="as_found,compiled")
    ap.add_argument("--out", default="first_query")
    ap.add_argument("--results-dir", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)   # (cpu: the child's plumbing, no compile)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child(a)))
        return 0

    import torch
    import triton

    from lazy_rag.bench.records import environment, format_table, write_records

    if not torch.cuda.is_available():
        raise SystemExit("first_query.py measures Triton's compile on a GPU: run it on a CUDA machine")
    env0 = environment()
    records = []
    for repeat in range(a.repeats):
        for arm in a.arms.split(","):
            with tempfile.TemporaryDirectory(prefix="lazy-rag-first-query-") as tmp:
                env = {**os.environ, "TRITON_CACHE_DIR": str(Path(tmp) / "triton"),
                       "LAZY_RAG_CALIBRATION": str(Path(tmp) / "calibration.json")}
                rec = dict(benchmark="first_query", mode=arm, repeat=repeat, model=a.model, layers=a.layers,
                           kv_dtype=a.kv_dtype, chunks=a.chunks, top_k=a.top_k, triton=triton.__version__, **env0)
                if arm == "compiled":
                    t0 = time.perf_counter()
                    res = subprocess.run([sys.executable, "-m", "lazy_rag.cli", "compile", "--model", a.model,
                                          "--kv-dtype", a.kv_dtype], env=env, capture_output=True, text=True)
                    if res.returncode != 0:
                        raise SystemExit(f"lazy-rag compile failed:\n{res.stderr[-3000:]}")
                    rec["compile_s"] = round(time.perf_counter() - t0, 2)
                elif arm != "as_found":
                    raise SystemExit(f"unknown arm {arm!r}: as_found or compiled")
                argv = [sys.executable, __file__, "--child", "--work", tmp, "--model", a.model, "--tokenizer",
                        a.tokenizer, "--layers", str(a.layers), "--kv-dtype", a.kv_dtype, "--chunks", str(a.chunks),
                        "--chunk-words", str(a.chunk_words), "--top-k", str(a.top_k)]
                res = subprocess.run(argv, env=env, capture_output=True, text=True)
                if res.returncode != 0:
                    raise SystemExit(f"the {arm} run failed:\n{res.stderr[-3000:]}")
                rec.update(json.loads(res.stdout.strip().splitlines()[-1]))
                records.append(rec)
                print(" ".join(f"{k}={rec.get(k)}" for k in COLUMNS), flush=True)
    path = write_records(Path(a.results_dir) / f"{a.out}.json", records)
    print(format_table(records, COLUMNS))
    print(f"-> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
