"""Thin adapters from lazy-rag's public API to LlamaIndex and LangChain."""
