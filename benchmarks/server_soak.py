"""Soak of `lazy-rag serve` as a shared service: several tenants (API keys) send a mix of
retrieval, document and plain requests, streamed or not, some hanging up early, while the engine
process is killed every few minutes (the server restarts it) and the served index is re-built
underneath; every answer that completes is compared with the same request's uninterrupted answer.

The server is the real one in its own process (``lazy_rag.server.serve``: the engine in a child
process, tenants from a keys file); this process builds the index (a child process each time),
drives the clients (asyncio + httpx), kills the engine and rebuilds. One tenant is given a small
in-flight limit and more than its share of clients, so 429s are part of the mix.

Figures: requests by outcome (ok, ok but a different answer, hung up on purpose, 429/503/4xx/5xx
by code, an error event inside a stream, transport errors), answers equal to the uninterrupted
ones, engine kills and restarts, rebuilds, the resident memory of the server and engine processes
after the warm-up and at the end, and the KV pool at the end once idle (pages held privately or
in use but uncached would be leaks).

    python benchmarks/server_soak.py --minutes 30                       # CPU, SmolLM2: the 30-minute soak
    python benchmarks/server_soak.py --minutes 3 --kill-every 60 --rebuild-every 75 --out server_soak_short
    python3 benchmarks/server_soak.py --device cuda --model /tmp/stage/qwen.gguf --minutes 10 --clients 32 \\
        --kill-every 120 --rebuild-every 150 --out server_soak_gpu --results $OUT

A control run with the same load and nothing interrupted (`--kill-every 0 --rebuild-every 0
--disconnect 0`) shows how many answers differ from the ones given alone through batching alone:
on a GPU in bf16 a batch's composition changes the sums' rounding, and a greedy answer can
take another token where two were nearly tied. The record keeps each request's differing
answers (all of them, with counts) beside its reference, and the outcomes per request kind.
Given that control run's record (``--control FILE``), a soak also counts the completed answers
that the control run never gave for the same request (``answers_outside_control``): an
interruption that corrupted an answer shows there, while batching alone does not.

    python3 benchmarks/server_soak.py ... --kill-every 0 --rebuild-every 0 --disconnect 0 --out soak_control
    python3 benchmarks/server_soak.py ... --control $OUT/soak_control.json --out server_soak_gpu

Appends one record to benchmarks/results/<out>.json (or --results DIR/<out>.json).
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import random
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

ROOT = Path(__file__).resolve().parents[1]

QUESTIONS = ["In what year was the Marrow Point Lighthouse completed?", "Who designed the lighthouse?",
             "What colour is the ferry to Port Sallow?", "What does the bakery sell in the morning?",
             "Which river does the bridge cross?", "What is kept in the observatory?"]
DOCUMENTS = ["The ferry to Port Sallow is painted a deep green and leaves twice a day from the north pier.",
             "The Marrow Point Lighthouse was completed in 1871 after four years of work on the granite cliff.",
             "The bakery on Mill Street sells rye bread in the morning and seed cakes after noon.",
             "The old bridge crosses the river Lenn at its narrowest point, below the canal lock.",
             "The observatory keeps a brass telescope whose mirror was ground by the town's clockmaker.",
             "Every winter the harbour master records the storms that close the pier for more than a day."]
EXTRA = ("The soak's extra file is added and removed by the rebuilds; no question is about it. "
         "It tells of a salt cellar, a rope walk and a net loft on the east quay.\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the child processes: the index build and the server ------------------------------------------
def build_index(work: Path, model: str, device: str) -> None:
    from lazy_rag import LazyIndex

    LazyIndex.build([str(work / "corpus")], work / "index", model=model, device=device, progress=False,
                    wait_lock=120)


def run_server(work: Path, model: str, device: str, port: int, kill_every: float) -> None:
    from lazy_rag.server import EngineSpec, ServerSettings, serve
    from lazy_rag.server.engine_process import RestartPolicy
    from lazy_rag.server.tenants import Tenants

    # a child killed every `kill_every` s has served long enough to start the restart count again
    restart = RestartPolicy(attempts=5, backoff_s=1.0, stable_s=min(60.0, kill_every / 2))
    settings = ServerSettings(model_name="m", tenants=Tenants.from_file(work / "keys.json"), engine_restart=restart,
                              max_queue=64)
    serve(EngineSpec(model=model, device=device, index_dir=str(work / "index")), settings=settings, port=port,
          log_level="warning", drain_timeout=30)


# -- the clients ------------------------------------------------------------------------------------
KINDS = ("rag", "documents", "plain")


def kind_of(i: int) -> str:
    """Request ``i``'s kind in ``request_set``."""
    return KINDS[i % len(KINDS)]


