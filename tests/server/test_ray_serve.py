"""`lazy-rag serve --replicas N` on a local Ray instance: two engine replicas of SmolLM2 behind the
same FastAPI app, started once for the module (Ray Serve is the `ray` extra, which install.sh
installs; without it the fixture fails saying so).

- greedy answers through the replicas equal the single-process server's;
- chunk-affinity routing gives a higher pool hit ratio than round robin on a Zipf workload (one
  deployment, the policy chosen per request, so both runs meet the same replicas and pools);
- killing an engine replica mid-load loses no request that the client retries (503, then a live
  replica), and Ray starts a replacement.
"""
import os
import signal
import socket
import threading
import time

import httpx
import numpy as np
import pytest

from lazy_rag.segments import Chunk

# Ray Serve's own pydantic models warn on import (PydanticDeprecatedSince20)
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
CHAT = "/v1/chat/completions"
HTTP = httpx.Client(timeout=120)
# the Zipf workload: DOCS documents, PER_REQUEST of them per request, drawn Zipf(ZIPF_A)
DOCS, PER_REQUEST, ZIPF_A, REQUESTS = 16, 2, 0.5, 32


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_app():
    """Ray and the application, once: 2 engine replicas (a small KV pool each, so the Zipf
    workload evicts), 1 ingress."""
    import ray
    from ray import serve

    from lazy_rag.engine import EngineConfig
    from lazy_rag.server import EngineSpec, ServerSettings
    from lazy_rag.server.scaleout.application import APP_NAME, ScaleOutOptions, build_application

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    port = free_port()
    # a pool of 40 pages of 16 tokens (SmolLM2's fp32 KV: 46,080 bytes a token): 9 of the Zipf
    # workload's 16 wrapped documents (4 pages each) beside the running requests' own pages, so
    # one replica cannot hold them all and two can between them
    spec = EngineSpec(model="smollm2", device="cpu", engine_config=EngineConfig(kv_bytes=40 * 16 * 46080))
    options = ScaleOutOptions(replicas=2, cpus_per_replica=1, ingress_replicas=1, ingress_cpus=1,
                              routing_stats_period_s=0.25, health_check_period_s=1.0, drain_timeout_s=2.0)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_application(spec, ServerSettings(model_name="smollm2"), options), name=APP_NAME,
                  route_prefix="/")
        yield f"http://127.0.0.1:{port}", serve.get_deployment_handle("LazyRagEngine", app_name=APP_NAME)
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def reference(smollm2):
    """The single-process server (`lazy-rag serve` without replicas), over the same SmolLM2."""
    from tests.server.conftest import RunningServer
    from lazy_rag.server import ServerSettings, create_app

    s = RunningServer(create_app(smollm2, None, ServerSettings(model_name="smollm2", engine_process=False)))
    yield s
    s.stop()


def engine_pids(handle, calls: int = 4) -> set:
    """The engine replicas' process ids (calls without chunks go to the replicas in turn; one
    that died a moment ago may still be tried once)."""
    pids = set()
    for _ in range(calls + 2):
        try:
            pids.add(handle.info.remote().result(timeout_s=30)["pid"])
        except Exception:  # noqa: BLE001 - a replica the handle has not yet heard is dead
            time.sleep(0.5)
    return pids


def test_answers_equal_the_single_process_server(ray_app, reference):
    base, engine = ray_app
    docs = [{"title": "Ferry", "text": "The ferry to Port Sallow is painted a deep green."},
            "The Marrow Point Lighthouse was completed in 1871."]
    bodies = [
        {"messages": [{"role": "user", "content": "Which colour is the ferry?"}], "documents": docs},
        {"messages": [{"role": "user", "content": "Name a colour."}]},
    ]
    for body in bodies:
        body = {"model": "smollm2", "max_tokens": 6, "temperature": 0, **body}
        want = HTTP.post(reference.base_url + CHAT, json=body).json()["choices"][0]["message"]["content"]
        got = HTTP.post(base + CHAT, json=body).json()
        assert got["choices"][0]["message"]["content"] == want
        assert got["usage"]["prompt_tokens"] > 0 and got["lazy_rag"]["mode"] == "lazy"
    completion = {"model": "smollm2", "max_tokens": 8, "temperature": 0, "prompt": "1, 2, 3, 4,"}
    want = HTTP.post(reference.base_url + "/v1/completions", json=completion).json()["choices"][0]["text"]
    assert HTTP.post(base + "/v1/completions", json=completion).json()["choices"][0]["text"] == want
    with HTTP.stream("POST", base + "/v1/completions", json={**completion, "stream": True}) as r:
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    import json

    assert "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1]) == want
    # both replicas answer (a round-robin pair of the same request through the engine handle)
    from lazy_rag.server.scaleout.serve_driver import chunk_route

    tok = reference.state.llm.tokenizer
    segments = [tok("Question: which colour is the ferry? Documents:").input_ids,
                Chunk(tok("The ferry is green.", add_special_tokens=False).input_ids), tok(" Answer:").input_ids]
    route = chunk_route(segments, policy="round_robin")
    answers = []
    for _ in range(2):
        events = list(engine.options(stream=True).generate.remote(route, segments, False,
                                                                  {"max_new_tokens": 6, "temperature": 0.0}))
        answers.append((events[0][1], events[-1][1].text))
    assert answers[0][0] != answers[1][0] and answers[0][1] == answers[1][1]
    assert len(engine_pids(engine)) == 2


