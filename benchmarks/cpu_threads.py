"""Decode speed on the CPU by thread count and OpenMP wait policy, on a quiet machine and beside
busy processes (the default of `--threads` and of OMP_WAIT_POLICY, lazy_rag/threads.py).

Each setting runs in its own interpreter (libgomp reads OMP_WAIT_POLICY once, at start-up): the
bundled SmolLM2 answers a question over the example corpus (3 chunks, lazy mode, greedy) `--reps`
times; the record keeps the median decode tokens/s and TTFT. `--busy K` runs K processes that
spin on a core each beside every setting (the competition a shared machine has; the records also
carry the 1-minute load average before each setting, other users' work included).

    python benchmarks/cpu_threads.py [--busy 0,2] [--threads 1,2] [--policies default,PASSIVE] [--reps 3]

Writes benchmarks/results/cpu_threads.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
CORPUS = Path(__file__).resolve().parents[1] / "examples" / "corpus"
QUESTION = "In what year was the Marrow Point Lighthouse completed?"

CHILD = r"""
import json, os, sys, time
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch
torch.set_num_threads(int(sys.argv[1]))
from lazy_rag import Chunk, LazyLLM, build_rag_segments
llm = LazyLLM.from_pretrained("smollm2", device="cpu")
chunks = [Chunk(open(p).read()) for p in sys.argv[3:]]
segments = build_rag_segments(llm.tokenizer, sys.argv[2], chunks)
llm.generate(segments, max_new_tokens=4, mode="lazy")  # the chunks encoded once, the first call's costs paid
out = []
for _ in range(int(os.environ["REPS"])):
    s = llm.generate(segments, max_new_tokens=32, mode="lazy").stats
    out.append({"ttft_ms": s.ttft_ms, "decode_tokens_per_s": s.decode_tokens_per_s, "new_tokens": s.new_tokens})
print(json.dumps(out))
"""


def run_setting(threads: int, policy: str, reps: int) -> list[dict]:
    env = {**os.environ, "REPS": str(reps)}
    env.pop("OMP_WAIT_POLICY", None)
    if policy != "default":
        env["OMP_WAIT_POLICY"] = policy
    files = [str(p) for p in sorted(CORPUS.iterdir())]
    proc = subprocess.run([sys.executable, "-c", CHILD, str(threads), QUESTION, *files], env=env,
                          capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--busy", default="0,2", help="Comma-separated counts of spinning competitor processes.")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--policies", default="default,PASSIVE", help="OMP_WAIT_POLICY values (default: unset).")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default="cpu_threads")
    args = ap.parse_args()
    records = []
    for busy in (int(x) for x in args.busy.split(",")):
        spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
        try:
            for threads in (int(x) for x in args.threads.split(",")):
                for policy in args.policies.split(","):
                    load = os.getloadavg()[0]
                    runs = run_setting(threads, policy, args.reps)
                    rec = {"benchmark": "cpu_threads", "busy_processes": busy, "threads": threads,
                           "omp_wait_policy": policy, "load_avg_1min_before": round(load, 2),
                           "decode_tokens_per_s": statistics.median(r["decode_tokens_per_s"] for r in runs),
                           "ttft_ms": statistics.median(r["ttft_ms"] for r in runs), "runs": runs,
                           "cpus": os.cpu_count()}
                    records.append(rec)
                    print(f"busy {busy} threads {threads} {policy:8s} load {load:4.1f}: "
                          f"{rec['decode_tokens_per_s']:6.1f} tok/s, TTFT {rec['ttft_ms']:7.0f} ms", flush=True)
        finally:
            for p in spinners:
                p.kill()
                p.wait()
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{args.out}.json"
    path.write_text(json.dumps(records, indent=1))
    print(f"-> {path}")


if __name__ == "__main__":
    main()
