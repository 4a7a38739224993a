"""Which bundled model should be the default: the README's and the examples' questions over the
example corpus, answered by each candidate as a new user gets it (`lazy-rag index` defaults: its
bundled chunk wrapper, lazy mode), with the time each step takes on this machine.

Each question has the fact the corpus states; an answer is right when it contains it
(case-insensitive). Per model: the index build (chunk sizes 256, the README's, and 128, the
walkthrough's), then every question at top-k 4 and 2 in lazy mode and, for comparison, in full
mode (no reuse: what the model itself can answer from the same chunks).

    python benchmarks/default_model.py [--models smollm2,qwen2.5-0.5b] [--threads 2]

Writes benchmarks/results/default_model.json.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

RESULTS = Path(__file__).resolve().parent / "results"
CORPUS = Path(__file__).resolve().parents[1] / "examples" / "corpus"
# (question, the fact an answer must contain, where a user meets it)
QUESTIONS = [
    ("In what year was the Marrow Point Lighthouse completed?", "1871", "README main job"),
    ("When does the bakery open?", "six", "cli_walkthrough.sh, langchain_chain.py, llama_index_query_engine.py"),
    ("Who is the head baker?", "Lidia", "cli_walkthrough.sh, langchain_chain.py, llama_index_query_engine.py"),
    ("What telescope does the observatory have?", "61", "langchain_chain.py"),
    ("How far can the lighthouse be seen?", "22", "llama_index_query_engine.py"),
    ("Who designed the lighthouse tower?", "Agnes Thorold", "tests"),
    ("When does the ferry to Vellin Island leave Port Sallow?", "nine", "the issue's ferry question"),
    ("In what year was the bakery founded?", "2004", "-"),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="smollm2,qwen2.5-0.5b")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--out", default="default_model")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    from lazy_rag import LazyIndex, LazyLLM

    records = []
    for model in args.models.split(","):
        t0 = time.perf_counter()
        llm = LazyLLM.from_pretrained(model, device="cpu")
        load_s = time.perf_counter() - t0
        for chunk_size, top_k in ((256, 4), (128, 2)):
            with tempfile.TemporaryDirectory() as tmp:
                t0 = time.perf_counter()
                index, rep = LazyIndex.build([str(CORPUS)], Path(tmp) / "index", llm=llm, chunk_size=chunk_size,
                                             progress=False)
                build_s = time.perf_counter() - t0
                for mode in ("lazy", "full"):
                    for question, fact, where in QUESTIONS:
                        t0 = time.perf_counter()
                        res = index.query(question, top_k=top_k, mode=mode, max_new_tokens=args.max_new_tokens)
                        rec = {"benchmark": "default_model", "model": model, "chunk_size": chunk_size, "top_k": top_k,
                               "mode": mode, "question": question, "fact": fact, "where": where,
                               "answer": res.answer.strip(), "right": fact.lower() in res.answer.lower(),
                               "wrapper": index.wrapper.name if index.wrapper else None,
                               "query_s": round(time.perf_counter() - t0, 2),
                               "ttft_ms": round(res.stats["ttft_ms"], 1),
                               "decode_tokens_per_s": round(res.stats["decode_tokens_per_s"], 2),
                               "recovery": res.stats.get("recovery"), "reuse_risk": res.stats.get("reuse_risk"),
                               "served_again": res.stats.get("served_again"),
                               "load_s": round(load_s, 1), "build_s": round(build_s, 1),
                               "chunks": rep.chunks_total, "threads": args.threads}
                        records.append(rec)
                        print(f"{model:13s} cs{chunk_size} k{top_k} {mode:4s} {'OK ' if rec['right'] else 'BAD'} "
                              f"{rec['query_s']:5.1f}s  {question} -> {rec['answer'][:80]!r}", flush=True)
        del llm
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{args.out}.json"
    path.write_text(json.dumps(records, indent=1))
    for model in args.models.split(","):
        for mode in ("lazy", "full"):
            rows = [r for r in records if r["model"] == model and r["mode"] == mode]
            again = sum(bool(r["served_again"]) for r in rows)
            print(f"{model} {mode}: {sum(r['right'] for r in rows)}/{len(rows)} right"
                  + (f" ({again} served again as full re-encoding)" if mode == "lazy" else ""))
    print(f"-> {path}")


if __name__ == "__main__":
    main()
