"""CPU index build, one git tree against another (issue 24): ``LazyIndex.build`` (= ``lazy-rag index``)
with the bundled SmolLM2 and its default wrapper, on the same corpus slice, per tree.

    # the corpus: 999 English Wikipedia articles from the bigbench sdist (lazy_rag.bench.corpus);
    # offline once the sdist is in lazy-rag's cache, --fetch downloads it from PyPI (358 MB, once)
    python benchmarks/index_build.py corpus --out /tmp/wiki_en [--fetch]
    # BENCHMARKS.md's table: the first 22 articles (33,090 tokens, 154 chunks; the records'
    # corpus_sha256 of that slice is 38182e02e26f6911), three trees
    python benchmarks/index_build_cpu.py --corpus /tmp/wiki_en --articles 22 \
        --trees before-24=246bff4~1,24-first=6524014,24-cpu=05b5f12 --runs 4

Each tree (``label=rev`` or ``rev``, comma-separated) is checked out with ``git worktree add
--detach`` into a temporary folder, and every run is a fresh process of this venv's Python with
``PYTHONPATH`` at that tree: the trees differ only in lazy_rag's code, not in torch or the other
packages. The run checks that lazy_rag was imported from its tree. The child calls only what all
trees since before issue 24 share: ``LazyIndex.build([docs], out, model=, kv_dtype=, device="cpu",
progress="none")`` returning ``(index, report)``, ``index.records``, ``index.manifest["kv_dtype"]``
and, where it exists, ``report.stages`` (the KV pipeline's stage times, from issue 24 on).

Rounds alternate the trees (every tree once per round, in the order given), so slow drift of the
machine falls on all of them. Before each run the driver waits until other processes have used
less than ``--quiet-load`` cores over ``--quiet-s`` seconds (at most ``--quiet-max``): on 2 cores a
second process using one core slows the build several-fold. During the build the child counts
the CPU seconds other processes used (/proc/stat's busy time minus its own); a run with more than
``NOISY_OTHER_CPU_S`` is flagged ``noisy`` and kept, for the reader to drop.

"build s" is ``LazyIndex.build``'s own time: model and embedder loading, chunking, embedding,
encoding and writing the KV, and the commit; "process s" adds Python's start and imports.

Writes a JSON list of flat records (benchmark ``index_build_cpu``, ``mode`` = the tree's label)
to ``--out`` (default benchmarks/results/index_build_cpu_trees.json) after every run, and prints a
table per tree last. The worktrees and the index folders are removed at the end, also on error.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
# other processes' CPU seconds during a build above which the run is flagged (the same threshold
# as index_build_cpu_before_after.json's records: quiet runs there saw 0.4-1.0 s)
NOISY_OTHER_CPU_S = 3.0
# build_pipeline.PipelineStats fields copied into the records as they are (null before issue 24)
STAGE_FIELDS = ("encode_s", "write_s", "encoder_wait_s", "writer_idle_s", "batches", "bound")
CORPUS_HELP = ("make it with: python benchmarks/index_build.py corpus --out /tmp/wiki_en "
               "(add --fetch to download the bigbench sdist from PyPI, 358 MB, once)")


# -- the CPU the rest of the machine uses -------------------------------------------------------------
def busy_cpu_s() -> float:
    """CPU seconds the whole machine has been busy (all but idle and iowait), from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def wait_quiet(seconds: float, max_load: float, max_wait: float) -> tuple[float, float]:
    """Wait until other processes used < ``max_load`` cores over ``seconds``, or ``max_wait``
    passed: (seconds waited, the last window's load). This process sleeps meanwhile."""
    t0 = time.monotonic()
    while True:
        b = busy_cpu_s()
        time.sleep(seconds)
        load = (busy_cpu_s() - b) / seconds
        if load < max_load or time.monotonic() - t0 >= max_wait:
            return time.monotonic() - t0, load


