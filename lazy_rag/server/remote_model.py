"""``RemoteModel``: what the HTTP process knows of a model whose weights live in the engine
process: its tokenizer (loaded here, from the same files) and the facts the engine process
reported once it had loaded the model (context window, device, fingerprint).

It answers what the HTTP side asks of a model: ``PromptBuilder`` (tokenizer), ``/info`` and
``/v1/models`` (context window, device), and ``LazyIndex.load`` (the fingerprint check, and the
vocabulary size its store uses to tell wrapper slots from tokens), so that retrieval and span
matching run here without a second copy of the weights. It cannot generate.
"""
from __future__ import annotations

from types import SimpleNamespace


class RemoteModel:
    def __init__(self, tokenizer, info: dict):
        self.tokenizer = tokenizer
        self.model_name = info["model_name"]
        self.context_window = info["context_window"]
        self.device = info["device"]
        self.dtype = info["dtype"]
        self._fingerprint = info.get("fingerprint")
        # LazyIndex reads llm.host.parts.vocab_rows to open its store (never used to read KV here)
        self.host = SimpleNamespace(parts=SimpleNamespace(vocab_rows=info["vocab_rows"]))

    @property
    def fingerprint(self) -> dict:
        if self._fingerprint is None:  # the engine process computes it only when it serves an index
            raise AttributeError("the engine process reported no fingerprint (it serves no index)")
        return self._fingerprint
