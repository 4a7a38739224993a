"""What the evaluation tests share: the bundled SmolLM2 as an evaluation runtime, and torch's own
kernels (no Triton interpreter on the CPU) for every test of the folder."""
import pytest

from lazy_rag.quality.runner import Runtime
from tests.helpers import torch_kernels


@pytest.fixture(scope="module", autouse=True)
def _torch_kernels():
    with torch_kernels():
        yield


@pytest.fixture(scope="session")
def runtime(smollm2):
    """SmolLM2 with the embedder, loaded once for the folder (its indexes live in each test's tmp_path)."""
    from lazy_rag.embedder import Embedder

    return Runtime(smollm2, "smollm2", Embedder())