# -- one build, in a child whose PYTHONPATH is the tree ------------------------------------------------
def child(a) -> None:
    import lazy_rag
    import torch

    tree = Path(a.tree_path).resolve()
    if not Path(lazy_rag.__file__).resolve().is_relative_to(tree):
        # the editable install of the main checkout would otherwise measure the same code twice
        raise SystemExit(f"lazy_rag came from {lazy_rag.__file__}, not from the tree {tree}")
    from lazy_rag.index import LazyIndex

    out = Path(a.index_out)
    shutil.rmtree(out, ignore_errors=True)
    b, own = busy_cpu_s(), own_cpu_s()
    t0 = time.perf_counter()
    index, report = LazyIndex.build([a.docs], out, model=a.model, kv_dtype=a.kv_dtype, device="cpu",
                                    progress="none")
    build_s = time.perf_counter() - t0
    other = (busy_cpu_s() - b) - (own_cpu_s() - own)
    records = list(index.records)
    rec = dict(build_s=build_s, chunks=len(records), tokens=sum(len(r.token_ids) for r in records),
               kv_dtype=index.manifest["kv_dtype"], kv_bytes=report.kv_bytes_written, other_cpu_s=other,
               torch=torch.__version__, threads=torch.get_num_threads(),
               # the wrapper "auto" picked (the model's bundled one): the same digest in every tree
               # means every tree encoded the chunks inside the same wrapper
               wrapper_digest=(index.manifest.get("wrapper") or {}).get("digest"))
    # report.stages (build_pipeline.PipelineStats) exists from issue 24 on; before it the KV was
    # written chunk by chunk inside the build with no stage timing, so those fields stay null
    stages = getattr(report, "stages", None) or {}
    rec["kv_stage_s"] = stages.get("seconds")
    for k in STAGE_FIELDS:
        rec[k] = stages.get(k)
    print(json.dumps(rec), flush=True)


# -- the driver ------------------------------------------------------------------------------------
def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True, text=True).stdout.strip()


def parse_trees(spec: str) -> list[tuple[str, str]]:
    """``label=rev,rev,...`` -> [(label, rev)]; a rev without a label is its own label."""
    trees = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        label, _, rev = item.rpartition("=")
        trees.append((label or rev, rev))
    labels = [t[0] for t in trees]
    if not trees or len(set(labels)) != len(labels):
        raise SystemExit(f"--trees needs distinct labels, got {labels}")
    return trees


def select_articles(corpus: Path, n: int) -> list[Path]:
    """The first ``n`` articles in name order (the corpus names them ``<task index>-<slug>.txt``,
    so name order is the task's order)."""
    files = sorted(corpus.glob("*.txt"))
    if len(files) < n:
        raise SystemExit(f"{corpus} holds {len(files)} .txt files, {n} asked for; {CORPUS_HELP}")
    return files[:n]


def summary(records: list[dict], trees: list[tuple[str, str]]) -> str:
    def span(xs, fmt="{:.1f}"):
        xs = [x for x in xs if x is not None]
        if not xs:
            return "-"
        return fmt.format(min(xs)) if min(xs) == max(xs) else f"{fmt.format(min(xs))}-{fmt.format(max(xs))}"

    rows = ["| tree | commit | build s (quiet runs) | tokens/s | KV stage s | noisy runs |",
            "|---|---|---|---:|---|---:|"]
    for label, _ in trees:
        rs = [r for r in records if r["mode"] == label]
        quiet = [r for r in rs if not r["noisy"]]
        commit = rs[0]["commit"] if rs else "?"
        builds = ", ".join(f"{r['build_s']:.1f}" for r in quiet) or "-"
        rows.append(f"| {label} | {commit} | {builds} | "
                    f"{span([r['tokens_per_s'] for r in quiet], '{:.0f}')} | "
                    f"{span([r['kv_stage_s'] for r in quiet])} | {len(rs) - len(quiet)} of {len(rs)} |")
    return "\n".join(rows)


