"""Memory of an index build, with figures: peak resident set size of `lazy-rag index` (the real
command, in a child process) over synthetic corpora of growing size, to see what grows with the
corpus and what stays bounded.

Each corpus is N text files of a few hundred words (seeded, deterministic). For each N the
command runs once on a fresh --out; the child's RSS is sampled every --sample-s seconds (psutil)
and its exact peak read from the kernel when it exits (wait4's ru_maxrss). "baseline" is the
same command over one file: the model, the embedder and the libraries. What grows with N: the
chunk records (text and token ids), the embeddings, and whatever KV the process keeps in memory
(the engine's pool and host tier are bounded by their byte budgets).

    python benchmarks/reliability_memory.py --files 1,200,800 --kv-dtype bfloat16
    python benchmarks/reliability_memory.py --files 1,2000 --no-precompute   # records + vectors only
    PYTHONPATH=/tmp/old-checkout python benchmarks/reliability_memory.py ...  # another version of lazy_rag

Writes benchmarks/results/reliability_memory.json (one record per run).
"""
import argparse
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("harbour lighthouse keeper tower lamp granite island ferry bakery morning bread rye oven "
         "observatory telescope mirror night winter summer storm wall stone crane engineer river bridge "
         "market square bell clock council road mill wheel canal lock barge cargo salt fish net rope "
         "north south east west red white grey green old new long short high low first last").split()


def write_corpus(folder: Path, files: int, words_per_file: int, seed: int) -> int:
    """``files`` markdown files of sentences of random words; returns the bytes written."""
    rng = random.Random(seed)
    folder.mkdir(parents=True)
    total = 0
    for i in range(files):
        sentences, n = [], 0
        while n < words_per_file:
            k = rng.randint(6, 16)
            sentences.append(" ".join(rng.choice(WORDS) for _ in range(k)).capitalize() + ".")
            n += k
        text = f"# Note {i}\n\n" + " ".join(sentences) + "\n"
        (folder / f"note{i:05d}.md").write_text(text)
        total += len(text.encode())
    return total


def run_measured(cmd: list[str], cwd: Path, sample_s: float) -> dict:
    """Run ``cmd``; its peak RSS (kernel, exact) and the RSS samples' maximum, wall time, exit code."""
    # cwd: python -c puts it first on sys.path, so not this checkout (PYTHONPATH picks another)
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ps = psutil.Process(proc.pid)
    peak_sampled, samples, done = 0, [], threading.Event()

    def sample():
        nonlocal peak_sampled
        t0 = time.perf_counter()
        while not done.is_set():
            try:
                rss = ps.memory_info().rss
            except psutil.Error:
                break
            peak_sampled = max(peak_sampled, rss)
            samples.append((round(time.perf_counter() - t0, 2), rss))
            done.wait(sample_s)

    t0 = time.perf_counter()
    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    output = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    done.set()
    thread.join()
    proc.returncode = os.waitstatus_to_exitcode(status)
    return {"rc": proc.returncode, "wall_s": wall, "peak_rss": usage.ru_maxrss * 1024, "peak_rss_sampled": peak_sampled,
            "samples": samples, "output": output}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--files", default="1,200,800", help="corpus sizes (number of files), comma-separated")
    p.add_argument("--words", type=int, default=120, help="words per file")
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--kv-dtype", default="bfloat16")
    p.add_argument("--no-precompute", action="store_true", help="no KV (records, embeddings, table only)")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--sample-s", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--label", default="", help="a note stored with the records (e.g. the commit measured)")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "reliability_memory.json")
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="lazy-rag-memory-"))
    lazy_rag = [sys.executable, "-c", "from lazy_rag.cli import app; app()"]
    records = []
    try:
        for n in [int(x) for x in a.files.split(",") if x.strip()]:
            src, out = work / f"docs{n}", work / f"idx{n}"
            corpus_bytes = write_corpus(src, n, a.words, a.seed)
            cmd = lazy_rag + ["index", str(src), "--out", str(out), "--model", a.model, "--device", "cpu",
                              "--chunk-size", str(a.chunk_size), "--kv-dtype", a.kv_dtype]
            if a.no_precompute:
                cmd.append("--no-precompute")
            print(f"[memory] {n} files ({corpus_bytes / 2**10:.0f} KiB): {' '.join(cmd[3:])}", flush=True)
            r = run_measured(cmd, work, a.sample_s)
            if r["rc"] != 0:
                raise SystemExit(f"lazy-rag index failed (exit {r['rc']}):\n{r['output']}")
            m = json.loads((out / "manifest.json").read_text())
            kv_bytes = sum(f.stat().st_size for f in out.rglob("*.safetensors"))
            records.append({
                "benchmark": "reliability_memory", "mode": "lazy-rag index" + (" --no-precompute" if a.no_precompute
                                                                                 else ""),
                "device": "cpu", "model": a.model, "python": platform.python_version(),
                "torch": __import__("torch").__version__, "label": a.label, "files": n,
                "words_per_file": a.words, "corpus_bytes": corpus_bytes, "chunk_size_tokens": a.chunk_size,
                "kv_dtype": a.kv_dtype, "chunks": m["num_chunks"], "tokens": m["num_tokens"],
                "kv_bytes_on_disk": kv_bytes, "wall_s": round(r["wall_s"], 1),
                "peak_rss_mib": round(r["peak_rss"] / 2**20, 1),
                "peak_rss_sampled_mib": round(r["peak_rss_sampled"] / 2**20, 1),
                "rss_samples_mib": json.dumps([(t, round(v / 2**20)) for t, v in r["samples"][::10]]),
                "date": time.strftime("%Y-%m-%d"),
            })
            shutil.rmtree(out)
            shutil.rmtree(src)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base = records[0]["peak_rss_mib"]
    for rec in records:
        rec["peak_rss_over_first_mib"] = round(rec["peak_rss_mib"] - base, 1)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    old = json.loads(a.out.read_text()) if a.out.exists() else []
    a.out.write_text(json.dumps(old + records, indent=1) + "\n")  # runs accumulate (before / after a change)
    print("| files | chunks | tokens | KV on disk MiB | peak RSS MiB | over the first row MiB | s |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for rec in records:
        print(f"| {rec['files']} | {rec['chunks']} | {rec['tokens']} | {rec['kv_bytes_on_disk'] / 2**20:.0f} | "
              f"{rec['peak_rss_mib']:.0f} | {rec['peak_rss_over_first_mib']:+.0f} | {rec['wall_s']:.0f} |")


if __name__ == "__main__":
    main()
