"""``EngineSpec``: what the server serves, as arguments rather than loaded objects, so that the
engine process can build the same model, engine and index that the server was given (a loaded
``LazyLLM`` cannot cross a process boundary; its name, device and options can).
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..engine import EngineConfig
from ..errors import LazyIndexError, LazyRagError
from ..models import DEFAULT_MODEL

log = logging.getLogger("lazy_rag.server")


@dataclass(frozen=True)
class EngineSpec:
    """``model``: a bundled name, HF folder, GGUF file or hub id; None: the index's model, else
    smollm2. ``wrapper``: "auto", "none", a bundled name, a path or a ``ChunkWrapper``.
    ``shared_prefix``: token ids chunks given as text are encoded after (None: none).
    ``index_dir``: an index to serve. ``random`` (benchmarks): a random-weights architecture of
    ``lazy_rag.random_models`` seeded with ``seed``, so that every process that builds it
    gets the same weights, with the tokenizer folder ``tokenizer``. ``warm_documents``: chunk
    texts the engine encodes into its memory tiers when it is loaded (``LazyLLM.warm_documents``;
    `lazy-rag serve --warm-documents FILE`)."""

    model: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    wrapper: Any = "auto"
    shared_prefix: tuple[int, ...] | None = None
    index_dir: str | None = None
    engine_config: EngineConfig = field(default_factory=EngineConfig)
    random: str | None = None
    tokenizer: str | None = None
    seed: int = 0
    warm_documents: tuple[str, ...] = ()

    def __post_init__(self):
        if self.random and not self.tokenizer:
            raise LazyRagError(f"A random-weights model ({self.random!r}) needs a tokenizer folder: "
                               "EngineSpec(random=..., tokenizer=PATH) (benchmarks/server_load.py --tokenizer).")
        if self.random and self.index_dir:
            raise LazyRagError("An index cannot be served over a random-weights model (its KV was computed "
                               "by real weights); drop the index or the random model.")

    @classmethod
    def from_llm(cls, llm, index=None) -> "EngineSpec":
        """The spec that loads ``llm`` (and ``index``) again in another process: same checkpoint,
        device, dtype, default chunk source and engine options."""
        name = llm.model_name
        if not name or name.startswith("random:"):
            raise LazyRagError("This LazyLLM was built from an in-memory model, so the engine process cannot load "
                               "it again: pass an EngineSpec naming the model (lazy_rag.server.EngineSpec), or "
                               "serve it in this process with ServerSettings(engine_process=False).")
        source = llm.default_source
        return cls(model=name, device=str(llm.device), dtype=str(llm.dtype).removeprefix("torch."),
                   wrapper=source.wrapper, shared_prefix=source.shared_prefix_ids or None,
                   index_dir=None if index is None else str(index.path), engine_config=llm.engine_config)

    # -- what it names, without loading anything ----------------------------------------------
    def index_manifest(self) -> dict | None:
        """The index's manifest, read leniently (None when unreadable: ``LazyIndex.load`` then
        raises the error that names the problem)."""
        if not self.index_dir:
            return None
        try:
            manifest = json.loads((Path(self.index_dir).expanduser() / "manifest.json").read_text())
        except (OSError, ValueError):
            return None
        return manifest if isinstance(manifest, dict) else None

    @property
    def model_name(self) -> str:
        if self.random:
            return f"random:{self.random}"
        if self.model:
            return self.model
        manifest = self.index_manifest()
        if manifest is not None and self.index_dir:
            name = (manifest.get("model") or {}).get("name")
            if not name:
                raise LazyIndexError(f"The index at {self.index_dir} was built from an in-memory model; name the "
                                     "model to serve it with (--model).")
            return name
        return DEFAULT_MODEL

    # -- loading --------------------------------------------------------------------------------
    def load_tokenizer(self):
        """The tokenizer alone (what the HTTP process needs when the engine runs elsewhere)."""
        if self.random:  # a folder with a tokenizer only (no model config), as the benchmarks carry
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(self.tokenizer)
        from ..models import load_tokenizer

        return load_tokenizer(self.model_name)

    def load_llm(self):
        from ..llm import LazyLLM

        if self.random:
            from ..random_models import random_model

            model = random_model(self.random, device=self.device, dtype=None if self.dtype == "auto" else self.dtype,
                                 seed=self.seed, tensor_parallel=self.engine_config.tensor_parallel)
            llm = LazyLLM(model, self.load_tokenizer(), shared_prefix=self.shared_prefix,
                          engine_config=self.engine_config)
            llm.model_name = self.model_name
            return llm
        return LazyLLM.from_pretrained(self.model_name, device=self.device, dtype=self.dtype,
                                       wrapper=self.wrapper, shared_prefix=self.shared_prefix,
                                       engine_config=self.engine_config)

    def load_index(self, llm, retrieve: bool = True):
        """The index over ``llm`` (a ``LazyLLM``, or the HTTP process's ``RemoteModel``).
        ``retrieve=False`` (the engine process, which never retrieves) skips the embedding model."""
        from ..index import LazyIndex

        embedder = None
        if not retrieve:
            embedder = _NoEmbedder.for_manifest(self.index_manifest())
        return LazyIndex.load(self.index_dir, llm=llm, embedder=embedder, device=self.device)

    def load(self, retrieve: bool = True):
        """(``LazyLLM``, ``LazyIndex`` or None), built in this process (its engine warmed with
        ``warm_documents``)."""
        llm = self.load_llm()
        if self.warm_documents:
            t0 = time.perf_counter()
            tokens = llm.warm_documents(self.warm_documents)
            log.info("warmed %d documents (%d tokens) into the engine's memory tiers in %.1f s",
                     len(self.warm_documents), tokens, time.perf_counter() - t0)
        return llm, (self.load_index(llm, retrieve) if self.index_dir else None)


class _NoEmbedder:
    """Stands in for the index's embedder in the engine process, which never retrieves (the HTTP
    process does), so that loading the index there does not load the embedding model too."""

    def __init__(self, name: str):
        self.name = name

    @classmethod
    def for_manifest(cls, manifest: dict | None) -> "_NoEmbedder | None":
        name = ((manifest or {}).get("embedder") or {}).get("name")
        return cls(name) if name else None

    def encode(self, *args, **kwargs):
        raise LazyRagError("Retrieval runs in the HTTP process, not in the engine process.")