def test_one_ingress_replica_per_engine_replica_unless_told():
    from lazy_rag.errors import LazyRagError
    from lazy_rag.server.scaleout.application import ScaleOutOptions

    assert ScaleOutOptions(replicas=3).ingress_count == 3
    assert ScaleOutOptions(min_replicas=0, max_replicas=8).ingress_count == 8
    assert ScaleOutOptions(replicas=4, ingress_replicas=2).ingress_count == 2
    with pytest.raises(LazyRagError, match="--ingress-replicas must be at least 1, got 0"):
        ScaleOutOptions(ingress_replicas=0)


def zipf_workload(tokenizer, seed: int, tag: str) -> list[list]:
    """REQUESTS prompts of PER_REQUEST documents drawn Zipf(ZIPF_A) from DOCS documents."""
    rng = np.random.default_rng(seed)
    docs = [Chunk(tokenizer(f"Note {tag}-{i}: the {i}th harbour ledger lists {i * 7} crates of salt, "
                            f"{i * 3} barrels of tar and a lantern numbered {1000 + i}.",
                            add_special_tokens=False).input_ids) for i in range(DOCS)]
    p = 1.0 / np.arange(1, DOCS + 1) ** ZIPF_A
    head, tail = tokenizer("Documents:").input_ids, tokenizer(" Which crates?").input_ids
    return [[head, *(docs[d] for d in rng.choice(DOCS, size=PER_REQUEST, replace=False, p=p / p.sum())), tail]
            for _ in range(REQUESTS)]


def pool_hit_ratio(engine, requests, policy: str) -> float:
    """Send ``requests`` through the engine deployment's router with ``policy``, one at a time (two
    in flight made the comparison depend on timing); the fraction of chunks that were in the chosen
    replica's pool."""
    from lazy_rag.server.scaleout.serve_driver import chunk_route

    served = []
    for segments in requests:
        events = list(engine.options(stream=True).generate.remote(
            chunk_route(segments, policy), segments, False, {"max_new_tokens": 1, "temperature": 0.0}))
        assert events[-1][0] == "done", events[-1]
        served.append(events[-1][1].stats.chunk_sources)
    pool = sum(s.get("pool", 0) for s in served)
    return pool / sum(sum(s.values()) for s in served)


def test_affinity_routing_beats_round_robin_on_zipf(ray_app, reference, capsys):
    _, engine = ray_app
    tok = reference.state.llm.tokenizer
    # the same draws over two fresh sets of documents: neither run finds the other's chunks
    round_robin = pool_hit_ratio(engine, zipf_workload(tok, seed=1, tag="a"), "round_robin")
    affinity = pool_hit_ratio(engine, zipf_workload(tok, seed=1, tag="b"), "affinity")
    with capsys.disabled():
        print(f"\n[scale-out] pool hit ratio, {REQUESTS} requests x {PER_REQUEST} of {DOCS} documents, "
              f"Zipf {ZIPF_A}, 2 replicas: affinity {affinity:.3f}, round robin {round_robin:.3f}")
    assert affinity > round_robin


def test_killed_replica_loses_no_retried_request_and_is_replaced(ray_app):
    from openai import OpenAI

    from lazy_rag.server.scaleout.application import APP_NAME, ENGINE_DEPLOYMENT

    base, engine = ray_app
    before = engine_pids(engine)
    assert len(before) == 2
    client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=6, timeout=120)
    answers, failures = [], []

    def load(k: int):
        for j in range(3):
            try:
                r = client.chat.completions.create(
                    model="smollm2", max_tokens=4, temperature=0,
                    messages=[{"role": "user", "content": "Which colour is the ferry?"}],
                    extra_body={"documents": [f"Ledger {k}-{j}: the ferry is green."]})
                answers.append(r.choices[0].message.content)
            except Exception as e:  # noqa: BLE001 - a lost request is what this test looks for
                failures.append(repr(e))

    threads = [threading.Thread(target=load, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    victim = sorted(before)[0]
    os.kill(victim, signal.SIGKILL)
    for t in threads:
        t.join(180)
    assert not failures and len(answers) == 12
    from ray import serve

    deadline = time.time() + 90
    while True:
        status = serve.status().applications[APP_NAME].deployments[ENGINE_DEPLOYMENT]
        if status.replica_states.get("RUNNING") == 2 and str(status.status).endswith("HEALTHY") and \
                "UNHEALTHY" not in str(status.status):
            break
        assert time.time() < deadline, f"no replacement replica within 90 s: {status}"
        time.sleep(0.5)
    after = engine_pids(engine)
    assert victim not in after and len(after) == 2
    r = HTTP.post(base + CHAT, json={"model": "smollm2", "max_tokens": 4, "temperature": 0,
                                     "messages": [{"role": "user", "content": "Hello"}]})
    assert r.status_code == 200
