"""The Ray Serve application: an ingress deployment (the FastAPI app of `lazy-rag serve`: bodies,
auth, tokenizing, retrieval, SSE) in front of an engine deployment (``EngineReplica``, one per
GPU), which the ingress calls through a handle whose router is ``ChunkAffinityRouter``.

``build_application(spec, settings, options)`` gives the ``Application`` that ``serve.run``
takes; ``lazy_rag.server.ray_app`` wraps it for `lazy-rag serve --replicas N` and for Serve's
own ``serve run`` / ``serve deploy`` config files.
"""
from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field

from . import require_ray

require_ray()

import ray  # noqa: E402
from ray import serve  # noqa: E402
from ray.serve.config import RequestRouterConfig  # noqa: E402

from ...errors import LazyRagError  # noqa: E402
from ..app import ServerSettings, create_app  # noqa: E402
from ..engine_spec import EngineSpec  # noqa: E402
from .affinity import POLICIES, AffinitySettings  # noqa: E402
from .engine_replica import EngineReplica  # noqa: E402
from .router import ChunkAffinityRouter  # noqa: E402
from .serve_driver import ServeEngines  # noqa: E402

APP_NAME = "lazy-rag"
ENGINE_DEPLOYMENT = "LazyRagEngine"
INGRESS_DEPLOYMENT = "LazyRagIngress"
# what the replicas' processes need from this one's environment (offline models, the cache)
FORWARDED_ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_VERBOSITY", "LAZY_RAG_CACHE", "HF_HOME")


@dataclass(frozen=True)
class ScaleOutOptions:
    """``replicas``: engine replicas (fixed), unless ``min_replicas``/``max_replicas`` ask for
    autoscaling between them (Serve adds a replica while the replicas average more than
    ``target_ongoing_requests`` requests in flight). ``gpus_per_replica``: None is 1 when the
    cluster has GPUs and the spec's device is not "cpu", else 0. ``routing``: "affinity", or
    "round_robin" / "least_loaded" to measure against. ``kv_share``: the replicas' shared folder
    for KV they encode (None: ``<index>/kv-replicas``). ``drain_timeout_s``: how long a replica
    that is taken down (scaled in, redeployed, shut down) lets its requests finish.
    ``ingress_replicas``: replicas of the FastAPI app (parsing, tokenizing, retrieval, SSE); None
    is one per engine replica (the most, when autoscaled): on two H100s, two engine replicas at 88
    req/s kept two ingress replicas at 1.1-1.2 cores each (BENCHMARKS.md, "Scale-out"), more than
    one Python process gives. ``engine_actor_options``: more
    ``ray_actor_options`` for the engine replicas (``runtime_env``, ``accelerator_type``, ...)."""

    replicas: int = 1
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float = 16.0
    gpus_per_replica: float | None = None
    cpus_per_replica: float = 1.0
    ingress_replicas: int | None = None
    ingress_cpus: float = 1.0
    routing: str = "affinity"
    load_factor: float = AffinitySettings.load_factor
    imbalance_threshold: int = AffinitySettings.imbalance_threshold
    routing_stats_period_s: float = 1.0
    health_check_period_s: float = 10.0
    drain_timeout_s: float = 30.0
    kv_share: str | None = None
    engine_actor_options: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.replicas < 1:
            raise LazyRagError(f"--replicas must be at least 1, got {self.replicas}.")
        if (self.min_replicas is None) != (self.max_replicas is None):
            raise LazyRagError("Autoscaling needs both --min-replicas and --max-replicas.")
        if self.min_replicas is not None and not 0 <= self.min_replicas <= self.max_replicas >= 1:
            raise LazyRagError(f"Autoscaling needs 0 <= --min-replicas <= --max-replicas and --max-replicas >= 1, "
                               f"got {self.min_replicas} and {self.max_replicas}.")
        if self.routing not in POLICIES:
            raise LazyRagError(f"Unknown routing {self.routing!r}; choose one of {', '.join(POLICIES)}.")
        if self.ingress_replicas is not None and self.ingress_replicas < 1:
            raise LazyRagError(f"--ingress-replicas must be at least 1, got {self.ingress_replicas}.")
        AffinitySettings(self.load_factor, self.imbalance_threshold)  # checks them

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None

    @property
    def most_replicas(self) -> int:
        return self.max_replicas if self.autoscaling else self.replicas

    @property
    def ingress_count(self) -> int:
        return self.ingress_replicas if self.ingress_replicas is not None else max(1, self.most_replicas)


