"""VectorIndex (lazy_rag/vector_index.py) on this CPU: exact (flat) vs IVF vs IVF-SQ8, by size.

For each n, synthetic clustered 384-d unit vectors (topics > clusters > points plus a shared
direction, tuned so that nearest-neighbour cosines look like all-MiniLM-L6-v2 sentence embeddings:
see ``clustered``); per index: build time (IVF: k-means, adding, tuning nprobe), single-query
latency (p50/p90 of ``--latency-queries`` queries one at a time, faiss's default threads), and
recall@4 against exact search on fresh queries (``tuning_queries`` with another seed than the
build's tuning). IVF-SQ8 reuses the IVF's trained lists and nprobe with 8-bit codes (4x less
memory), to see whether it keeps recall (VectorIndex does not use it). Also times exact search
with 1 thread (faiss's default here is 2), which matters for the threshold.

``--real NPZ``: the query-model check behind ``tuning_queries``: X (passages) and Q (real question
embeddings) from an .npz (``--make-real`` writes one from SQuAD-format files with the default
embedder: sentences of the contexts, and a sample of the questions), and the nprobe each kind of
synthetic query needs for recall@4 >= 0.98/0.99 next to what the real questions need.

    python benchmarks/vector_index.py [--sizes 10000,100000,300000] [--append]
    python benchmarks/vector_index.py --make-real real.npz --squad ~/.cache/lazy-rag/data/*.json
    python benchmarks/vector_index.py --real real.npz --sizes '' --append
"""
from __future__ import annotations

import argparse
import datetime as _dt
import os
import time
from pathlib import Path

import numpy as np

from lazy_rag.bench.records import format_table, load_records, write_records

RESULTS = Path(__file__).resolve().parent / "results"
COLUMNS = ["mode", "n", "build_s", "query_ms_p50", "query_ms_p90", "recall_at_4", "nlist", "nprobe", "mem_mib"]


def normalise(x: np.ndarray) -> np.ndarray:
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x


