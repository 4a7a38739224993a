"""HTTP load test of `lazy-rag serve`, side by side with the same requests in-process.

Each request is a chat question over k documents drawn Zipf(a) from a pool (explicit
``documents``: the server encodes each once and reuses its KV at any position). Phase 1 runs the
requests in this process on the engine directly (a closed loop keeping as many requests in flight
as there are clients); phase 2 starts the server (``lazy_rag.server.serve``, what `lazy-rag serve`
runs, its engine in its own process unless --no-engine-process) as its own process and sends the
same requests from concurrent streaming HTTP clients. Each phase runs a
low-load point (one client, requests one after another: the HTTP overhead on TTFT) and a
saturated point (all clients at once: throughput). Greedy answers must be equal in both.

    python benchmarks/server_load.py                              # CPU, SmolLM2, 50 clients
    python benchmarks/server_load.py --no-engine-process --out server_load_cpu_thread   # the engine in a thread
    python benchmarks/server_load.py --compare-drivers 4 --out server_load_cpu_drivers   # the two, alternating
    python benchmarks/server_load.py --device cuda --random llama-3.1-8b --tokenizer .gpu/tokenizer \\
        --doc-tokens 2048 --k 5 --clients 64 --out server_load_h100

Records: benchmarks/results/<out>.json (one per phase and load point).
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from lazy_rag.bench.http_load import QUESTIONS, run_http, summary, text_documents

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

ROOT = Path(__file__).resolve().parents[1]


def build_documents(tokenizer, n: int, doc_tokens: int, seed: int) -> list[str]:
    """``n`` distinct documents of about ``doc_tokens`` tokens, cut from the examples corpus."""
    text = " ".join(p.read_text() for p in sorted((ROOT / "examples" / "corpus").glob("*")))
    return text_documents(tokenizer, text, n, doc_tokens, seed)


def build_requests(docs: list[str], n: int, k: int, zipf_a: float, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed + 1)
    weights = 1.0 / np.arange(1, len(docs) + 1) ** zipf_a
    weights /= weights.sum()
    out = []
    for i in range(n):
        pick = rng.choice(len(docs), size=k, replace=False, p=weights)
        out.append({"documents": [docs[j] for j in pick],
                    "question": f"{QUESTIONS[i % len(QUESTIONS)]} (request {i})"})
    return out


# -- phase 1: in-process ------------------------------------------------------------------------
def run_in_process(llm, requests: list[dict], clients: int, max_tokens: int) -> tuple[dict, list[str]]:
    """The same closed loop as the HTTP clients, on the engine directly: ``clients`` requests in
    flight, the next submitted as soon as one finishes; one thread steps the engine (as the
    server's driver does). TTFT and latency are from submission, as the clients measure them."""
    from lazy_rag.server.prompts import Document, chat_with_documents

    engine = llm.engine
    n = len(requests)
    ttft, total, answers = [None] * n, [None] * n, [None] * n
    tokens, next_i, live = 0, 0, {}

    def submit(i):
        t_sub = time.perf_counter()  # before the prompt is built and tokenized, as a client's clock
        r = requests[i]
        segs = chat_with_documents(llm.tokenizer, [("user", r["question"])], [Document(d) for d in r["documents"]])
        live[i] = (engine.submit(segs, max_new_tokens=max_tokens, temperature=0.0), t_sub)

    t0 = time.perf_counter()
    while next_i < n or live:
        while next_i < n and len(live) < clients:
            submit(next_i)
            next_i += 1
        engine.step()
        now = time.perf_counter()
        for i, (h, t_sub) in list(live.items()):
            if ttft[i] is None and h.pieces:
                ttft[i] = (now - t_sub) * 1e3
            if h.done:
                if h.error is not None:
                    raise h.error
                total[i] = (now - t_sub) * 1e3
                answers[i] = h.result.text
                tokens += h.result.stats.new_tokens
                del live[i]
    wall = time.perf_counter() - t0
    rec = {**summary("ttft_ms", [x for x in ttft if x is not None]), **summary("latency_ms", total),
           "throughput_rps": round(n / wall, 3), "output_tokens_per_s": round(tokens / wall, 2),
           "errors": 0, "wall_s": round(wall, 2)}
    return rec, answers


# -- phase 2: HTTP --------------------------------------------------------------------------------
def start_server(args) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # the server runs in its own process, started by this script (the GPU image has no typer, so
    # not through the `lazy-rag serve` command; the same create_app and uvicorn underneath)
    cmd = [sys.executable, __file__, "--serve-port", str(port), "--device", args.device, "--model", args.model,
           "--clients", str(args.clients)] + (["--kv-gib", str(args.kv_gib)] if args.kv_gib else [])
    cmd.append("--engine-process" if engine_process(args) else "--no-engine-process")
    if args.random:
        cmd += ["--random", args.random, "--tokenizer", args.tokenizer]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    import httpx

    deadline = time.time() + 600
    while True:
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            raise RuntimeError("the server did not start:\n" + (proc.stdout.read() if proc.poll() is not None else ""))
        time.sleep(0.5)


def load_llm(args):
    from lazy_rag import LazyLLM

    if args.random:
        from transformers import AutoTokenizer

        from lazy_rag.random_models import random_model

        model = random_model(args.random, device=args.device)
        return LazyLLM(model, AutoTokenizer.from_pretrained(args.tokenizer), **engine_options(args))
    return LazyLLM.from_pretrained(args.model, device=args.device, **engine_options(args))


def engine_options(args) -> dict:
    return {"kv_bytes": int(args.kv_gib * (1 << 30))} if args.kv_gib else {}


def engine_spec(args):
    """What the server loads (in its engine process, or in its own process with
    --no-engine-process): the same model and engine options as ``load_llm``; a random model is
    built from the same seed."""
    from lazy_rag.engine import EngineConfig
    from lazy_rag.server import EngineSpec

    config = EngineConfig().with_options(**engine_options(args))
    if args.random:
        return EngineSpec(random=args.random, tokenizer=args.tokenizer, device=args.device, engine_config=config)
    return EngineSpec(model=args.model, device=args.device, engine_config=config)


def engine_process(args) -> bool:
    from lazy_rag.server import ServerSettings

    return ServerSettings().engine_process if args.engine_process is None else args.engine_process


def compare_drivers(args, docs, points, base: dict) -> list[dict]:
    """The server's two drivers side by side: both servers up (an idle one costs nothing), each
    point sent to one then the other, the order alternating per round, so that a machine whose
    speed drifts (a shared CPU) affects both alike. No in-process phase: it would be common to both."""
    servers = {}
    try:
        for name, flag in (("process", True), ("in_process", False)):
            servers[name] = start_server(argparse.Namespace(**{**vars(args), "engine_process": flag}))
        for _, url in servers.values():  # warm-up: every document encoded, every point once
            asyncio.run(run_http(url, [{"documents": [d], "question": "Warm up."} for d in docs], 8, 2))
            for _, reqs, clients in points:
                asyncio.run(run_http(url, reqs, clients, args.max_tokens))
        records = []
        for rnd in range(args.compare_drivers):
            for name in (("process", "in_process") if rnd % 2 == 0 else ("in_process", "process")):
                for point, reqs, clients in points:
                    rec, _ = asyncio.run(run_http(servers[name][1], reqs, clients, args.max_tokens))
                    records.append({**base, "mode": "http", "server_engine": name, "point": point, "round": rnd,
                                    "clients": clients, "requests": len(reqs), **rec})
                    print(f"round {rnd} {name} {point}: {rec}", flush=True)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=120)
    print(f"\n{'point':<10} {'req/s process':>14} {'req/s in-process':>17} {'TTFT p50 ms process / in-process':>34}")
    runs = list(records)
    for point, _, _ in points:
        med = {n: {k: float(np.median([r[k] for r in runs if r["server_engine"] == n and r["point"] == point]))
                   for k in ("throughput_rps", "ttft_ms_p50")} for n in servers}
        records.append({**base, "mode": "drivers_compared", "point": point, "rounds": args.compare_drivers,
                        **{f"{n}_{k}_median": round(v, 3) for n, d in med.items() for k, v in d.items()},
                        "process_vs_in_process": round(med["process"]["throughput_rps"]
                                                       / med["in_process"]["throughput_rps"], 4)})
        print(f"{point:<10} {med['process']['throughput_rps']:>14.2f} {med['in_process']['throughput_rps']:>17.2f} "
              f"{med['process']['ttft_ms_p50']:>16.1f} / {med['in_process']['ttft_ms_p50']:.1f}")
    return records


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--random", default=None, help="a random-weights architecture (lazy_rag.random_models)")
    ap.add_argument("--tokenizer", default=None, help="tokenizer folder for --random")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--clients", type=int, default=50, help="concurrent clients at the saturated point")
    ap.add_argument("--requests", type=int, default=100, help="requests at the saturated point")
    ap.add_argument("--low-load-requests", type=int, default=10, help="requests one after another")
    ap.add_argument("--docs", type=int, default=20)
    ap.add_argument("--doc-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--zipf-a", type=float, default=1.2)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3, help="recorded passes per point, after one warm-up pass")
    ap.add_argument("--kv-gib", type=float, default=None, help="KV pool size (default: the engine's)")
    ap.add_argument("--out", default="server_load_cpu")
    ap.add_argument("--results-dir", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                    help="the server's engine in its own process, or in a thread of the server's process "
                         "(default: the server's default, ServerSettings.engine_process)")
    ap.add_argument("--compare-drivers", type=int, default=0, metavar="ROUNDS",
                    help="instead: the server with its engine in its own process against the engine in a thread, "
                         "ROUNDS alternating rounds of both points (HTTP only)")
    ap.add_argument("--serve-port", type=int, default=None, help=argparse.SUPPRESS)  # the server process
    args = ap.parse_args(argv)
    if args.random and not args.tokenizer:
        ap.error("--random needs --tokenizer (a folder with a tokenizer for the text documents)")
    if args.serve_port:
        from lazy_rag.server import ServerSettings, serve

        settings = ServerSettings(model_name="bench", max_queue=max(args.clients, 1) * 2, max_body_bytes=64 << 20,
                                  engine_process=engine_process(args))
        serve(engine_spec(args), None, settings, port=args.serve_port, log_level="warning")
        return 0

    import torch
    import transformers

    # --compare-drivers runs no in-process phase: this process needs the tokenizer only
    llm = None if args.compare_drivers else load_llm(args)
    tokenizer = engine_spec(args).load_tokenizer() if llm is None else llm.tokenizer
    docs = build_documents(tokenizer, args.docs, args.doc_tokens, args.seed)
    low = build_requests(docs, args.low_load_requests, args.k, args.zipf_a, args.seed + 7)
    high = build_requests(docs, args.requests, args.k, args.zipf_a, args.seed)
    device = (torch.cuda.get_device_name(0) if args.device.startswith("cuda")
              else f"cpu ({torch.get_num_threads()} threads, {platform.processor() or platform.machine()})")
    base = {"benchmark": "server_load", "device": device, "model": args.random or args.model,
            "docs": args.docs, "doc_tokens": args.doc_tokens, "k": args.k, "zipf_a": args.zipf_a,
            "max_tokens": args.max_tokens, "kv_gib": args.kv_gib, "torch": torch.__version__, "transformers": transformers.__version__,
            "server_engine": "process" if engine_process(args) else "in_process", "date": time.strftime("%Y-%m-%d")}
    records = []
    points = [("low_load", low, 1), ("saturated", high, args.clients)]
    out = Path(args.results_dir) / f"{args.out}.json"
    if args.compare_drivers:
        records = compare_drivers(args, docs, points, {k: v for k, v in base.items() if k != "server_engine"})
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(records, indent=1) + "\n")
        print(f"-> {out}")
        return 0

    # every document encoded once before timing (both phases then measure reuse, not first encodes);
    # then one unrecorded pass of every point (CUDA graph captures, allocator growth), then the
    # recorded repeats: the two phases run on fresh processes' engines, so each gets the same warm-up
    for d in docs:
        llm.encode_chunk(llm.tokenizer(d, add_special_tokens=False).input_ids)
    answers = {}
    for rep in range(-1, args.repeats):
        for point, reqs, clients in points:
            rec, answers[point] = run_in_process(llm, reqs, clients, args.max_tokens)
            if rep >= 0:
                records.append({**base, "mode": "in_process", "point": point, "repeat": rep, "clients": clients,
                                "requests": len(reqs), **rec})
                print(f"in-process {point} #{rep}: {rec}", flush=True)
    del llm  # the server process loads its own copy: free this one's weights and KV pool first
    gc.collect()
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
        left = torch.cuda.memory_allocated()
        if left > 1 << 30:
            raise SystemExit(f"{left / 2**30:.1f} GiB still allocated after the in-process phase")

    proc, url = start_server(args)
    try:
        asyncio.run(run_http(url, [{"documents": [d], "question": "Warm up."} for d in docs], 8, 2))
        for rep in range(-1, args.repeats):
            for point, reqs, clients in points:
                rec, got = asyncio.run(run_http(url, reqs, clients, args.max_tokens))
                if rep >= 0:
                    same = sum(a == b for a, b in zip(got, answers[point]))
                    records.append({**base, "mode": "http", "point": point, "repeat": rep, "clients": clients,
                                    "requests": len(reqs), **rec, "answers_equal_in_process": same})
                    print(f"http {point} #{rep}: {rec} equal answers {same}/{len(reqs)}", flush=True)
    finally:
        proc.terminate()
        code = proc.wait(timeout=120)
        log = proc.stdout.read()
    if code != 0 or "Traceback" in log:
        print(log[-3000:], file=sys.stderr)
        raise SystemExit(f"the server exited with {code} or logged a traceback")

    # HTTP vs in-process, per point: medians over the repeats
    for point, reqs, clients in points:
        med = {m: {k: float(np.median([r[k] for r in records if r["mode"] == m and r["point"] == point]))
                   for k in ("ttft_ms_p50", "ttft_ms_p99", "latency_ms_p50", "throughput_rps")}
               for m in ("in_process", "http")}
        records.append({**base, "mode": "http_vs_in_process", "point": point, "clients": clients,
                        "requests": len(reqs), "repeats": args.repeats,
                        **{f"{m}_{k}_median": round(v, 3) for m, d in med.items() for k, v in d.items()},
                        "ttft_overhead_ms_p50": round(med["http"]["ttft_ms_p50"] - med["in_process"]["ttft_ms_p50"], 2),
                        "throughput_vs_in_process": round(med["http"]["throughput_rps"]
                                                          / med["in_process"]["throughput_rps"], 4)})
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(records, indent=1) + "\n")
    print(f"\n{'point':<10} {'clients':>7} {'req':>4} {'TTFT p50 in/http ms':>20} {'TTFT p99 in/http ms':>20} "
          f"{'req/s in/http':>14} {'http/in':>7} {'errors':>6}")
    for r in records:
        if r["mode"] != "http_vs_in_process":
            continue
        errors = sum(x["errors"] for x in records if x["mode"] == "http" and x["point"] == r["point"])
        print(f"{r['point']:<10} {r['clients']:>7} {r['requests']:>4} "
              f"{r['in_process_ttft_ms_p50_median']:>9.1f}/{r['http_ttft_ms_p50_median']:<10.1f} "
              f"{r['in_process_ttft_ms_p99_median']:>9.1f}/{r['http_ttft_ms_p99_median']:<10.1f} "
              f"{r['in_process_throughput_rps_median']:>6.2f}/{r['http_throughput_rps_median']:<7.2f} "
              f"{r['throughput_vs_in_process']:>7.3f} {errors:>6}")
    print(f"-> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
