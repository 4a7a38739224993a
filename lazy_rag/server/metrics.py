"""Prometheus metrics of one server (its own registry, so two apps in one process, as in the
tests, never share counters): requests by endpoint and status, TTFT and latency histograms,
token counters, and the engine's state read at scrape time (queue depth, pool pages, chunk hits
per tier: the driver's ``stats``, asked of the engine process when the engine runs there)."""
from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..errors import LazyRagError

log = logging.getLogger("lazy_rag.server")

# the engine's counter of each tier (KVPlanner.admit counts "chunk_" + a request's chunk sources:
# "hits" for the pool, "from_<tier>" for the rest)
CHUNK_TIER_COUNTERS = {"pool": "chunk_hits", "host": "chunk_from_host", "disk": "chunk_from_disk",
                       "encoded": "chunk_from_encoded", "recomputed": "chunk_from_recomputed"}

# seconds: a CPU answer takes seconds, a GPU TTFT tens of milliseconds
_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class EngineCollector:
    """The engine's counters, read when Prometheus scrapes (no copy kept up to date)."""

    def __init__(self, driver):
        self.driver = driver

    def collect(self):
        g = GaugeMetricFamily("lazy_rag_engine_up", "1 while the engine runs (0: its process died; /ready is 503).")
        g.add_metric([], int(self.driver.alive))
        yield g
        c = CounterMetricFamily("lazy_rag_engine_restarts", "Engine processes started after the first (each one "
                                "replacing one that died).")
        c.add_metric([], getattr(self.driver, "restarts", 0))
        yield c
        g = GaugeMetricFamily("lazy_rag_queue_depth", "Requests admitted and not finished (waiting or running).")
        g.add_metric([], self.driver.in_flight)
        yield g
        try:
            s = self.driver.stats()
        except LazyRagError as e:  # the engine is gone or busy past the timeout: its gauges are left out
            log.warning("metrics without the engine's counters: %s", e)
            return
        g = GaugeMetricFamily("lazy_rag_requests_running", "Requests the engine is running now.")
        g.add_metric([], s["requests_running"])
        yield g
        g = GaugeMetricFamily("lazy_rag_pool_pages", "KV pool pages by state.", labels=["state"])
        g.add_metric(["total"], s["pages_total"])
        g.add_metric(["in_use"], s["pages_in_use"])
        g.add_metric(["cached"], s["pages_cached"])
        g.add_metric(["private"], s["pages_private"])
        yield g
        c = CounterMetricFamily("lazy_rag_chunks_served", "Chunks placed in prompts, by the tier that held their "
                                "KV (pool, host, disk; encoded: no tier had it; recomputed: on disk, but encoding "
                                "it was faster than reading it).", labels=["tier"])
        for tier, counter in CHUNK_TIER_COUNTERS.items():
            c.add_metric([tier], s.get(counter, 0))
        yield c
        c = CounterMetricFamily("lazy_rag_engine_failed_requests", "Requests the engine failed (one at a time).")
        c.add_metric([], s["failed_requests"])
        yield c


class RequestCounter:
    """ASGI middleware counting HTTP requests by route and status (pure ASGI, not Starlette's
    BaseHTTPMiddleware, which hides client disconnects from the handlers)."""

    def __init__(self, app, counter):
        self.app, self.counter = app, counter

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = []

        async def tracked(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        finally:
            route = scope.get("route")  # the router records the matched route in the shared scope
            self.counter.labels(getattr(route, "path", "other"), str(status[0] if status else 500)).inc()


class ServerMetrics:
    def __init__(self, driver):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("lazy_rag_http_requests", "HTTP requests by endpoint and status code.",
                                ["endpoint", "status"], registry=r)
        self.ttft = Histogram("lazy_rag_ttft_seconds", "Time to first token (admission to first piece).",
                              buckets=_BUCKETS, registry=r)
        self.latency = Histogram("lazy_rag_request_latency_seconds", "Time from admission to the last token.",
                                 buckets=_BUCKETS, registry=r)
        self.prompt_tokens = Counter("lazy_rag_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.cached_tokens = Counter("lazy_rag_cached_prompt_tokens", "Prompt tokens whose KV existed before "
                                     "the request (chunks encoded for it not counted).", registry=r)
        self.generated_tokens = Counter("lazy_rag_generated_tokens", "Tokens generated.", registry=r)
        self.draining = Gauge("lazy_rag_draining", "1 while the server drains before exiting.", registry=r)
        # by tenant name (the operator's, from the API keys), never by key; no label carries request text
        self.tenant_tokens = Counter("lazy_rag_tenant_tokens", "Prompt and generated tokens of finished requests, "
                                     "by tenant.", ["tenant"], registry=r)
        self.tenant_refused = Counter("lazy_rag_tenant_refused_requests", "Requests refused for a tenant's limits "
                                      "(429, 413), by tenant and limit.", ["tenant", "limit"], registry=r)
        r.register(EngineCollector(driver))

    def observe(self, stats, tenant: str) -> None:
        """A finished request's ``GenerationStats``."""
        self.tenant_tokens.labels(tenant).inc(stats.prompt_tokens + stats.new_tokens)
        self.ttft.observe(stats.ttft_ms / 1e3)
        self.latency.observe(stats.total_ms / 1e3)
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.cached_tokens.inc(stats.reused_tokens)
        self.generated_tokens.inc(stats.new_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