def request_set(rng: random.Random, n: int) -> list[dict]:
    """``n`` distinct request bodies (without model and stream): retrieval, documents, plain."""
    out = []
    for i in range(n):
        q = QUESTIONS[i % len(QUESTIONS)]
        kind = kind_of(i)
        body = {"max_tokens": 0, "temperature": 0, "messages": [{"role": "user", "content": q}]}
        if kind == "rag":
            body["rag"] = {"top_k": 2 + i % 2}
        elif kind == "documents":
            body["documents"] = rng.sample(DOCUMENTS, 2 + i % 2)
        out.append(body)
    return out


async def ask(client, url: str, key: str, body: dict, stream: bool, hang_up: bool) -> tuple[str, str | None]:
    """(outcome, answer text when it completed); a refusal's outcome ends in its Retry-After
    seconds after a '|'."""
    import httpx

    headers = {"Authorization": f"Bearer {key}"}
    try:
        if not stream:
            try:  # hanging up: giving up on the answer after 0.3 s
                r = await client.post(url, json=body, headers=headers, timeout=0.3 if hang_up else 600)
            except httpx.TimeoutException:
                if hang_up:
                    return "hung_up", None
                raise
            if r.status_code != 200:
                return f"{r.status_code}:{error_code(r)}|{r.headers.get('retry-after', '')}", None
            return "ok", r.json()["choices"][0]["message"]["content"]
        text = []
        async with client.stream("POST", url, json={**body, "stream": True}, headers=headers, timeout=600) as r:
            if r.status_code != 200:
                await r.aread()
                return f"{r.status_code}:{error_code(r)}|{r.headers.get('retry-after', '')}", None
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return f"stream_error:{event['error'].get('code')}", None
                delta = (event.get("choices") or [{}])[0].get("delta") or {}
                if delta.get("content"):
                    text.append(delta["content"])
                    if hang_up:
                        return "hung_up", None
        return "ok", "".join(text)
    except httpx.HTTPError as e:
        return f"transport:{type(e).__name__}", None


def error_code(r) -> str | None:
    try:
        return (r.json().get("error") or {}).get("code")
    except ValueError:
        return None


def rss_mb(pid: int | None) -> float | None:
    import psutil

    try:
        return round(psutil.Process(pid).memory_info().rss / 2 ** 20, 1) if pid else None
    except psutil.Error:
        return None


