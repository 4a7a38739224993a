"""``lazy-rag serve``: an OpenAI-compatible HTTP server over the engine (FastAPI + uvicorn), with
documents whose KV is reused at any position, Prometheus metrics and a small web page.

``create_app(model, index=None, settings)`` gives the ASGI app (for tests or another ASGI server)
over a loaded ``LazyLLM`` or an ``EngineSpec`` (what to load: the engine runs in its own process
by default); ``serve(...)`` runs it under uvicorn with a drain on SIGTERM. Imports FastAPI,
uvicorn and prometheus-client, which the core runtime does not need.
"""
from __future__ import annotations

from ..deps import require

for _module in ("fastapi", "uvicorn", "prometheus_client"):
    require(_module)

from .app import ServerSettings, create_app  # noqa: E402
from .engine_spec import EngineSpec  # noqa: E402
from .run import serve  # noqa: E402

__all__ = ["EngineSpec", "ServerSettings", "create_app", "serve"]