def drive(a) -> None:
    trees = parse_trees(a.trees)
    if not a.corpus:
        raise SystemExit(f"--corpus DIR is needed: the wiki corpus folder; {CORPUS_HELP}")
    articles = select_articles(Path(a.corpus), a.articles)
    out = Path(a.out) if a.out else RESULTS / "index_build_cpu_trees.json"
    if out.resolve() == (RESULTS / "index_build_cpu_before_after.json").resolve():
        raise SystemExit(f"{out} holds the throwaway driver's records; write elsewhere")
    commits = {label: git("rev-parse", "--verify", f"{rev}^{{commit}}") for label, rev in trees}

    # SIGTERM as an exception, so that the finally below removes the worktrees and subprocess.run
    # kills the running child
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    tmp = Path(tempfile.mkdtemp(prefix="lazy-rag-ibcpu-", dir=a.work))
    worktrees: list[Path] = []
    records: list[dict] = []
    try:
        docs = tmp / "docs"
        docs.mkdir()
        digest = hashlib.sha256()
        for p in articles:
            shutil.copy(p, docs / p.name)
            digest.update(p.name.encode() + b"\0" + p.read_bytes())
        paths = {}
        for label, _ in trees:
            wt = tmp / f"tree-{len(worktrees)}"
            git("worktree", "add", "--detach", str(wt), commits[label])
            worktrees.append(wt)
            paths[label] = wt
            # byte-compile the tree now: build() imports modules lazily, and the first run of a
            # fresh checkout would otherwise pay for writing their .pyc inside its timing
            subprocess.run([sys.executable, "-m", "compileall", "-q", str(wt / "lazy_rag")], check=True)
        env = dict(os.environ)
        # the model, tokenizer and embedder come from the Hugging Face cache; without this each run
        # may ask the Hub for updates, a network wait inside the timing (and none on an offline machine)
        env.setdefault("HF_HUB_OFFLINE", "1")
        for rnd in range(a.runs):
            for label, rev in trees:
                waited, load = wait_quiet(a.quiet_s, a.quiet_load, a.quiet_max)
                argv = [sys.executable, str(Path(__file__).resolve()), "child", "--tree-path", str(paths[label]),
                        "--docs", str(docs), "--index-out", str(tmp / "index"), "--model", a.model,
                        "--kv-dtype", a.kv_dtype]
                t0 = time.perf_counter()
                res = subprocess.run(argv, capture_output=True, text=True, cwd=tmp,
                                     env={**env, "PYTHONPATH": str(paths[label])})
                process_s = time.perf_counter() - t0
                # the 1.6 GB of KV of a full run goes before the next quiet wait
                shutil.rmtree(tmp / "index", ignore_errors=True)
                if res.returncode != 0:
                    raise SystemExit(f"{label} ({rev}) failed ({res.returncode}):\n{res.stderr[-4000:]}")
                c = json.loads(res.stdout.strip().splitlines()[-1])
                now = time.localtime()
                rec = dict(benchmark="index_build_cpu", mode=label, device="cpu", model=a.model,
                           wrapper_digest=c["wrapper_digest"], kv_dtype_requested=a.kv_dtype,
                           corpus="wiki_en (bigbench sdist)", articles=a.articles,
                           corpus_sha256=digest.hexdigest()[:16], tree=rev,
                           commit=commits[label][:7], round=rnd + 1, torch=c["torch"], threads=c["threads"],
                           cpus=os.cpu_count(), date=time.strftime("%Y-%m-%d", now), at=time.strftime("%H:%M:%S", now),
                           chunks=c["chunks"], tokens=c["tokens"], kv_dtype=c["kv_dtype"], kv_bytes=c["kv_bytes"],
                           build_s=round(c["build_s"], 2), process_s=round(process_s, 2),
                           tokens_per_s=round(c["tokens"] / c["build_s"], 1),
                           kv_stage_s=None if c["kv_stage_s"] is None else round(c["kv_stage_s"], 3),
                           **{k: round(c[k], 3) if isinstance(c[k], float) else c[k] for k in STAGE_FIELDS},
                           other_cpu_s=round(c["other_cpu_s"], 1), noisy=c["other_cpu_s"] > NOISY_OTHER_CPU_S,
                           quiet_wait_s=round(waited, 1), quiet_load_cores=round(load, 2))
                records.append(rec)
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps(records, indent=1) + "\n")
                print(f"round {rnd + 1} {label} ({rec['commit']}): build {rec['build_s']} s, {rec['tokens']} tokens, "
                      f"{rec['tokens_per_s']} tokens/s, KV stage {rec['kv_stage_s']} s, other CPU "
                      f"{rec['other_cpu_s']} s{' (noisy)' if rec['noisy'] else ''}", flush=True)
    finally:
        for wt in worktrees:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(wt)], capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)
        subprocess.run(["git", "-C", str(ROOT), "worktree", "prune"], capture_output=True)
    print(f"\n{len(records)} runs -> {out}\n")
    print(summary(records, trees))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd")
    c = sub.add_parser("child", help="one build (run by the driver, PYTHONPATH at a tree)")
    c.add_argument("--tree-path", required=True)
    c.add_argument("--docs", required=True)
    c.add_argument("--index-out", required=True)
    c.add_argument("--model", required=True)
    c.add_argument("--kv-dtype", required=True)
    ap.add_argument("--trees", default="before-24=246bff4~1,24-first=6524014,24-cpu=05b5f12",
                    help="label=rev or rev, comma-separated, run in this order every round")
    ap.add_argument("--corpus", help="the wiki corpus folder (benchmarks/index_build.py corpus)")
    ap.add_argument("--articles", type=int, default=22, help="the first N articles (22: 33,090 tokens)")
    ap.add_argument("--runs", type=int, default=4, help="rounds; each runs every tree once")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--kv-dtype", default="auto")
    ap.add_argument("--quiet-s", type=float, default=5.0)
    ap.add_argument("--quiet-load", type=float, default=0.1, help="cores other processes may use while 'quiet'")
    ap.add_argument("--quiet-max", type=float, default=600.0, help="seconds to wait for quiet at most, then run")
    ap.add_argument("--work", help="folder for the worktrees and the index (default: the system's temp)")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    if a.cmd == "child":
        child(a)
    else:
        drive(a)


if __name__ == "__main__":
    main()