def metric(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return None


def requests_digest(requests: list[dict]) -> str:
    """What makes two runs' request j the same request (a control run is compared by it)."""
    return hashlib.sha256(json.dumps(requests, sort_keys=True).encode()).hexdigest()[:16]


def control_answers(path: Path, digest: str) -> dict[int, set[str]]:
    """Request -> every answer a control run (nothing interrupted) gave it, from its record in
    ``path`` (the last one made with the same requests)."""
    from lazy_rag.bench.records import load_records

    runs = [r for r in load_records(path) if r.get("requests_digest") == digest]
    if not runs:
        raise SystemExit(f"{path} holds no soak record made with these requests (same --seed, --distinct, "
                         "--max-tokens and corpus); run the control with them first.")
    run = runs[-1]
    seen = {j: {ref} for j, ref in enumerate(run["reference_answers"])}
    for d in run["differing_answers"]:
        seen[d["request"]].update(d["answers"])
    return seen


async def soak(args, work: Path, url: str, server: subprocess.Popen, keys: dict[str, str]) -> dict:
    import httpx

    rng = random.Random(args.seed)
    requests = request_set(rng, args.distinct)
    for body in requests:
        body.update(model="m", max_tokens=args.max_tokens)
    digest = requests_digest(requests)
    control = control_answers(args.control, digest) if args.control else None
    chat = url + "/v1/chat/completions"
    limits = httpx.Limits(max_connections=args.clients * 2 + 8)
    async with httpx.AsyncClient(limits=limits) as client:
        first_key = next(iter(keys.values()))
        auth = {"Authorization": f"Bearer {first_key}"}  # /info is for key holders only
        reference = []
        for body in requests:  # each request's answer, uninterrupted and alone
            outcome, text = await ask(client, chat, first_key, body, stream=False, hang_up=False)
            if outcome != "ok":
                raise SystemExit(f"the reference run of a request failed: {outcome}")
            reference.append(text)
        info = (await client.get(url + "/info", headers=auth)).json()
        memory = {"server_start": rss_mb(server.pid), "engine_start": rss_mb(info["engine_process"])}

        outcomes: Counter = Counter()
        by_kind: dict[str, Counter] = {kind: Counter() for kind in KINDS}
        variants: dict[int, Counter] = {}   # request -> the differing answers it got, and how often
        compared = equal = 0
        outside: Counter = Counter()        # (request, answer) the control run never gave
        kills, rebuilds, rebuild_failures = 0, 0, []
        deadline = time.monotonic() + args.minutes * 60
        tenants = list(keys)

        async def client_loop(i: int):
            nonlocal compared, equal
            # the first tenant (small in-flight limit) gets a third of the clients
            while time.monotonic() < deadline:
                tenant = tenants[0] if i % 3 == 0 else rng.choice(tenants[1:])
                j = rng.randrange(len(requests))
                stream = rng.random() < 0.5
                hang_up = rng.random() < args.disconnect
                outcome, text = await ask(client, chat, keys[tenant], requests[j], stream, hang_up)
                outcome, _, retry_after = outcome.partition("|")
                if outcome == "ok":
                    compared += 1
                    equal += text == reference[j]
                    if text != reference[j]:
                        outcome = "ok_differs"
                        variants.setdefault(j, Counter())[text] += 1
                    if control is not None and text not in control[j]:
                        outside[(j, text)] += 1
                outcomes[outcome] += 1
                by_kind[kind_of(j)][outcome] += 1
                if retry_after:  # as a well-behaved client
                    await asyncio.sleep(float(retry_after))
                elif outcome.startswith(("stream_error", "transport")):
                    await asyncio.sleep(1.0)

        restart_s = []

        async def killer():
            nonlocal kills
            while True:
                await asyncio.sleep(args.kill_every)
                if time.monotonic() > deadline - 5:
                    return
                pid = (await client.get(url + "/info", headers=auth)).json()["engine_process"]
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    continue
                kills += 1
                t0 = time.monotonic()
                await asyncio.sleep(0.5)
                while (await client.get(url + "/ready")).status_code != 200:  # the restart: spawn, load
                    await asyncio.sleep(0.5)
                restart_s.append(round(time.monotonic() - t0, 1))

        async def rebuilder():
            nonlocal rebuilds
            extra = work / "corpus" / "zz-extra.md"
            while True:
                await asyncio.sleep(args.rebuild_every)
                if time.monotonic() > deadline - 5:
                    return
                if extra.exists():
                    extra.unlink()
                else:
                    extra.write_text(EXTRA)
                proc = await asyncio.create_subprocess_exec(*child_command(args, "--build", work),
                                                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                _, err = await proc.communicate()
                rebuilds += 1
                if proc.returncode:
                    rebuild_failures.append(err.decode(errors="replace")[-500:])

        background = [asyncio.ensure_future(killer())] if args.kill_every else []
        if args.rebuild_every:
            background.append(asyncio.ensure_future(rebuilder()))
        await asyncio.gather(*(client_loop(i) for i in range(args.clients)))
        for task in background:
            task.cancel()
        # idle: what the pool holds once every request is over (a restart may still be under way)
        end = time.monotonic() + 180
        while True:
            text = (await client.get(url + "/metrics")).text
            up, depth = metric(text, "lazy_rag_engine_up"), metric(text, "lazy_rag_queue_depth")
            if (up == 1 and depth == 0 and metric(text, "lazy_rag_requests_running") == 0) or time.monotonic() > end:
                break
            await asyncio.sleep(1)
        info = (await client.get(url + "/info", headers=auth)).json()
        memory.update(server_end=rss_mb(server.pid), engine_end=rss_mb(info["engine_process"]))
        pages = {state: metric(text, f'lazy_rag_pool_pages{{state="{state}"}}')
                 for state in ("total", "in_use", "cached", "private")}
    total = sum(outcomes.values())
    return {"requests": total, "requests_per_s": round(total / (args.minutes * 60), 2),
            "outcomes": dict(sorted(outcomes.items())), "answers_compared": compared, "answers_equal": equal,
            "outcomes_by_kind": {kind: dict(sorted(c.items())) for kind, c in by_kind.items()},
            "requests_digest": digest, "reference_answers": reference,
            # what a differing answer looked like: a different greedy path from one token on (the
            # batch's numerics) or something else
            "differing_answers": [{"request": j, "kind": kind_of(j), "reference": reference[j],
                                   "answers": dict(c.most_common()), "count": sum(c.values())}
                                  for j, c in sorted(variants.items())],
            **({} if control is None else {
                "control_record": str(args.control), "answers_outside_control": sum(outside.values()),
                "outside_control": [{"request": j, "kind": kind_of(j), "answer": text, "count": n,
                                     "reference": reference[j]} for (j, text), n in outside.most_common(20)]}),
            "engine_kills": kills, "engine_restarts": metric(text, "lazy_rag_engine_restarts_total"),
            "restart_s": restart_s,
            "engine_up_at_end": up, "rebuilds": rebuilds, "rebuild_failures": rebuild_failures,
            "rss_mb": memory, "pool_pages_at_end": pages,
            "page_leak": pages["private"] != 0 or pages["in_use"] != pages["cached"]}


def child_command(args, mode: str, work: Path, *extra: str) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), mode, str(work), "--model", args.model,
            "--device", args.device, *extra]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=30)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--device", default="cpu")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--tenants", type=int, default=3)
    p.add_argument("--distinct", type=int, default=24, help="Distinct requests (each with a reference answer).")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--disconnect", type=float, default=0.1, help="Share of requests whose client hangs up early.")
    p.add_argument("--kill-every", type=float, default=180, help="Seconds between engine kills (0: none).")
    p.add_argument("--rebuild-every", type=float, default=300, help="Seconds between index rebuilds (0: none).")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--control", type=Path, help="A control run's record file (nothing interrupted, same requests): "
                                                "count the answers it never gave.")
    p.add_argument("--out", default="server_soak")
    p.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--build", type=Path, help=argparse.SUPPRESS)   # child modes
    p.add_argument("--serve", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.control and not args.control.exists():
        p.error(f"--control {args.control}: no such file; run the control first (see the docstring).")
    if args.build:
        return build_index(args.build, args.model, args.device)
    if args.serve:
        return run_server(args.serve, args.model, args.device, args.port, args.kill_every or 600)

    import httpx

    from lazy_rag.bench.records import environment, load_records, write_records

    work = Path(tempfile.mkdtemp(prefix="lazy-rag-soak-"))
    server = None
    try:
        shutil.copytree(ROOT / "examples" / "corpus", work / "corpus")
        keys = {f"tenant-{i}": f"soak-key-{i}-{random.Random(i).getrandbits(64):x}" for i in range(args.tenants)}
        spec = {name: {"keys": [key]} for name, key in keys.items()}
        spec["tenant-0"]["max_in_flight"] = 2
        (work / "keys.json").write_text(json.dumps({"tenants": spec}))
        t0 = time.monotonic()
        subprocess.run(child_command(args, "--build", work), check=True)
        build_s = time.monotonic() - t0
        port = free_port()
        server = subprocess.Popen(child_command(args, "--serve", work, "--port", str(port), "--kill-every",
                                                str(args.kill_every)))
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 600
        while True:
            try:
                if httpx.get(url + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the server did not start")
            time.sleep(0.5)
        figures = asyncio.run(soak(args, work, url, server, keys))
        server.send_signal(signal.SIGTERM)
        figures["server_exit_code"] = server.wait(120)
    finally:
        if server is not None and server.poll() is None:
            server.kill()
        shutil.rmtree(work, ignore_errors=True)
    record = {"benchmark": "server_soak", **environment(), "model": args.model, "minutes": args.minutes,
              "clients": args.clients, "tenants": args.tenants, "distinct_requests": args.distinct,
              "max_tokens": args.max_tokens, "disconnect_share": args.disconnect, "kill_every_s": args.kill_every,
              "rebuild_every_s": args.rebuild_every, "first_build_s": round(build_s, 1), **figures,
              "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                       text=True).stdout.strip() or None,
              "command": "python " + " ".join(shlex.quote(a) for a in sys.argv)}
    path = args.results / f"{args.out}.json"
    records = load_records(path) if path.exists() else []
    write_records(path, records + [record])
    print(json.dumps(record, indent=1))
    print(f"record appended to {path}")


if __name__ == "__main__":
    main()
