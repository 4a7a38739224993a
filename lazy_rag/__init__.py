"""lazy-rag: RAG over cached, position-free chunk KV with lazy RoPE."""

from .version import __version__  # noqa: E402

from .errors import LazyRagError  # noqa: E402
from .requests import MODES, ChunkSource, GenerationResult  # noqa: E402
from .llm import LazyLLM  # noqa: E402
from .segments import Chunk  # noqa: E402
from .chat import build_rag_segments  # noqa: E402
from .index import LazyIndex, QueryResult  # noqa: E402

__all__ = ["LazyLLM", "LazyIndex", "Chunk", "ChunkSource", "MODES", "GenerationResult", "QueryResult",
           "build_rag_segments", "LazyRagError", "__version__"]
