"""Scale-out measured: the paper's workload sent over HTTP to the Ray Serve application of
`lazy-rag serve --replicas N` (one engine replica per GPU), for each replica count and routing
policy, side by side in one process and one Ray instance.

Each point deploys the application afresh (fresh replicas, so empty pools), then streams
``--requests`` chat requests with explicit ``documents`` through Serve's HTTP proxy from
``--concurrency`` clients per replica (a closed loop: each client sends its next request as its
last one ends). The documents are ``--docs`` texts of about ``--doc-tokens`` tokens; each request
names ``--k`` of them drawn as the serving benchmark draws them (``lazy_rag.bench.workload``:
Zipf ``--zipf-a`` without replacement). Each replica's GPU pool holds ``--budget`` of the
documents' KV beside its running requests' own pages (or ``--kv-gib``); its host tier holds all of
them, as in `lazy-rag bench`: every replica encodes every document into it when it starts
(`lazy-rag serve --warm-documents`; ``--cold`` leaves the replicas empty, so each encodes a
document the first time it is routed one), so a pool miss is a copy from pinned host memory, not
a re-encode. The first ``--warmup`` of the requests fill the pools and are not counted.

Per point: throughput (req/s over the counted requests' span), TTFT p50/p99 (from the client's
send to the first streamed token), output tokens/s, and the pool hit ratio (the fraction of the
counted requests' chunks found in the serving replica's GPU pool, from each answer's
``lazy_rag.chunk_sources``); per multi-replica point, its throughput over the one-replica point's;
and the CPU cores each group of processes used over the load, all of them and the busiest one
(``cpu_cores_proxy``, ``_ingress``, ``_engine``, ``_client``, ...: ``lazy_rag.bench.proc_cpu``),
which says whether a single interpreter (Serve's HTTP proxy, say) is the ceiling.

    # the GPU run of issue 23 (two GPUs; Ray Serve staged as benchmarks/device/README.md says)
    python3 benchmarks/scaleout_serve.py --random llama-3.1-8b --tokenizer $PWD/.gpu/tokenizer --device cuda \\
        --replicas 1,2 --ingress-replicas 2 --requests 1920 --out scaleout_serve_h100x2_warm
    # on a CPU (SmolLM2, two replicas sharing the cores: routing and hit ratios, not speed)
    python3 benchmarks/scaleout_serve.py --model smollm2 --device cpu --docs 24 --doc-tokens 96 --k 3 \\
        --zipf-a 1.2 --requests 96 --concurrency 2 --output-tokens 4 --out scaleout_serve_cpu

Records: benchmarks/results/<out>.json (flat, one per point), rewritten after every point so a run
cut off keeps what it measured.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import os
import socket
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_config(args):
    """The model's transformers config, without its weights (for the KV bytes of a token)."""
    if args.random:
        from lazy_rag.random_models import random_config

        return random_config(args.random)
    from transformers import AutoConfig

    from lazy_rag.models import resolve_model_path

    return AutoConfig.from_pretrained(resolve_model_path(args.model))


def kv_bytes_per_token(config, device: str) -> int:
    """K and V of one token over all layers, in the engine's KV dtype (bf16 on CUDA, fp32 on CPU)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_elem = 2 if device.startswith("cuda") else 4
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * per_elem


def pool_sizes(args, doc_lengths: list[int], prompt_extra: int, per_token: int) -> tuple[int, int]:
    """(GPU pool bytes, host tier bytes) of one replica: ``--budget`` of the documents' pages
    (their mean length) plus the running requests' own pages (the question, template and answer
    of ``--concurrency`` requests, and a page of rounding per run); the host tier holds every
    document. ``--kv-gib`` / ``--host-gib`` override."""
    page = 64 if args.device.startswith("cuda") else 16
    doc_pages = math.ceil(sum(doc_lengths) / len(doc_lengths) / page)
    private = math.ceil((prompt_extra + args.output_tokens) / page) + args.k + 2
    fit = max(args.k, round(args.budget * args.docs))
    pool = (fit * doc_pages + args.concurrency * private) * page * per_token
    host = int(sum(math.ceil(n / page) for n in doc_lengths) * page * per_token * 1.1) + (64 << 20)
    if args.kv_gib is not None:
        pool = int(args.kv_gib * 2**30)
    if args.host_gib is not None:
        host = int(args.host_gib * 2**30)
    return pool, host


def build_requests(args, docs: list[str]) -> list[dict]:
    """The serving benchmark's document draws (``make_workload``), as chat requests over texts."""
    import numpy as np

    from lazy_rag.bench.http_load import QUESTIONS
    from lazy_rag.bench.workload import WorkloadSpec, make_workload

    spec = WorkloadSpec(docs=args.docs, doc_tokens=1, k=args.k, requests=args.requests, popularity=args.popularity,
                        zipf_a=args.zipf_a, output_tokens=args.output_tokens, head_tokens=0, question_tokens=1,
                        seed=args.seed)
    return [{"documents": [docs[d] for d in r.doc_ids], "question": f"{QUESTIONS[r.index % len(QUESTIONS)]} "
             f"(request {r.index})"} for r in make_workload(spec, np.arange(1000, 1001)).requests]


