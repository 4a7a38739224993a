"""lazy-rag: RAG over cached, position-free chunk KV with lazy RoPE."""
from importlib import import_module

from .version import __version__
from .errors import LazyRagError
from .requests import MODES, ChunkSource, GenerationResult

# Exported lazily: these pull in torch and transformers (seconds), which `lazy-rag --help`, an
# argument error or `lazy-rag models` never need.
_EXPORTS = {"LazyLLM": "llm", "Chunk": "segments", "build_rag_segments": "chat", "LazyIndex": "index",
            "QueryResult": "index", "OutputFormat": "structured"}

__all__ = ["LazyLLM", "LazyIndex", "Chunk", "ChunkSource", "MODES", "GenerationResult", "QueryResult",
           "OutputFormat", "build_rag_segments", "LazyRagError", "__version__"]


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
