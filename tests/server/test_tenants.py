"""A server many tenants share: API keys name tenants; a tenant's documents are cached under its
own salt (another tenant's request for them is a cold miss, also in its timing, while its own
repeat is a hit); per-tenant limits (429 + Retry-After, 413); no tenant starves another; /metrics
and the log never carry a document's text.

The app runs in this process (httpx's ASGI transport, the engine in a thread) over a tiny model
with a word-level tokenizer (``word_model``), so that a request takes milliseconds."""
import asyncio
import json
import logging
import random
import time

import httpx
import pytest
import torch

from lazy_rag.bench.tenant_timing import summary, timing_trials
from lazy_rag.errors import LazyRagError
from lazy_rag.server import ServerSettings, create_app
from lazy_rag.server.quotas import TokenBucket
from lazy_rag.server.tenants import Tenant, TenantLimits, Tenants
from tests.server.word_model import WORDS, word_llm

KEYS = {"a": "key-a", "b": "key-b"}


@pytest.fixture(scope="module")
def llm():
    # one thread: a tiny model's ops are too small to split, and on a busy machine a second
    # thread only adds waits (10x per step measured) to the times these tests compare
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield word_llm()
    torch.set_num_threads(threads)


def make_app(llm, **settings):
    settings.setdefault("tenants", Tenants.from_env(",".join(f"{t}={k}" for t, k in KEYS.items())))
    return create_app(llm, None, ServerSettings(model_name="m", engine_process=False, **settings))


def run(app, scenario):
    """``scenario(ask)`` on an event loop, ``ask(tenant, documents, **body)`` -> (seconds, response)."""
    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test", timeout=60) as c:
            async def ask(tenant, documents=(), max_tokens=1, **body):
                headers = {"Authorization": f"Bearer {KEYS[tenant]}"} if tenant else {}
                t0 = time.perf_counter()
                r = await c.post("/v1/chat/completions", headers=headers,
                                 json={"model": "m", "max_tokens": max_tokens, "temperature": 0,
                                       "documents": list(documents), **body,
                                       "messages": [{"role": "user", "content": "Q ?"}]})
                return time.perf_counter() - t0, r
            return await scenario(ask, c)
    try:
        return asyncio.run(main())
    finally:
        app.state.server.driver.close()


def test_another_tenants_document_times_as_a_cold_miss_and_ones_own_repeat_as_a_hit(llm):
    """Tenant a sends 200 documents, 25 to a request; after each, in random order per document,
    tenant b sends it (the probe), b sends a fresh one (a cold miss), and a sends it again (its
    own repeat). The same classifier that tells a's repeats from cold misses (the salt is all that
    differs between a repeat and a probe) must not tell b's probes from cold misses
    (``bench.tenant_timing``)."""
    rng = random.Random(0)

    def document():
        return " ".join(rng.choice(WORDS) for _ in range(250))

    async def scenario(ask, client):
        async def timed(tenant, documents):
            seconds, r = await ask(tenant, documents)
            assert r.status_code == 200, r.text
            return seconds, r.json()["lazy_rag"]

        return await timing_trials(timed, document, 200, rng)

    found = summary(run(make_app(llm), scenario))
    for clock in ("client_s", "server_ttft_ms"):
        f = found[clock]
        print(f"{clock}: AUC cold vs own repeat {f['auc_own']}, cold vs other tenant's probe {f['auc_probe']} "
              f"(200 trials; medians: cold {f['median_cold']}, probe {f['median_probe']}, own {f['median_own']})")
        assert f["auc_own"] >= 0.8, f"{clock}: the classifier cannot tell hits from misses here: {f}"
        assert max(f["auc_probe"], 1 - f["auc_probe"]) <= 0.6, f"{clock}: another tenant's document times apart: {f}"


def test_tenants_without_keys_share_one_cache(llm):
    """The other side of the salt: with no keys the clients cannot be told apart, so a document
    one sent is a pool hit for the next (what the salt takes away between tenants)."""
    async def scenario(ask, client):
        doc = " ".join(WORDS[:60])
        first, again = (await ask(None, [doc]))[1], (await ask(None, [doc]))[1]
        return first.json()["lazy_rag"], again.json()["lazy_rag"]

    first, again = run(make_app(llm, tenants=None), scenario)
    assert first["chunk_sources"] == {"encoded": 1} and again["chunk_sources"] == {"pool": 1}