class LazyRagIngress:
    """An ingress replica: `lazy-rag serve`'s FastAPI app (``create_app``) over the engine
    deployment. Loads the tokenizer and the index's metadata and embedder (for retrieval and span
    matching), never the weights."""

    def __init__(self, engine, spec: EngineSpec, settings: ServerSettings, max_queue: int,
                 policy: str | None = None):
        self.engine, self.spec, self.settings = engine, spec, settings
        self.max_queue, self.policy = max_queue, policy

    async def __serve_build_asgi_app__(self):
        info = await self.engine.info.remote()  # waits for an engine replica: the model's facts
        engines = ServeEngines(self.engine, self.spec, info, self.max_queue, self.policy)
        return await asyncio.to_thread(create_app, engines, None, self.settings)


def _gpus(spec: EngineSpec, options: ScaleOutOptions) -> float:
    if options.gpus_per_replica is not None:
        return options.gpus_per_replica
    if spec.device == "cpu" or not ray.is_initialized():
        return 0
    return 1 if ray.cluster_resources().get("GPU", 0) >= 1 else 0


def _actor_options(base: dict, extra: dict) -> dict:
    out = {**base, **extra}
    env = {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}
    if env:
        runtime_env = dict(out.get("runtime_env") or {})
        runtime_env["env_vars"] = {**env, **(runtime_env.get("env_vars") or {})}
        out["runtime_env"] = runtime_env
    return out


def build_application(spec: EngineSpec, settings: ServerSettings, options: ScaleOutOptions = ScaleOutOptions()):
    """The ingress bound to the engine deployment, for ``serve.run``."""
    scaling = ({"autoscaling_config": {"min_replicas": options.min_replicas, "max_replicas": options.max_replicas,
                                       "target_ongoing_requests": options.target_ongoing_requests}}
               if options.autoscaling else {"num_replicas": options.replicas})
    router = RequestRouterConfig(
        request_router_class=ChunkAffinityRouter,
        request_router_kwargs={"load_factor": options.load_factor,
                               "imbalance_threshold": options.imbalance_threshold, "policy": options.routing},
        request_routing_stats_period_s=options.routing_stats_period_s)
    engine = serve.deployment(
        EngineReplica, name=ENGINE_DEPLOYMENT,
        ray_actor_options=_actor_options({"num_gpus": _gpus(spec, options), "num_cpus": options.cpus_per_replica},
                                         options.engine_actor_options),
        # Serve sends a replica at most its own admission limit; the rest wait in the routers
        max_ongoing_requests=settings.max_queue, request_router_config=router,
        health_check_period_s=options.health_check_period_s, graceful_shutdown_timeout_s=options.drain_timeout_s,
        graceful_shutdown_wait_loop_s=0.5, **scaling)
    ingress = serve.deployment(
        serve.ingress()(LazyRagIngress), name=INGRESS_DEPLOYMENT, num_replicas=options.ingress_count,
        ray_actor_options=_actor_options({"num_cpus": options.ingress_cpus}, {}),
        max_ongoing_requests=settings.max_queue * options.most_replicas,
        graceful_shutdown_timeout_s=options.drain_timeout_s, graceful_shutdown_wait_loop_s=0.5)
    engines = engine.bind(spec, settings.max_queue, options.kv_share)
    return ingress.bind(engines, spec, settings, settings.max_queue * options.most_replicas)
