"""`lazy-rag serve` on Ray Serve: N engine replicas (one per GPU) behind the same OpenAI API, each
request routed by its chunks (``scaleout/``; docs/scale-out.md).

- ``serve_replicas(...)``: what `lazy-rag serve --replicas N` (a local Ray instance) and
  `lazy-rag serve --ray-address ADDR` (an existing cluster) run: start Serve's HTTP proxy on
  host:port, deploy the application, wait for SIGTERM/SIGINT, take it down.
- ``app_builder(args)``: the application for Serve's own tools, e.g.
  ``serve run lazy_rag.server.ray_app:app_builder index_dir=/shared/demo-index replicas=4`` or
  ``import_path: lazy_rag.server.ray_app:app_builder`` in a ``serve deploy`` config file (its
  ``args`` are the names below; a ``deployments`` entry for ``LazyRagEngine`` may override the
  replica count, autoscaling and actor options).
"""
from __future__ import annotations

import logging
import os
import signal
import threading

from ..engine import EngineConfig
from ..errors import LazyRagError
from .app import ServerSettings
from .engine_spec import EngineSpec
from .tenants import Tenants
from .scaleout import require_ray
from .warm import read_warm_documents

log = logging.getLogger("lazy_rag.server")

# app_builder's arguments: name -> (type, where it goes)
_SPEC_ARGS = {"model": str, "device": str, "dtype": str, "index_dir": str}
_WARM_ARGS = {"warm_documents": str}  # a file's path; its documents go into the EngineSpec
_SETTINGS_ARGS = {"served_model_name": str, "api_key": str, "api_keys": str, "max_queue": int, "max_body_bytes": int,
                  "max_tokens": int, "mode": str, "log_prompts": bool, "tenant_max_in_flight": int,
                  "tenant_tokens_per_minute": int, "tenant_max_document_bytes": int, "max_documents": int}
_OPTION_ARGS = {"replicas": int, "min_replicas": int, "max_replicas": int, "target_ongoing_requests": float,
                "gpus_per_replica": float, "cpus_per_replica": float, "ingress_replicas": int, "routing": str,
                "load_factor": float, "imbalance_threshold": int, "kv_share": str}
_ENGINE_ARGS = {"kv_bytes": int, "host_bytes": int, "max_num_seqs": int, "kv_dtype": str}


def _convert(name: str, value, kind):
    if kind is bool and isinstance(value, str):
        if value.lower() in ("1", "true", "yes", "on"):
            return True
        if value.lower() in ("0", "false", "no", "off"):
            return False
        raise LazyRagError(f"Argument {name}={value!r} must be true or false.")
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise LazyRagError(f"Argument {name}={value!r} must be {'an integer' if kind is int else 'a number'}."
                           ) from None


def app_builder(args: dict):
    """The Serve application from ``serve run``'s ``key=value`` arguments or a config file's
    ``args``: model, device, dtype, index_dir, warm_documents (a file's path); served_model_name,
    api_key (default: the ``LAZY_RAG_API_KEY`` environment variable), api_keys (a tenants' keys
    file; default: ``LAZY_RAG_API_KEYS``), tenant_max_in_flight, tenant_tokens_per_minute,
    tenant_max_document_bytes, max_documents, max_queue, max_body_bytes, max_tokens, mode,
    log_prompts; replicas, min_replicas, max_replicas, target_ongoing_requests,
    gpus_per_replica, cpus_per_replica, ingress_replicas, routing, load_factor,
    imbalance_threshold, kv_share; kv_bytes, host_bytes, max_num_seqs, kv_dtype (the engine)."""
    known = {**_SPEC_ARGS, **_WARM_ARGS, **_SETTINGS_ARGS, **_OPTION_ARGS, **_ENGINE_ARGS}
    unknown = sorted(set(args) - set(known))
    if unknown:
        raise LazyRagError(f"Unknown argument(s) {', '.join(unknown)}; lazy-rag's application takes "
                           f"{', '.join(known)}.")
    given = {k: _convert(k, v, known[k]) for k, v in args.items() if v is not None}
    engine = EngineConfig().with_options(**{k: v for k, v in given.items() if k in _ENGINE_ARGS})
    warm = read_warm_documents(given["warm_documents"]) if given.get("warm_documents") else ()
    spec = EngineSpec(**{k: v for k, v in given.items() if k in _SPEC_ARGS}, engine_config=engine,
                      warm_documents=warm)
    tenants = Tenants.configured(given.get("api_keys"), given.get("api_key") or os.environ.get("LAZY_RAG_API_KEY"),
                                 os.environ)
    limits = {k: given[k] for k in ("tenant_max_in_flight", "tenant_tokens_per_minute", "tenant_max_document_bytes",
                                    "max_documents", "max_queue", "max_body_bytes", "log_prompts") if k in given}
    settings = ServerSettings(model_name=given.get("served_model_name") or spec.model_name, tenants=tenants,
                              default_max_tokens=given.get("max_tokens", 256), default_mode=given.get("mode", "lazy"),
                              **limits)
    from .scaleout.application import ScaleOutOptions, build_application

    return build_application(spec, settings, ScaleOutOptions(**{k: v for k, v in given.items() if k in _OPTION_ARGS}))


def check_spec(spec: EngineSpec) -> None:
    """Fail here, in one sentence, on what every replica would fail on (an unknown model, an
    index that is not one), instead of Serve retrying the replicas' constructors."""
    spec.load_tokenizer()
    if spec.index_dir and spec.index_manifest() is None:
        from ..errors import LazyIndexError

        raise LazyIndexError(f"{spec.index_dir} is not a lazy-rag index (no readable manifest.json); build one "
                             "with `lazy-rag index SOURCES --out DIR`.")


def serve_replicas(spec: EngineSpec, settings: ServerSettings, options, host: str = "127.0.0.1", port: int = 8000,
                   ray_address: str | None = None, on_ready=None) -> None:
    """Deploy on a local Ray instance (``ray_address`` None: started here, stopped at the end) or
    on an existing cluster ("auto" or "ray://host:10001": the application is deleted at the
    end, the cluster stays), serve until SIGTERM/SIGINT, then take the application down.
    ``on_ready(handle)`` runs once the application is up."""
    require_ray()
    import ray
    from ray import serve

    from .scaleout.application import APP_NAME, build_application

    check_spec(spec)
    local = ray_address is None
    if local:
        # logical CPUs for every replica's reservation (Ray would otherwise leave replicas
        # pending on a machine with fewer cores than replicas); the OS shares the real ones
        want = options.most_replicas * options.cpus_per_replica + options.ingress_count * options.ingress_cpus
        ray.init(num_cpus=max(os.cpu_count() or 1, int(want + 0.999)), include_dashboard=False,
                 configure_logging=False, log_to_driver=True)
    else:
        ray.init(address=ray_address, configure_logging=False, log_to_driver=False)
    stop = threading.Event()
    old = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        serve.start(http_options={"host": host, "port": port})
        handle = serve.run(build_application(spec, settings, options), name=APP_NAME, route_prefix="/")
        if on_ready is not None:
            on_ready(handle)
        while not stop.wait(0.5):  # a short wait: the signal handler runs between two
            pass
        log.info("stopping: taking the application down (requests in flight finish first)")
    finally:
        try:
            if local:
                serve.shutdown()
            else:
                serve.delete(APP_NAME)
        finally:
            ray.shutdown()
            for s, h in old.items():
                signal.signal(s, h)