def ray_process_group(driver_pid: int):
    """``classify`` for ``proc_cpu.cores_by_group``: this process is the load generator; Ray names
    its actors' processes ``ray::<class>`` (Serve's replicas ``ray::ServeReplica:<app>:<deployment>``)."""
    from lazy_rag.server.scaleout.application import ENGINE_DEPLOYMENT, INGRESS_DEPLOYMENT

    def classify(pid: int, cmd: str) -> str | None:
        if pid == driver_pid:
            return "client"
        for marker, group in (("ProxyActor", "proxy"), (INGRESS_DEPLOYMENT, "ingress"), (ENGINE_DEPLOYMENT, "engine"),
                              ("ServeController", "controller"), ("raylet", "ray_system"), ("gcs_server", "ray_system")):
            if marker in cmd:
                return group
        return None

    return classify


def wait_ready(url: str, seconds: float = 900) -> None:
    import httpx

    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            if httpx.get(url + "/ready", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise SystemExit(f"the application at {url} was not ready after {seconds:.0f} s")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--random", default=None, help="a random-weights architecture (lazy_rag.random_models)")
    ap.add_argument("--tokenizer", default=None, help="tokenizer folder for --random")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--replicas", default="1,2", help="replica counts, one deployment each")
    ap.add_argument("--policies", default="affinity,round_robin",
                    help="routing policies of the multi-replica points (one replica is measured once)")
    ap.add_argument("--docs", type=int, default=100)
    ap.add_argument("--doc-tokens", type=int, default=2048)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--popularity", default="zipf", choices=("zipf", "uniform"))
    ap.add_argument("--zipf-a", type=float, default=2.1)
    ap.add_argument("--requests", type=int, default=960)
    ap.add_argument("--concurrency", type=int, default=32, help="requests in flight per replica")
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--warmup", type=float, default=0.25, help="fraction of the requests not counted")
    ap.add_argument("--budget", type=float, default=0.25, help="fraction of the documents one replica's pool holds")
    ap.add_argument("--kv-gib", type=float, default=None, help="each replica's GPU pool (overrides --budget)")
    ap.add_argument("--host-gib", type=float, default=None, help="each replica's host tier (default: every document)")
    ap.add_argument("--cpus-per-replica", type=float, default=1.0)
    ap.add_argument("--ingress-replicas", type=int, default=None,
                    help="HTTP/tokenizing replicas (default: one per engine replica, as `lazy-rag serve` deploys); "
                         "the GPU runs gave every point 2")
    ap.add_argument("--cold", action="store_true",
                    help="replicas start empty (by default each encodes every document into its host tier when it "
                         "starts, `lazy-rag serve --warm-documents`, as `lazy-rag bench` fills its host tier)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="scaleout_serve")
    ap.add_argument("--results-dir", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    if args.random and not args.tokenizer:
        ap.error("--random needs --tokenizer (a folder with a tokenizer for the text documents)")
    counts = sorted({int(x) for x in args.replicas.split(",")})
    if counts[0] != 1:
        ap.error("--replicas must include 1: every multi-replica point is compared with one replica")
    policies = [p for p in args.policies.split(",") if p]

    import ray
    import torch
    import transformers
    from ray import serve

    from lazy_rag.bench.http_load import run_http, text_documents
    from lazy_rag.bench.proc_cpu import cores_by_group, process_cpu
    from lazy_rag.bench.records import environment, write_records
    from lazy_rag.engine import EngineConfig
    from lazy_rag.server import EngineSpec, ServerSettings
    from lazy_rag.server.prompts import Document, chat_with_documents
    from lazy_rag.server.scaleout.application import APP_NAME, ScaleOutOptions, build_application

    env = environment()
    spec = EngineSpec(model=None if args.random else args.model, device=args.device, random=args.random,
                      tokenizer=args.tokenizer)
    tokenizer = spec.load_tokenizer()
    source = " ".join(p.read_text() for p in sorted((ROOT / "examples" / "corpus").glob("*")))
    docs = text_documents(tokenizer, source, args.docs, args.doc_tokens, args.seed)
    requests = build_requests(args, docs)
    doc_lengths = [len(tokenizer(d, add_special_tokens=False).input_ids) for d in docs]
    # the prompt's tokens besides its documents (template, question), with the longest request number
    sample = chat_with_documents(tokenizer, [("user", requests[0]["question"] + " (request 99999)")],
                                 [Document("x")])
    prompt_extra = sum(len(tokenizer(s, add_special_tokens=False).input_ids) for s in sample if isinstance(s, str))
    per_token = kv_bytes_per_token(model_config(args), args.device)
    pool, host = pool_sizes(args, doc_lengths, prompt_extra, per_token)
    spec = dataclasses.replace(spec, engine_config=EngineConfig(kv_bytes=pool, host_bytes=host,
                                                                max_num_seqs=args.concurrency),
                               warm_documents=() if args.cold else tuple(docs))
    count_from = int(len(requests) * args.warmup)
    out = Path(args.results_dir) / f"{args.out}.json"
    base = {"benchmark": "scaleout_serve", "device": env["device"], "gpus": torch.cuda.device_count(),
            "model": args.random or args.model, "docs": args.docs, "doc_tokens_mean": round(sum(doc_lengths) / len(docs)),
            "k": args.k, "popularity": args.popularity, "zipf_a": args.zipf_a if args.popularity == "zipf" else None,
            "output_tokens": args.output_tokens, "requests": len(requests), "counted_requests_planned":
            len(requests) - count_from, "concurrency_per_replica": args.concurrency, "budget": args.budget,
            "pool_gib_per_replica": round(pool / 2**30, 3), "host_gib_per_replica": round(host / 2**30, 3),
            "torch": torch.__version__, "transformers": transformers.__version__, "ray": ray.__version__,
            "date": env["date"], "transport": "http",
            "warm_documents": 0 if args.cold else len(docs)}
    points = [(1, "single")] + [(n, p) for n in counts if n > 1 for p in policies]
    ingress = args.ingress_replicas or counts[-1]  # the most any point deploys
    cpus = max(os.cpu_count() or 1, int(counts[-1] * args.cpus_per_replica + ingress + 1))
    ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False, configure_logging=False)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    records: list[dict] = []
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        for n, policy in points:
            options = ScaleOutOptions(replicas=n, routing="affinity" if policy == "single" else policy,
                                      cpus_per_replica=args.cpus_per_replica, ingress_replicas=args.ingress_replicas)
            settings = ServerSettings(model_name="bench", max_queue=args.concurrency * 2)
            t0 = time.perf_counter()
            serve.run(build_application(spec, settings, options), name=APP_NAME, route_prefix="/")
            wait_ready(url)
            deploy_s = time.perf_counter() - t0
            cpu_before, t_load = process_cpu(), time.perf_counter()
            rec, _ = asyncio.run(run_http(url, requests, args.concurrency * n, args.output_tokens,
                                          count_from=count_from))
            # which process was busy over the whole load (warm-up included): one near 1.0 core is a
            # single interpreter at its limit
            cpu = cores_by_group(cpu_before, process_cpu(), time.perf_counter() - t_load, ray_process_group(os.getpid()))
            serve.delete(APP_NAME)  # the next point starts with fresh replicas and empty pools
            records.append({**base, "mode": policy, "replicas": n, "deploy_s": round(deploy_s, 1),
                            "ingress_replicas": options.ingress_count, **rec, **cpu})
            single = next(r for r in records if r["mode"] == "single")
            records[-1]["throughput_vs_1_replica"] = (round(rec["throughput_rps"] / single["throughput_rps"], 3)
                                                      if rec["throughput_rps"] and single["throughput_rps"] else None)
            write_records(out, records)
            print(f"replicas {n} {policy:12s} " + " ".join(f"{k}={rec[k]}" for k in (
                "throughput_rps", "ttft_ms_p50", "ttft_ms_p99", "pool_hit_ratio", "errors")), flush=True)
            print("  CPU cores (all / busiest process): " + ", ".join(
                f"{g} {cpu[f'cpu_cores_{g}']}/{cpu[f'cpu_cores_{g}_busiest']}" for g in
                ("client", "proxy", "ingress", "engine", "controller", "ray_system") if f"cpu_cores_{g}" in cpu), flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    print(f"\n{'replicas':>8} {'routing':<12} {'req/s':>8} {'x 1 replica':>11} {'TTFT p50 ms':>11} "
          f"{'TTFT p99 ms':>11} {'pool hit':>8} {'errors':>6}")
    for r in records:
        print(f"{r['replicas']:>8} {r['mode']:<12} {r['throughput_rps'] or 0:>8.2f} "
              f"{r['throughput_vs_1_replica'] or 0:>11.3f} {r['ttft_ms_p50'] or 0:>11.1f} {r['ttft_ms_p99'] or 0:>11.1f} "
              f"{r['pool_hit_ratio'] or 0:>8.3f} {r['errors']:>6}")
    print(f"-> {out}")
    return 0 if all(r["errors"] == 0 for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