def test_keys_limits_metrics_and_logs(llm, caplog):
    caplog.set_level(logging.DEBUG, logger="lazy_rag")
    secret = "w7 w13 w21 w34 w55 w89 w144 w233 w377"  # a document's text that must not leak
    limited = Tenants({"key-a": Tenant("a", TenantLimits(max_in_flight=1, tokens_per_minute=200,
                                                         max_document_bytes=200)),
                       "key-b": Tenant("b")})

    async def scenario(ask, client):
        out = {}
        _, out["no_key"] = await ask(None)
        r = await client.post("/v1/chat/completions", headers={"Authorization": "Bearer key-c"}, json={})
        out["wrong_key"] = r
        _, out["bytes"] = await ask("a", ["w1 " * 100])
        _, out["count"] = await ask("b", ["w1"] * 5)
        _, out["ok"] = await ask("a", [secret])
        # of the minute's 200 tokens, this one reserves its prompt and 120 new tokens, and is a's one
        # request in flight while it runs; the one after it asks for more than is left
        long = asyncio.ensure_future(ask("a", [secret], max_tokens=120))
        await asyncio.sleep(0.05)
        _, out["in_flight"] = await ask("a", [])
        await long
        _, out["tokens"] = await ask("a", [], max_tokens=100)
        _, out["b_meanwhile"] = await ask("b", [secret])
        out["metrics"] = (await client.get("/metrics")).text
        return out

    out = run(make_app(llm, tenants=limited, max_documents=4, log_prompts=True), scenario)
    for name in ("no_key", "wrong_key"):
        assert out[name].status_code == 401 and out[name].json()["error"]["code"] == "invalid_api_key"
    assert out["bytes"].status_code == 413 and out["bytes"].json()["error"]["code"] == "documents_too_large"
    assert "200" in out["bytes"].json()["error"]["message"]
    assert out["count"].status_code == 400 and "at most 4" in out["count"].json()["error"]["message"]
    assert out["ok"].status_code == 200
    r = out["in_flight"]
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "tenant_requests_in_flight"
    r = out["tokens"]
    assert r.status_code == 429 and r.json()["error"]["code"] == "tenant_tokens_per_minute"
    assert 1 <= int(r.headers["retry-after"]) <= 60
    assert out["b_meanwhile"].status_code == 200  # another tenant's limits are its own
    metrics = out["metrics"]
    assert 'lazy_rag_tenant_refused_requests_total{limit="tenant_requests_in_flight",tenant="a"} 1.0' in metrics
    assert 'lazy_rag_tenant_tokens_total{tenant="b"}' in metrics
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "tenant=a" in logged
    for text in (metrics, logged):
        assert secret not in text and "w144 w233" not in text and "key-a" not in text


def test_a_flooding_tenant_does_not_starve_another(llm):
    """Tenant a keeps 12 requests coming at once against a queue of 8 (its share by default: 4 in
    flight, the rest 429); tenant b's requests, sent meanwhile, are all served, none refused for
    a full queue. (Inside the engine, which runs 2 at a time here, b's are admitted ahead of a's
    waiting ones: tests/engine/test_scheduler.py.)"""
    flood_llm = word_llm(max_num_seqs=2)

    async def scenario(ask, client):
        stop = False
        codes = {"a": [], "b": []}

        async def flood():
            while not stop:
                _, r = await ask("a", [], max_tokens=8)
                codes["a"].append(r.status_code)
                if r.status_code == 429:
                    await asyncio.sleep(0.01)

        floods = [asyncio.ensure_future(flood()) for _ in range(12)]
        await asyncio.sleep(0.3)
        for _ in range(4):
            _, r = await ask("b", [], max_tokens=8)
            codes["b"].append(r.status_code)
        stop = True
        await asyncio.gather(*floods)
        return codes

    codes = run(make_app(flood_llm, max_queue=8), scenario)
    assert codes["b"] == [200] * 4, codes["b"]
    assert 429 in codes["a"] and 200 in codes["a"]


