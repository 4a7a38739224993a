"""Scale-out on Ray Serve (``lazy-rag serve --replicas N``): many engine replicas behind the same
FastAPI app, requests routed by their chunks, one chunk-KV store shared by all replicas.

- ``affinity``: the routing policy as plain functions (rendezvous homes, residency votes, load cap);
- ``router``: ``ChunkAffinityRouter``, Ray Serve's ``RequestRouter`` running it;
- ``engine_replica``: ``EngineReplica``, the engine deployment (one per GPU);
- ``serve_driver``: the ingress's driver over the engine deployment's handle;
- ``shared_store``: the index read-only plus a folder of replica-encoded KV (atomic, content-addressed);
- ``application``: the two deployments bound into a Serve application.

Needs Ray Serve (``pip install 'lazy-rag[ray]'``) for the modules that talk to Ray; ``affinity``
and ``shared_store`` (and the rest of lazy-rag) import without it.
docs/scale-out.md has the design.
"""
from __future__ import annotations

from ...errors import MissingDependencyError


def require_ray() -> None:
    """Raise one sentence naming the install when Ray Serve is missing (the modules that talk to
    Ray call this before importing it; ``affinity`` and ``shared_store`` need no Ray)."""
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError as e:
        raise MissingDependencyError(
            "Serving on several replicas (lazy-rag serve --replicas / --ray-address) needs Ray Serve, which is not "
            "installed; install it with: pip install 'lazy-rag[ray]' (or: pip install 'ray[serve]')") from e
