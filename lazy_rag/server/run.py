"""``serve``: run the app under uvicorn with a drain on SIGTERM/SIGINT: admission stops at once
(new requests get 503, /ready turns 503), requests in flight finish within ``drain_timeout``
seconds, then the engine process is stopped and the process exits 0 (a second Ctrl-C stops at
once)."""
from __future__ import annotations

import functools
import logging

import uvicorn

from .app import ServerSettings, create_app
from .limits import HeaderDeadline

log = logging.getLogger("lazy_rag.server")


class DrainingServer(uvicorn.Server):
    """uvicorn already stops listening and waits for open connections on a signal; this also
    tells the app to refuse new requests on connections that stay open (keep-alive)."""

    def __init__(self, config: uvicorn.Config, on_exit):
        super().__init__(config)
        self._on_exit = on_exit

    def handle_exit(self, sig, frame) -> None:
        if not self.should_exit:
            log.info("signal %s: draining (no new requests; %s s for those in flight)", sig,
                     self.config.timeout_graceful_shutdown)
            self._on_exit()
        super().handle_exit(sig, frame)
        # uvicorn re-raises a captured signal after its shutdown, so the process would die of it
        # (exit -15, or a KeyboardInterrupt traceback for Ctrl-C); a drained stop is a clean exit
        self._captured_signals.clear()


def serve(model, index=None, settings: ServerSettings | None = None, host: str = "127.0.0.1", port: int = 8000,
          drain_timeout: float = 30.0, log_level: str = "info") -> None:
    """``model``: an ``EngineSpec`` (what `lazy-rag serve` passes: with the engine in its own
    process, this one never loads the weights) or a loaded ``LazyLLM`` (see ``create_app``).
    Raises ``LazyRagError`` before serving when the model or index cannot be loaded; the engine
    process exits with the server (after the drain)."""
    run_app(create_app(model, index, settings), host, port, drain_timeout, log_level)


def uvicorn_config(app, **options) -> uvicorn.Config:
    """uvicorn's configuration for an app from ``create_app``: its HTTP protocol with a deadline
    on request headers (``limits.HeaderDeadline``, the settings' ``client_timeout_s``), no access
    log (the app logs each request without its text), no Server header."""
    timeout = app.state.server.settings.client_timeout_s
    return uvicorn.Config(app, http=functools.partial(HeaderDeadline, header_timeout_s=timeout), access_log=False,
                          server_header=False, **options)


def run_app(app, host: str = "127.0.0.1", port: int = 8000, drain_timeout: float = 30.0,
            log_level: str = "info") -> None:
    """Serve an app from ``create_app`` until SIGTERM/SIGINT (then drain)."""
    config = uvicorn_config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=drain_timeout)
    try:
        DrainingServer(config, app.state.server.start_draining).run()
    finally:  # the lifespan's shutdown stops the engine; not when uvicorn never started (port taken)
        app.state.server.driver.close()