# -- the keys and the limits alone ------------------------------------------------------------------
def test_keys_file_and_environment(tmp_path):
    f = tmp_path / "keys.json"
    f.write_text(json.dumps({"tenants": {"team-a": {"keys": ["ka1", "ka2"], "max_in_flight": 3},
                                         "team-b": {"keys": ["kb"], "tokens_per_minute": 1000}}}))
    t = Tenants.configured(f)
    assert t.find("ka2").name == "team-a" and t.find("kb").limits.tokens_per_minute == 1000
    assert t.find("ka") is None and t.find("") is None and len(t) == 2
    assert t.find("ka1").cache_salt == t.find("ka2").cache_salt != t.find("kb").cache_salt
    env = Tenants.configured(environ={"LAZY_RAG_API_KEYS": "x=k1, y=k2 x=k3"})
    assert env.find("k3").name == "x" and env.find("k2").name == "y"
    assert not Tenants.configured().required and Tenants.configured(api_key="k").find("k").name == "default"
    bad = [({"tenants": {}}, "at least one tenant"),
           ({"tenants": {"a b": {"keys": ["k"]}}}, "tenant name"),
           ({"tenants": {"a": {"keys": []}}}, "keys"),
           ({"tenants": {"a": {"keys": ["k"]}, "b": {"keys": ["k"]}}}, "given twice"),
           ({"tenants": {"a": {"keys": ["k"], "max_in_flight": 0}}}, "positive integer"),
           ({"tenants": {"a": {"keys": ["k"], "rate": 5}}}, "unknown field")]
    for data, words in bad:
        f.write_text(json.dumps(data))
        with pytest.raises(LazyRagError, match=words) as e:
            Tenants.from_file(f)
        assert str(f) in str(e.value) and "'k'" not in str(e.value)  # names the file, never a key
    f.write_text("{not json")
    with pytest.raises(LazyRagError, match="not UTF-8 JSON"):
        Tenants.from_file(f)
    with pytest.raises(LazyRagError, match="not both"):
        Tenants.configured(f, api_key="k")
    with pytest.raises(LazyRagError, match="NAME=KEY"):
        Tenants.from_env("justakey")


def test_token_bucket_refills_and_lets_a_large_request_through_when_full():
    now = [0.0]
    b = TokenBucket(600, clock=lambda: now[0])  # 10 a second
    assert b.take(500) == 0 and b.take(200) == pytest.approx(10.0)  # 100 left: 10 s until 200
    now[0] += 10
    assert b.take(200) == 0
    assert b.take(1000) == pytest.approx(60.0)  # more than a minute's worth: when the bucket is full
    now[0] += 60
    assert b.take(1000) == 0 and b.take(1) > 40  # ... and then the debt is waited out
    b.give_back(10_000)
    assert b.level == 600


def test_server_defaults_give_each_of_several_tenants_half_the_queue():
    two = Tenants.from_env("a=1,b=2")
    assert ServerSettings(tenants=two, max_queue=10).tenant_defaults.max_in_flight == 5
    assert ServerSettings(tenants=two, tenant_max_in_flight=7).tenant_defaults.max_in_flight == 7
    assert ServerSettings(api_key="k").tenant_defaults.max_in_flight is None
    with pytest.raises(LazyRagError, match="positive integer"):
        ServerSettings(tenant_tokens_per_minute=0)


def test_document_token_ids_are_remembered_per_tenant(llm):
    """The HTTP process's token cache is keyed by the tenant's salt too: another tenant's
    document is tokenized again (a hit there would be a faster answer, i.e. a timing signal)."""
    from lazy_rag.server.tokens import DocumentTokens

    cache = DocumentTokens(llm.tokenizer)
    first = cache.ids("w1 w2 w3", "salt-a")
    assert cache.ids("w1 w2 w3", "salt-b") == first and (cache.hits, cache.misses) == (0, 2)
    assert cache.ids("w1 w2 w3", "salt-a") == first and (cache.hits, cache.misses) == (1, 2)
