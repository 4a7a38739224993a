"""Crash consistency of index builds, with figures: kill -9 at random moments of builds and
updates, then check what a user would see.

A parent process loads SmolLM2 once (one torch thread, so forking is safe) and runs trials:
each forks a child that builds or updates an index (fresh build, a changed file, a new file, a
deleted file), kills it with SIGKILL after a random delay (log-uniform, 1 ms to 1.2 x a fresh
build; `killed_before_exit` counts the kills that landed before the child finished), and checks
the folder:
- it loads and passes `verify_index`, and holds either the generation before or the one after
  (its chunk table equal to a clean build of the sources the child or its predecessor saw), or
- it is not an index yet (a first build killed before its commit) and says "run `lazy-rag index`
  again";
then re-runs the build without interruption and checks that the result equals a clean build and
that no temp file or stray KV file is left. Writes benchmarks/results/reliability_crash.json.

    python benchmarks/reliability_crash.py --trials 200
"""
import argparse
import json
import math
import os
import platform
import random
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

torch.set_num_threads(1)

from lazy_rag import LazyIndex, LazyLLM  # noqa: E402
from lazy_rag.embedder import Embedder  # noqa: E402
from lazy_rag.errors import LazyIndexError  # noqa: E402
from lazy_rag.index import verify_index  # noqa: E402

CORPUS = Path(__file__).resolve().parents[1] / "examples" / "corpus"
OPTS = dict(chunk_size=48, chunk_overlap=8, progress=False)


def table_of(out: Path) -> tuple:
    m = json.loads((out / "manifest.json").read_text())
    return tuple(sorted((r["source"].rsplit("/", 1)[-1], r["ordinal"], r["text"]) for r in
                        map(json.loads, (out / m["chunks_file"]).read_text().splitlines())))


def edit(src: Path, kind: str, rng: random.Random) -> None:
    files = sorted(src.glob("*.md"))
    if kind == "change":
        f = rng.choice(files)
        f.write_text(f.read_text() + f"\n\nAn added paragraph, number {rng.randrange(10**6)}, about the coast.")
    elif kind == "add":
        (src / f"new{rng.randrange(10**6)}.md").write_text("A new note about the harbour wall, finished in 1899. " * 4)
    elif kind == "delete" and len(files) > 1:
        rng.choice(files).unlink()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/reliability_crash.json"))
    a = p.parse_args()
    rng = random.Random(a.seed)
    llm, emb = LazyLLM.from_pretrained("smollm2", device="cpu"), Embedder()
    work = Path(tempfile.mkdtemp(prefix="lazy-rag-crash-"))
    # how long an uninterrupted build takes: kill times are drawn over [0, 1.2 x that]
    src0 = work / "timing-src"
    shutil.copytree(CORPUS, src0)
    t0 = time.perf_counter()
    LazyIndex.build([src0], work / "timing-idx", llm=llm, embedder=emb, **OPTS)
    build_s = time.perf_counter() - t0
    counts = {"trials": 0, "consistent": 0, "old_generation": 0, "new_generation": 0, "no_index_clean_error": 0,
              "inconsistent": 0, "rerun_equals_clean": 0, "debris_after_rerun": 0, "killed_before_exit": 0}
    failures = []
    for t in range(a.trials):
        trial = work / f"t{t}"
        src, out = trial / "docs", trial / "idx"
        shutil.copytree(CORPUS, src)
        kind = rng.choice(["fresh", "change", "add", "delete"])
        before = None
        if kind != "fresh":
            LazyIndex.build([src], out, llm=llm, embedder=emb, **OPTS)
            before = table_of(out)
            edit(src, kind, rng)
        # log-uniform over [1 ms, 1.2 x a fresh build]: updates are much shorter than fresh builds
        delay = math.exp(rng.uniform(math.log(0.001), math.log(1.2 * build_s)))
        pid = os.fork()
        if pid == 0:  # the child: build, then exit without cleanup
            try:
                LazyIndex.build([src], out, llm=llm, embedder=emb, **OPTS)
            finally:
                os._exit(0)
        time.sleep(delay)
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        counts["killed_before_exit"] += int(os.WIFSIGNALED(status))
        # a clean build of the same sources, elsewhere: what "after" must equal
        clean = trial / "clean"
        LazyIndex.build([src], clean, llm=llm, embedder=emb, **OPTS)
        after = table_of(clean)
        counts["trials"] += 1
        verdict, why = None, ""
        try:
            LazyIndex.load(out, llm=llm, embedder=emb)
            report = verify_index(out)
            state = table_of(out)
            if report["ok"] and state == before:
                verdict = "old_generation"
            elif report["ok"] and state == after:
                verdict = "new_generation"
        except LazyIndexError as e:
            why = str(e)
            # a first build killed before its commit: not an index yet, and the error says what to do
            # (killed before it even created the folder: nothing at all)
            if before is None and ("run `lazy-rag index` again" in why or not out.exists()):
                verdict = "no_index_clean_error"
        if verdict is None:
            counts["inconsistent"] += 1
            failures.append({"trial": t, "kind": kind, "delay_s": delay, "error": why})
            print(f"[crash] trial {t} ({kind}, killed after {delay:.4f} s) inconsistent: {why}", flush=True)
        else:
            counts[verdict] += 1
            counts["consistent"] += 1
        LazyIndex.build([src], out, llm=llm, embedder=emb, **OPTS)
        report = verify_index(out)
        counts["rerun_equals_clean"] += int(report["ok"] and table_of(out) == after)
        counts["debris_after_rerun"] += int(report["temp_files"] > 0 or report["stray_kv_files"] > 0)
        shutil.rmtree(trial)
        if (t + 1) % 20 == 0:
            print(f"[crash] {t + 1}/{a.trials}: {counts['consistent']} consistent, {counts['inconsistent']} not",
                  flush=True)
    shutil.rmtree(work, ignore_errors=True)
    record = {"benchmark": "reliability_crash", "mode": "kill -9 during build/update", "device": "cpu",
              "model": "smollm2", "python": platform.python_version(), "torch": torch.__version__,
              "seed": a.seed, "build_s": round(build_s, 3), **counts, "failures": json.dumps(failures),
              "date": time.strftime("%Y-%m-%d")}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps([record], indent=1) + "\n")
    print("| trials | killed mid-build | consistent | old gen | new gen | no index (clean error) | inconsistent | "
          "re-run = clean | debris |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    print(f"| {counts['trials']} | {counts['killed_before_exit']} | {counts['consistent']} | "
          f"{counts['old_generation']} | {counts['new_generation']} | "
          f"{counts['no_index_clean_error']} | {counts['inconsistent']} | {counts['rerun_equals_clean']} | "
          f"{counts['debris_after_rerun']} |")
    sys.exit(1 if counts["inconsistent"] or counts["rerun_equals_clean"] != counts["trials"] else 0)


if __name__ == "__main__":
    main()
