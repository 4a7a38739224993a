"""Real HTTP servers on 127.0.0.1 for the server tests: the app under uvicorn in a thread, on a
port the OS picks, over the session's SmolLM2 (and an index of the examples corpus). The engine
runs in its own process (the default; it loads its own SmolLM2) unless a test asks for
``engine_process=False``."""
import logging
import socket
import threading
import time
from pathlib import Path

import pytest

from tests.helpers import torch_kernels


@pytest.fixture(scope="module", autouse=True)
def _torch_kernels():
    """(module-scoped, so that the servers and engine processes a module starts inherit it)"""
    with torch_kernels():
        yield


ROOT = Path(__file__).resolve().parents[2]


class RunningServer:
    def __init__(self, app):
        import uvicorn

        self.app = app
        self.state = app.state.server  # LazyRagServer
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        from lazy_rag.server.run import uvicorn_config

        self.uvicorn = uvicorn.Server(uvicorn_config(app, log_level="warning", timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.uvicorn.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.uvicorn.started:
            if time.time() > deadline:
                raise RuntimeError("the test server did not start in 30 s")
            time.sleep(0.02)

    @property
    def model(self) -> str:
        return self.state.settings.model_name

    def wait_idle(self, timeout: float = 30.0) -> dict:
        """The engine's stats (from the engine process when it runs in one) once no request is in
        flight (fails after ``timeout``)."""
        deadline = time.time() + timeout
        while True:
            stats = self.state.driver.stats()
            if self.state.driver.in_flight == 0 and stats["requests_running"] == 0 and \
                    stats["requests_waiting"] == 0:
                return stats
            if time.time() > deadline:
                raise AssertionError(f"requests still in flight after {timeout} s: {stats}")
            time.sleep(0.05)

    def stop(self) -> None:
        self.uvicorn.should_exit = True
        self.thread.join(15)


@pytest.fixture(scope="session")
def corpus_index(smollm2, tmp_path_factory):
    """The README's examples corpus, indexed with the session's SmolLM2 (recovery none: the server's
    tests count the tokens served from cache, which auto may recompute for a risky answer)."""
    from lazy_rag import LazyIndex

    out = tmp_path_factory.mktemp("server-index") / "index"
    idx, _ = LazyIndex.build([str(ROOT / "examples" / "corpus")], out, llm=smollm2, progress=False,
                             recovery="none")
    return idx


@pytest.fixture
def start_server():
    """``start_server(llm, index=None, **settings)`` -> a RunningServer, stopped after the test
    (``llm``: a ``LazyLLM`` or an ``EngineSpec``)."""
    from lazy_rag.server import ServerSettings, create_app

    running = []

    def start(llm, index=None, **settings):
        settings.setdefault("model_name", "smollm2")
        s = RunningServer(create_app(llm, index, ServerSettings(**settings)))
        running.append(s)
        return s

    yield start
    for s in running:
        s.stop()


@pytest.fixture(scope="module")
def served(corpus_index):
    """One server over SmolLM2 and the corpus index, shared by a module's tests, built as `lazy-rag
    serve` builds it: from an EngineSpec, the engine process loading the model and this process
    only the tokenizer and the index (for retrieval and span matching)."""
    from lazy_rag.server import EngineSpec, ServerSettings, create_app

    spec = EngineSpec(model="smollm2", device="cpu", index_dir=str(corpus_index.path))
    s = RunningServer(create_app(spec, None, ServerSettings(model_name="smollm2")))
    yield s
    s.stop()


@pytest.fixture
def no_server_errors(caplog):
    """Fails the test if the server logged an error (a traceback) while it ran."""
    caplog.set_level(logging.WARNING)
    yield
    bad = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not bad, "the server logged errors: " + "; ".join(r.getMessage() for r in bad)
