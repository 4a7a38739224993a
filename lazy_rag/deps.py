"""Optional and heavy dependencies, imported where they are used, with one clear sentence when
one is missing (the package to install and the command), never a bare ImportError deep inside a
library. The core runtime (``lazy_rag.LazyLLM``, the kernels) imports without any of them.
"""
from __future__ import annotations

import importlib
from types import ModuleType

from .errors import MissingDependencyError

# import name -> (pip requirement, what needs it, lazy-rag extra that installs it, if any)
KNOWN = {
    "accelerate": ("accelerate", "Loading a GGUF checkpoint (the bundled models)", None),
    "gguf": ("gguf", "Loading a GGUF checkpoint (the bundled models)", None),
    "faiss": ("faiss-cpu", "The vector index of `lazy-rag index`", None),
    "llama_index.core": ("llama-index-core", "Splitting documents into chunks (and the LlamaIndex integration)",
                         "llama-index"),
    "langchain_core": ("langchain-core", "The LangChain integration (lazy_rag.integrations.langchain)", "langchain"),
    "matplotlib": ("matplotlib", "The benchmark plots", "test"),
    "fastapi": ("fastapi", "The server (`lazy-rag serve`)", None),
    "uvicorn": ("uvicorn", "The server (`lazy-rag serve`)", None),
    "prometheus_client": ("prometheus-client", "The server's /metrics (`lazy-rag serve`)", None),
    "llguidance": ("llguidance", "Structured outputs (a JSON schema, JSON mode, a regex or a grammar)", None),
}


def install_hint(module: str) -> str:
    requirement, _, extra = KNOWN[module]
    hint = f"pip install {requirement}"
    if extra:
        hint += f" (or: pip install 'lazy-rag[{extra}]')"
    return hint


def missing_message(module: str) -> str:
    requirement, purpose, _ = KNOWN[module]
    return f"{purpose} needs the package {requirement}, which is not installed; install it with: {install_hint(module)}"


def require(module: str) -> ModuleType:
    """Import ``module`` (a key of ``KNOWN``) or raise ``MissingDependencyError`` saying what to install."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingDependencyError(missing_message(module)) from e
