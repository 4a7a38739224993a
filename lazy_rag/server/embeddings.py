"""``POST /v1/embeddings``: OpenAI's embeddings API over the sentence embedder the server already
has (the served index's, which retrieval uses; without an index, the bundled default, loaded on
the first request). Vectors are L2-normalised, as the index stores them.

The request's ``model`` names the embedder (``all-MiniLM-L6-v2``; the served LLM's name is taken
too, for clients configured with one model name). ``input``: a string or a list of strings
(token-id inputs are refused). ``encoding_format``: ``float`` or ``base64`` (little-endian
float32, what the official openai client asks for by default).
"""
from __future__ import annotations

import base64
import threading

import numpy as np

from .protocol import APIError, bad

MAX_INPUTS = 2048


def parse_embeddings(body, names: tuple[str, ...]) -> tuple[list[str], str]:
    """The texts and the encoding format of a request body, or a 400/404 naming the field."""
    if not isinstance(body, dict):
        raise bad("The request body must be a JSON object.")
    model = body.get("model")
    if model not in names:
        raise APIError(404, f"The embedding model {model!r} is not served here; use {names[0]!r}.", param="model",
                       code="model_not_found")
    texts = body.get("input")
    if isinstance(texts, str):
        texts = [texts]
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) and t for t in texts):
        raise bad("'input' must be a non-empty string or a list of non-empty strings (token ids are not "
                  "supported).", "input")
    if len(texts) > MAX_INPUTS:
        raise bad(f"'input' has {len(texts)} strings; send at most {MAX_INPUTS} per request.", "input")
    fmt = body.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise bad("'encoding_format' must be float or base64.", "encoding_format")
    if body.get("dimensions") is not None:
        raise bad("'dimensions' is not supported: the embedder's vectors have a fixed size.", "dimensions")
    return texts, fmt


class EmbeddingService:
    """The embedder behind the route: ``index.embedder`` when an index is served (``lock`` the one
    retrieval takes: the embedder's tokenizer is not thread-safe), else the default one, loaded once."""

    def __init__(self, index=None, lock: threading.Lock | None = None):
        self._embedder = index.embedder if index is not None else None
        self._lock = lock or threading.Lock()

    @property
    def embedder(self):
        if self._embedder is None:
            from ..embedder import Embedder

            with self._lock:
                if self._embedder is None:
                    self._embedder = Embedder()
        return self._embedder

    @property
    def name(self) -> str:
        from ..embedder import DEFAULT_EMBEDDER

        return self._embedder.name if self._embedder is not None else DEFAULT_EMBEDDER

    def embed(self, texts: list[str], fmt: str) -> dict:
        """The response body (blocking: call it off the event loop)."""
        embedder = self.embedder
        with self._lock:
            vectors = embedder.encode(texts)
            tokens = embedder.count_tokens(texts)
        data = []
        for i, v in enumerate(vectors):
            v = np.ascontiguousarray(v, dtype="<f4")
            data.append({"object": "embedding", "index": i,
                         "embedding": base64.b64encode(v.tobytes()).decode() if fmt == "base64" else v.tolist()})
        return {"object": "list", "data": data, "model": embedder.name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
