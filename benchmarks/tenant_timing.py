"""The timing attack on the server's document cache (``lazy_rag.bench.tenant_timing``): tenant b
times its requests for documents tenant a sent, against cold misses and a's own repeats, with a
and b as two tenants (their documents cached under two salts) and, for comparison, as two keys
of one tenant (one cache: what every client shared before tenants). Reported: the AUC of the
threshold classifier on the client's clock and on the TTFT the server reports, and the medians.

The app runs in this process (httpx's ASGI transport: no sockets, the least noise on the clock),
the engine in its own process, as `lazy-rag serve` runs it.

    python benchmarks/tenant_timing.py                                  # CPU, SmolLM2, 200 trials
    python3 benchmarks/tenant_timing.py --device cuda --random llama-3.1-8b --tokenizer .gpu/tokenizer \\
        --words 1000 --out tenant_timing_gpu --results $OUT

Appends one record per condition to benchmarks/results/<out>.json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
ROOT = Path(__file__).resolve().parents[1]

WORDS = ("harbour lighthouse keeper tower lamp granite island ferry bakery morning bread rye oven "
         "observatory telescope mirror night winter summer storm wall stone crane engineer river bridge "
         "market square bell clock council road mill wheel canal lock barge cargo salt fish net rope "
         "north south east west red white grey green old new long short high low first last").split()


async def measure(app, trials: int, words: int, shared: bool, seed: int) -> dict:
    import httpx

    from lazy_rag.bench.tenant_timing import summary, timing_trials

    rng = random.Random(seed)
    keys = {"a": "key-a", "b": "key-b"}

    def document() -> str:
        return " ".join(rng.choice(WORDS) for _ in range(words)) + f" ({rng.getrandbits(64):x})"

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://soak", timeout=600) as c:
        async def ask(tenant, documents):
            t0 = time.perf_counter()
            r = await c.post("/v1/chat/completions", headers={"Authorization": f"Bearer {keys[tenant]}"},
                             json={"model": "m", "max_tokens": 1, "temperature": 0, "documents": documents,
                                   "messages": [{"role": "user", "content": "What is this about?"}]})
            seconds = time.perf_counter() - t0
            if r.status_code != 200:
                raise SystemExit(f"request failed: {r.status_code} {r.text[:300]}")
            return seconds, r.json()["lazy_rag"]

        return summary(await timing_trials(ask, document, trials, rng, prime_batch=8, shared=shared))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--random", default=None, help="A random-weights architecture (lazy_rag.random_models).")
    p.add_argument("--tokenizer", default=None, help="Its tokenizer folder.")
    p.add_argument("--device", default="cpu")
    p.add_argument("--trials", type=int, default=200)
    p.add_argument("--words", type=int, default=250, help="Words per document.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="tenant_timing")
    p.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    args = p.parse_args()

    from lazy_rag.bench.records import environment, load_records, write_records
    from lazy_rag.server import EngineSpec, ServerSettings, create_app
    from lazy_rag.server.tenants import Tenant, Tenants

    spec = EngineSpec(model=None if args.random else args.model, random=args.random, tokenizer=args.tokenizer,
                      device=args.device)
    records = []
    for shared in (False, True):
        # two tenants (two salts), or two keys of one tenant (one cache)
        b = Tenant("a") if shared else Tenant("b")
        settings = ServerSettings(model_name="m", tenants=Tenants({"key-a": Tenant("a"), "key-b": b}),
                                  max_documents=64)
        app = create_app(spec, None, settings)
        try:
            found = asyncio.run(measure(app, args.trials, args.words, shared, args.seed))
        finally:
            app.state.server.driver.close()
        records.append({"benchmark": "tenant_timing", **environment(), "model": spec.model_name,
                        "condition": "one tenant, two keys (shared cache)" if shared else "two tenants (salted)",
                        "words_per_document": args.words, **found,
                        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                                 capture_output=True, text=True).stdout.strip() or None,
                        "command": "python " + " ".join(shlex.quote(a) for a in sys.argv)})
        print(json.dumps(records[-1], indent=1), flush=True)
    path = args.results / f"{args.out}.json"
    write_records(path, (load_records(path) if path.exists() else []) + records)
    print(f"records appended to {path}")


if __name__ == "__main__":
    main()
