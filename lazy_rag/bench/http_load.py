"""Load over HTTP: text documents of a given length, and a closed loop of streaming chat clients
against an OpenAI-compatible lazy-rag server (``lazy-rag serve``, with or without replicas).

``benchmarks/server_load.py`` (one server, HTTP against in-process) and
``benchmarks/scaleout_serve.py`` (Ray Serve replicas, affinity against round robin) both send
their requests through ``run_http``; it needs ``httpx`` (a dependency of the server's tests and
of huggingface_hub).
"""
from __future__ import annotations

import asyncio
import json
import time

import numpy as np

# the questions of the benchmarks' requests, in turn (each request also carries its number)
QUESTIONS = ["What is this about?", "Who is named first?", "When did it happen?", "Where is it?",
             "Summarise it in one sentence.", "What number is mentioned?", "Which place is described?"]


def text_documents(tokenizer, source: str, n: int, doc_tokens: int, seed: int) -> list[str]:
    """``n`` distinct documents of about ``doc_tokens`` tokens, cut from ``source`` (real text, so
    that a real model's answers are ordinary) repeated as needed, each tagged to be distinct."""
    ids = tokenizer(source, add_special_tokens=False).input_ids
    rng = np.random.default_rng(seed)
    docs = []
    for i in range(n):
        start = int(rng.integers(0, max(1, len(ids) - 1)))
        take = [ids[(start + j) % len(ids)] for j in range(doc_tokens)]
        docs.append(f"[document {i}] " + tokenizer.decode(take))
    return docs


def summary(name: str, values) -> dict:
    """p50, p99 and mean of ``values`` as ``<name>_p50`` ... (None when there are none)."""
    v = np.asarray(values, dtype=np.float64)
    if not v.size:
        return {f"{name}_p50": None, f"{name}_p99": None, f"{name}_mean": None}
    return {f"{name}_p50": round(float(np.percentile(v, 50)), 2), f"{name}_p99": round(float(np.percentile(v, 99)), 2),
            f"{name}_mean": round(float(v.mean()), 2)}


async def run_http(url: str, requests: list[dict], clients: int, max_tokens: int, model: str = "bench",
                   count_from: int = 0, headers: dict | None = None) -> tuple[dict, list[str | None]]:
    """Send ``requests`` ({"documents": [...], "question": str}) to ``url``'s
    /v1/chat/completions as streaming greedy requests, ``clients`` in flight at a time, each
    client sending its next request as soon as its last one ends. Returns (metrics, answers).

    TTFT is from sending to the first content delta. The metrics count the requests from
    ``count_from`` on (the earlier ones warm the caches): TTFT and latency percentiles,
    throughput over the span from the first counted request's start to the last one's end,
    and ``pool_hit_ratio``, the fraction of the counted requests' chunks that were in the
    serving engine's GPU pool (the ``lazy_rag.chunk_sources`` of each answer's last event)."""
    import httpx

    n = len(requests)
    ttft, total, answers = [None] * n, [None] * n, [None] * n
    started, ended, tokens = [None] * n, [None] * n, [0] * n
    sources: list[dict | None] = [None] * n
    errors: list[str] = []
    todo = list(range(n))

    async def client(http: httpx.AsyncClient):
        while todo:
            i = todo.pop(0)
            r = requests[i]
            body = {"model": model, "stream": True, "temperature": 0, "max_tokens": max_tokens,
                    "stream_options": {"include_usage": True}, "documents": r["documents"],
                    "messages": [{"role": "user", "content": r["question"]}]}
            started[i] = t0 = time.perf_counter()
            text = ""
            try:
                async with http.stream("POST", url + "/v1/chat/completions", json=body) as resp:
                    if resp.status_code != 200:
                        errors.append(f"{resp.status_code}: {(await resp.aread())[:200]!r}")
                        continue
                    async for line in resp.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        event = json.loads(line[6:])
                        if "error" in event:
                            errors.append(event["error"]["message"])
                        if event.get("usage"):
                            tokens[i] = event["usage"]["completion_tokens"]
                        if event.get("lazy_rag"):
                            sources[i] = event["lazy_rag"].get("chunk_sources") or {}
                        for c in event.get("choices", []):
                            piece = c.get("delta", {}).get("content")
                            if piece:
                                if ttft[i] is None:
                                    ttft[i] = (time.perf_counter() - t0) * 1e3
                                text += piece
            except httpx.HTTPError as e:
                errors.append(f"{type(e).__name__}: {e}")
                continue
            ended[i] = time.perf_counter()
            total[i] = (ended[i] - t0) * 1e3
            answers[i] = text

    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits, headers=headers) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(clients)))
        wall = time.perf_counter() - t0
    counted = [i for i in range(count_from, n) if answers[i] is not None]
    span = (max(ended[i] for i in counted) - min(started[i] for i in counted)) if counted else 0.0
    chunks = {}
    for i in counted:
        for tier, k in (sources[i] or {}).items():
            chunks[tier] = chunks.get(tier, 0) + k
    rec = {**summary("ttft_ms", [ttft[i] for i in counted if ttft[i] is not None]),
           **summary("latency_ms", [total[i] for i in counted]),
           "throughput_rps": round(len(counted) / span, 3) if span else None,
           "output_tokens_per_s": round(sum(tokens[i] for i in counted) / span, 2) if span else None,
           "pool_hit_ratio": round(chunks.get("pool", 0) / sum(chunks.values()), 4) if sum(chunks.values()) else None,
           "chunks_by_tier": json.dumps(chunks, sort_keys=True), "counted_requests": len(counted),
           "errors": len(errors), "wall_s": round(wall, 2)}
    if errors:
        rec["first_error"] = errors[0][:300]
    return rec, answers
