"""Scale-out by simulation: pool hit ratio and throughput against the number of engine replicas
(1..64), for chunk-affinity routing (``lazy_rag.server.scaleout.affinity``, what the Ray Serve
router runs) against round robin and least-loaded (power of two choices: Ray Serve's default).

The request stream is the paper's (``lazy_rag.bench.workload``: 100 documents of 2048 tokens, 5
per request drawn Zipf a=2.1 without replacement; ``--popularity uniform`` too). Each replica
has its own KV pool: the engine's own ``PageManager`` (GDSF eviction, as the engine runs) over a
pool of ``budget`` x the corpus (``--budgets 0.1,0.25``: the fraction of the 100 documents one
GPU's pool holds). Every replica serves FIFO with a service time per request of ``base_ms`` +
``miss_ms`` per chunk missing from its pool: 17.0 ms + 12.9 ms per miss fits the H200's offline
measurements of the 8B-shape lazy engine at budget 0.25 (BENCHMARKS.md, "Saturation and TTFT
under load": Zipf 43.9 req/s at hit ratio 0.91, uniform 18.0 req/s at 0.40; 12.9 ms is about one
256 MiB chunk from pinned host memory at ~20 GB/s). The load is a closed loop of
``--concurrency`` requests in flight per replica (the engine's running batch), so throughput is
the system's saturated rate (counted while the loop is full: from the first counted request
to the last dispatch); the router sees each replica's requests in flight, as Ray Serve's
queue-length cache does, and (affinity) each replica's resident chunks as reported every
``--report-s`` plus what it sent since. The first ``--warmup`` of the requests fill the pools and
are not counted; every point serves at least ``--requests-per-replica`` requests per replica.

    python benchmarks/scaleout_sim.py [--requests 20000] [--replicas 1,2,4,8,16,32,64]   # ~4 min on 2 cores

Writes benchmarks/results/scaleout_sim.json (flat records) and scaleout_sim.png.

Real replicas, over HTTP: ``benchmarks/scaleout_serve.py``.
"""
from __future__ import annotations

import argparse
import heapq
import random
import time
from pathlib import Path

from lazy_rag.bench.records import environment, format_table, write_records
from lazy_rag.server.scaleout.affinity import (AffinitySettings, ChunkRoute, RendezvousTable, ResidencyView,
                                               RoundRobin, rank_replicas)

RESULTS = Path(__file__).resolve().parent / "results"
# affinity_homes: rendezvous homes and the load cap without the replicas' residency reports
POLICIES = ("affinity", "affinity_homes", "round_robin", "least_loaded")