def clustered(n: int, dim: int = 384, seed: int = 0, per_cluster: int = 50, centre: float = 0.85,
              mean: float = 0.3, alpha: float = 0.7, spread_sd: float = 0.3, block: int = 100_000) -> np.ndarray:
    """n unit vectors shaped like all-MiniLM-L6-v2 sentence embeddings: a shared mean direction,
    n/50 cluster centres, points spread around them with per-cluster widths (log-normal, sd 0.3),
    centres and spreads Gaussian with a power-law spectrum (eigenvalue i ~ i^-0.7, randomly
    rotated). Calibrated on 62,711 SQuAD-family sentences (--real): there nearest-neighbour
    cosines are (median) 0.63 / 0.55 / 0.40 for the 1st / 4th / 50th, random pairs 0.03 +- 0.08,
    and IVF (nlist 1002) needs nprobe 128 for recall@4 0.98 with self queries, 192 with real
    questions and 192 with tuning_queries; these vectors (same n): 0.57 / 0.53 / 0.35, random
    pairs 0.05 +- 0.09, nprobe 128 (self) and 256 (tuning_queries). Tight, separated Gaussian
    clusters are far easier for IVF than real embeddings (nprobe 6-8 instead of 100-400 of 1000
    in a first version of this benchmark): they flatter it.
    Generated in blocks (1M x 384 float32 is 1.5 GB)."""
    rng = np.random.default_rng(seed)
    scale = np.arange(1, dim + 1, dtype=np.float32) ** (-alpha / 2)
    scale /= np.linalg.norm(scale)
    rot = np.linalg.qr(rng.standard_normal((dim, dim)))[0].astype(np.float32)

    def gauss(m):
        return (rng.standard_normal((m, dim), dtype=np.float32) * scale) @ rot

    clusters = max(1, n // per_cluster)
    centres = mean * normalise(rng.standard_normal((1, dim), dtype=np.float32)) + centre * gauss(clusters)
    width = np.exp(spread_sd * rng.standard_normal((clusters, 1))).astype(np.float32)
    out = np.empty((n, dim), np.float32)
    for s in range(0, n, block):
        m = min(block, n - s)
        label = rng.integers(0, clusters, m)
        out[s:s + m] = normalise(centres[label] + width[label] * gauss(m))
    return out


def curve_text(curve: dict) -> str:
    """{nprobe: recall} as 'nprobe:recall ...' (records stay flat)."""
    return " ".join(f"{p}:{r:.4f}" for p, r in curve.items())


def latency_ms(search, queries: np.ndarray) -> tuple[float, float]:
    search(queries[:1])  # warm
    ts = []
    for i in range(len(queries)):
        t = time.perf_counter()
        search(queries[i:i + 1])
        ts.append((time.perf_counter() - t) * 1e3)
    return float(np.percentile(ts, 50)), float(np.percentile(ts, 90))


def run_size(n: int, dim: int, args, env: dict) -> list[dict]:
    import faiss

    from lazy_rag import vector_index as vi
    from lazy_rag.vector_index import EXACT_BELOW, VectorIndex, recall_at_k, tuning_queries

    t = time.perf_counter()
    x = clustered(n, dim)
    ids = np.arange(n, dtype=np.int64)
    print(f"n={n}: data {time.perf_counter() - t:.1f} s", flush=True)
    q_lat = tuning_queries(x, args.latency_queries, seed=101)
    q_rec = tuning_queries(x, args.recall_queries, seed=202)
    exact = VectorIndex._exact(ids, x, q_rec, 4)
    base = {"benchmark": "vector_index", "device": env["device"], "n": n, "dim": dim, "threshold": EXACT_BELOW,
            "queries": "tuning_queries (seed 202 for recall, 101 for latency; the build tunes on seed 1234)",
            "recall_queries": len(q_rec), "latency_queries": len(q_lat),
            **{k: v for k, v in env.items() if k != "device"}}
    rows = []

    def record(mode, build_s, search, nlist=None, nprobe=None, mem=None, **extra):
        p50, p90 = latency_ms(search, q_lat)
        scores, found = search(q_rec)
        r = {**base, "mode": mode, "build_s": round(build_s, 3), "query_ms_p50": round(p50, 3),
             "query_ms_p90": round(p90, 3), "recall_at_4": round(recall_at_k(*exact, scores, found), 4),
             "nlist": nlist, "nprobe": nprobe, "mem_mib": mem, **extra}
        rows.append(r)
        print(format_table([r], COLUMNS), flush=True)

    t = time.perf_counter()
    flat = VectorIndex.rebuild(ids, x, exact_below=n + 1)
    build = time.perf_counter() - t
    record("flat", build, lambda q: flat.search(q, 4), mem=round(n * dim * 4 / 2**20, 1))
    threads = faiss.omp_get_max_threads()
    if threads > 1:
        faiss.omp_set_num_threads(1)
        try:
            record("flat_1thread", build, lambda q: flat.search(q, 4), mem=round(n * dim * 4 / 2**20, 1),
                   device_threads=1)
        finally:
            faiss.omp_set_num_threads(threads)
    flat = None  # free its memory before the IVF's

    # IVF whatever nprobe it needs (VectorIndex itself stays flat beyond MAX_PROBE_FRACTION of the lists)
    saved, vi.MAX_PROBE_FRACTION = vi.MAX_PROBE_FRACTION, 1.0
    try:
        t = time.perf_counter()
        ivf = VectorIndex.rebuild(ids, x, exact_below=1)
        build = time.perf_counter() - t
    finally:
        vi.MAX_PROBE_FRACTION = saved
    declined = ivf.nprobe > saved * ivf.nlist
    record("ivf", build, lambda q: ivf.search(q, 4), ivf.nlist, ivf.nprobe, round(n * dim * 4 / 2**20, 1),
           tuned_recall_at_4=ivf.recall["recall_at_k"], tuning_curve=curve_text(ivf.recall["curve"]),
           vector_index_kind=f"flat (IVF declined: nprobe > {saved} nlist)" if declined else "ivf")

    if not args.no_sq8:
        t = time.perf_counter()
        sq = faiss.IndexIVFScalarQuantizer(faiss.clone_index(ivf.index.quantizer), dim, ivf.nlist,
                                           faiss.ScalarQuantizer.QT_8bit, faiss.METRIC_INNER_PRODUCT)
        sq.train(x[np.random.default_rng(0).choice(n, min(n, 100_000), replace=False)])  # the codec only
        sq.add_with_ids(x, ids)
        build_sq = time.perf_counter() - t
        for nprobe in sorted({ivf.nprobe, min(ivf.nlist, 2 * ivf.nprobe)}):
            sq.nprobe = nprobe
            record("ivf_sq8", build_sq, lambda q: sq.search(q, 4), ivf.nlist, nprobe, round(n * dim / 2**20, 1),
                   note="lists and centroids of the ivf row; build_s excludes its k-means")
    return rows


def real_check(path: str) -> list[dict]:
    """nprobe needed by each query model vs by real questions, on real embeddings."""
    import faiss

    from lazy_rag import vector_index as vi

    data = np.load(path)
    x, questions = np.ascontiguousarray(data["X"], np.float32), np.ascontiguousarray(data["Q"], np.float32)
    n = len(x)
    ids = np.arange(n, dtype=np.int64)
    vi.MAX_PROBE_FRACTION = 1.0  # IVF whatever nprobe it needs: the curves are the point
    index = vi.VectorIndex.rebuild(ids, x, exact_below=1)
    grid = [p for p in vi.NPROBE_GRID if p < index.nlist] + [index.nlist]
    rng = np.random.default_rng(5)

    models = {"real questions": questions, "self (q = v)": x[rng.choice(n, 1000, replace=False)],
              "mean of 2 random stored": normalise(x[rng.integers(0, n, 1000)] + x[rng.integers(0, n, 1000)]),
              **{f"isotropic noise cos {c}" + (" (tuning_queries)" if c == vi.QUERY_COS else ""):
                 vi.tuning_queries(x, 1000, seed=7, cos=c) for c in (0.3, 0.4, 0.5, 0.6)}}
    synthetic = clustered(n, x.shape[1])
    synthetic_index = vi.VectorIndex.rebuild(ids, synthetic, exact_below=1)
    models.update({f"synthetic clustered: {name}": q for name, q in (
        ("self (q = v)", synthetic[rng.choice(n, 1000, replace=False)]),
        (f"isotropic noise cos {vi.QUERY_COS}", vi.tuning_queries(synthetic, 1000, seed=7)))})
    rows = []
    for name, q in models.items():
        data, idx = (synthetic, synthetic_index) if name.startswith("synthetic") else (x, index)
        es, ei = vi.VectorIndex._exact(ids, data, q, 4)
        curve = {}
        for p in grid:
            idx.index.nprobe = p
            s, i = idx.index.search(q, 4)
            curve[p] = round(vi.recall_at_k(es, ei, s, i), 4)
        rows.append({"benchmark": "vector_index_query_model", "query_model": name, "n": n, "nlist": idx.nlist,
                     "queries": len(q), "top1_cos_p50": round(float(np.median(es[:, 0])), 3),
                     "top4_cos_p50": round(float(np.median(es[:, 3])), 3),
                     "nprobe_for_0.98": next((p for p in grid if curve[p] >= 0.98), None),
                     "nprobe_for_0.99": next((p for p in grid if curve[p] >= 0.99), None),
                     "curve": curve_text(curve)})
    print(format_table(rows, ["query_model", "top1_cos_p50", "top4_cos_p50", "nprobe_for_0.98", "nprobe_for_0.99"]))
    print(f"(n={n} real vectors, nlist={index.nlist}, faiss {faiss.__version__})")
    return rows


def make_real(out: str, files: list[str], n_questions: int = 3000) -> None:
    import json
    import re

    from lazy_rag.embedder import Embedder

    sentences, questions = [], []
    for f in files:
        for article in json.loads(Path(f).read_text())["data"]:
            for p in article["paragraphs"]:
                sentences += [s for s in re.split(r"(?<=[.!?])\s+", p["context"]) if len(s) > 20]
                questions += [qa["question"] for qa in p["qas"]]
    rng = np.random.default_rng(0)
    questions = [questions[i] for i in rng.choice(len(questions), min(n_questions, len(questions)), replace=False)]
    emb = Embedder()
    np.savez(out, X=emb.encode(sentences, batch_size=64), Q=emb.encode(questions, batch_size=64))
    print(f"{out}: {len(sentences)} sentences, {len(questions)} questions")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="10000,100000,300000",
                    help="comma-separated n ('' for none); 1000000 takes ~12 min on 2 shared cores")
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--latency-queries", type=int, default=200)
    ap.add_argument("--recall-queries", type=int, default=1000)
    ap.add_argument("--no-sq8", action="store_true")
    ap.add_argument("--real", help="an .npz with X (passages) and Q (questions): the query-model check")
    ap.add_argument("--make-real", help="write that .npz from --squad files, then stop")
    ap.add_argument("--squad", nargs="*", default=[])
    ap.add_argument("--out", default=str(RESULTS / "vector_index_cpu.json"))
    ap.add_argument("--append", action="store_true", help="keep --out's records of the other benchmark "
                    "(vector_index / vector_index_query_model) and of other sizes")
    args = ap.parse_args()
    if args.make_real:
        return make_real(args.make_real, args.squad)

    import faiss

    env = {"device": f"cpu ({faiss.omp_get_max_threads()} threads, {os.cpu_count()} cores, shared)",
           "faiss": faiss.__version__, "date": _dt.date.today().isoformat()}
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    kept = []
    if args.append and Path(args.out).exists():
        kept = [r for r in load_records(Path(args.out))
                if not (r.get("benchmark") == "vector_index" and r.get("n") in sizes)
                and not (r.get("benchmark") == "vector_index_query_model" and args.real)]
    rows = []
    for n in sizes:
        env["loadavg_1min_at_start"] = round(os.getloadavg()[0], 2)
        rows += run_size(n, args.dim, args, env)
        write_records(Path(args.out), kept + rows)  # after each size: a run cut short keeps what it measured
    if rows:
        print(format_table(rows, COLUMNS))
    if args.real:  # same file, its own benchmark name
        rows += [{**r, **env} for r in real_check(args.real)]
        write_records(Path(args.out), kept + rows)


if __name__ == "__main__":
    main()