class Replica:
    """One engine replica: its KV pool (the engine's PageManager, one-element pages) and its
    FIFO server."""

    def __init__(self, fit_chunks: int, doc_tokens: int, page_size: int = 64):
        from lazy_rag.engine.page_manager import PageManager
        from lazy_rag.engine.page_pool import PagePool

        self.doc_tokens = doc_tokens
        self.pm = PageManager(PagePool(1, max(1, fit_chunks) * -(-doc_tokens // page_size), 1, page_size, 1), "gdsf")
        self.free_at = 0.0
        self.in_flight = 0

    def resident(self) -> list[str]:
        """The chunk keys its pool holds (what an engine replica reports to the routers)."""
        return [f"doc{key[1]}" for key in self.pm.entries]

    def place(self, doc_ids) -> int:
        """Place a request's chunks in the pool (evicting as the engine does); the misses."""
        misses = 0
        for d in doc_ids:
            e = self.pm.lookup(("chunk", d))
            if e is not None:
                self.pm.release(self.pm.acquire(e))
            else:
                misses += 1
                self.pm.release(self.pm.insert(("chunk", d), self.doc_tokens))
        return misses


def simulate(policy: str, n_replicas: int, stream: list, fit_chunks: int, doc_tokens: int, concurrency: int,
             base_ms: float, miss_ms: float, warmup: float, settings: AffinitySettings, report_s: float,
             seed: int = 0) -> dict:
    replicas = [Replica(fit_chunks, doc_tokens) for _ in range(n_replicas)]
    ids = tuple(f"replica-{i}" for i in range(n_replicas))
    table, rr, rng = RendezvousTable(), RoundRobin(), random.Random(seed)
    view = ResidencyView(clock=lambda: now) if policy == "affinity" else None
    last_report = -report_s
    counted_from = int(len(stream) * warmup)
    hits = misses = 0
    t_start = None
    events: list = []  # (finish time, replica index)
    now, done = 0.0, 0

    def route(doc_ids) -> int:
        nonlocal last_report
        if policy == "round_robin":
            return rr.rank(n_replicas)[0]
        if policy == "least_loaded":  # power of two choices
            a, b = rng.sample(range(n_replicas), 2) if n_replicas > 1 else (0, 0)
            return a if replicas[a].in_flight <= replicas[b].in_flight else b
        keys = tuple(f"doc{d}" for d in doc_ids)
        if view is not None and now - last_report >= report_s:  # the replicas' periodic reports
            last_report = now
            for rid, r in zip(ids, replicas):
                view.report(rid, r.resident(), now, now)
        best = rank_replicas(ChunkRoute(keys, (doc_tokens,) * len(keys)), ids, [r.in_flight for r in replicas],
                             view, settings, table)[0]
        if view is not None:
            view.sent(ids[best], keys)
        return best

    def dispatch(i: int, doc_ids) -> None:
        nonlocal hits, misses, t_start
        r = replicas[route(doc_ids)]
        missed = r.place(doc_ids)
        if i >= counted_from:
            if t_start is None:
                t_start = now
            hits += len(doc_ids) - missed
            misses += missed
        r.in_flight += 1
        r.free_at = max(now, r.free_at) + (base_ms + miss_ms * missed) / 1e3
        heapq.heappush(events, (r.free_at, replicas.index(r), i))

    nxt = 0
    for _ in range(min(len(stream), concurrency * n_replicas)):
        dispatch(nxt, stream[nxt])
        nxt += 1
    # throughput while the loop is full: from the first counted dispatch to the last dispatch
    # (after it the replicas drain unevenly, and a run's length would decide its number)
    finished, t_end = 0, None
    while events:
        now, ri, i = heapq.heappop(events)
        replicas[ri].in_flight -= 1
        done += 1
        if t_start is not None and t_end is None:
            finished += 1
        if nxt < len(stream):
            dispatch(nxt, stream[nxt])
            nxt += 1
            if nxt == len(stream):
                t_end = now
    seconds = (t_end or now) - (t_start or 0.0)
    counted = len(stream) - counted_from
    loads = [r.pm.counters.get("chunk_inserted_pages", 0) for r in replicas]
    return {"pool_hit_ratio": round(hits / max(1, hits + misses), 4),
            "throughput_req_per_s": round(finished / seconds, 2) if seconds > 0 else None,
            "throughput_per_replica_req_per_s": round(finished / seconds / n_replicas, 2) if seconds > 0 else None,
            "misses_per_request": round(misses / max(1, counted), 3),
            "inserted_pages_max_over_mean": round(max(loads) / (sum(loads) / len(loads)), 3) if sum(loads) else None}


def plot(records: list[dict], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return None
    groups = sorted({(r["popularity"], r["budget"]) for r in records})
    fig, axes = plt.subplots(2, len(groups), figsize=(4.2 * len(groups), 7), squeeze=False)
    for col, (pop, budget) in enumerate(groups):
        for policy in POLICIES:
            rs = sorted((r for r in records if r["mode"] == policy and r["popularity"] == pop
                         and r["budget"] == budget), key=lambda r: r["replicas"])
            if not rs:
                continue
            x = [r["replicas"] for r in rs]
            axes[0][col].plot(x, [r["pool_hit_ratio"] for r in rs], marker="o", label=policy)
            axes[1][col].plot(x, [r["throughput_per_replica_req_per_s"] for r in rs], marker="o",
                              label=policy)
        axes[0][col].set_title(f"{pop}, budget {budget} per replica")
        for row, label in ((0, "pool hit ratio"), (1, "throughput per replica (req/s)")):
            ax = axes[row][col]
            ax.set_xscale("log", base=2)
            ax.set_xlabel("replicas")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
        axes[0][col].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--requests-per-replica", type=int, default=500,
                    help="At least this many requests per replica (64 replicas: 32,000).")
    ap.add_argument("--replicas", default="1,2,4,8,16,32,64")
    ap.add_argument("--budgets", default="0.1,0.25", help="Per-replica pool, as a fraction of the corpus.")
    ap.add_argument("--popularity", default="zipf,uniform")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--concurrency", type=int, default=32, help="Requests in flight per replica.")
    ap.add_argument("--base-ms", type=float, default=17.0)
    ap.add_argument("--miss-ms", type=float, default=12.9)
    ap.add_argument("--warmup", type=float, default=0.25, help="Fraction of the requests not counted.")
    ap.add_argument("--load-factor", type=float, default=AffinitySettings.load_factor)
    ap.add_argument("--home-weight", type=float, default=AffinitySettings.home_weight)
    ap.add_argument("--report-s", type=float, default=1.0,
                    help="Simulated seconds between the replicas' residency reports to the router.")
    ap.add_argument("--out", default="scaleout_sim")
    ap.add_argument("--plot", metavar="JSON", help="Only plot the records of an earlier run (PNG beside it).")
    args = ap.parse_args()
    if args.plot:
        import json

        print(f"-> {plot(json.loads(Path(args.plot).read_text()), Path(args.plot).with_suffix('.png'))}")
        return
    import numpy as np

    from lazy_rag.bench.workload import WorkloadSpec, make_workload

    settings = AffinitySettings(load_factor=args.load_factor, home_weight=args.home_weight)
    env = environment()
    records = []
    for popularity in args.popularity.split(","):
        counts = [int(x) for x in args.replicas.split(",")]
        spec = WorkloadSpec(requests=max(args.requests, args.requests_per_replica * max(counts)), popularity=popularity)
        full = [r.doc_ids for r in make_workload(spec, np.arange(1000, 2000)).requests]
        for budget in [float(b) for b in args.budgets.split(",")]:
            fit = round(budget * spec.docs)
            for n in counts:
                stream = full[:max(args.requests, args.requests_per_replica * n)]
                for policy in args.policies.split(","):
                    t0 = time.perf_counter()
                    metrics = simulate(policy, n, stream, fit, spec.doc_tokens, args.concurrency, args.base_ms,
                                       args.miss_ms, args.warmup, settings, args.report_s)
                    records.append({
                        "benchmark": "scaleout_sim", "mode": policy, "device": "simulation",
                        "replicas": n, "budget": budget, "budget_chunks_per_replica": fit,
                        "popularity": popularity, "zipf_a": spec.zipf_a, "docs": spec.docs,
                        "doc_tokens": spec.doc_tokens, "k": spec.k, "requests": len(stream),
                        "warmup_fraction": args.warmup, "concurrency_per_replica": args.concurrency,
                        "base_ms": args.base_ms, "miss_ms": args.miss_ms, "eviction": "gdsf",
                        "load_factor": settings.load_factor, "home_weight": settings.home_weight,
                        "report_s": args.report_s, "imbalance_threshold": settings.imbalance_threshold,
                        "seed": spec.seed, **metrics, "sim_seconds": round(time.perf_counter() - t0, 2),
                        "date": env["date"]})
                    m = records[-1]
                    print(f"{popularity:8s} budget {budget:<5} replicas {n:3d} {policy:13s} "
                          f"hit {m['pool_hit_ratio']:.3f} "
                          f"{m['throughput_req_per_s']:9.1f} req/s", flush=True)
    path = write_records(RESULTS / f"{args.out}.json", records)
    print(f"-> {path}")
    png = plot(records, RESULTS / f"{args.out}.png")
    if png:
        print(f"-> {png}")
    print(format_table(records, ["popularity", "budget", "replicas", "mode", "pool_hit_ratio",
                              "throughput_req_per_s", "misses_per_request"]))


if __name__ == "__main__":
    main()
