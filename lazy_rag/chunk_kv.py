"""``ChunkKV``, a chunk's position-free KV as the engine holds it in memory, and ``ChunkKVStore``,
what the engine asks of a store that keeps it on disk (an index's ``store.ChunkStore``, or the
replicas' shared one). The engine needs nothing else of the disk: how records are laid out is
``kv_record``'s, where they are is ``store``'s."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

# ``why`` of a store's ``read_nowait`` for a record that is intact as far as it knows but would be
# read from the disk (not in the page cache): the engine then weighs the disk against encoding again
NOT_IN_MEMORY = "not in memory"


@dataclass
class ChunkKV:
    """Position-free KV of one chunk: ``k`` (unrotated) and ``v`` of shape [layers, L, kv_heads, head_dim].

    Quantised KV (``k.dtype == torch.float8_e4m3fn``) carries one scale per (layer, token, kv head)
    in ``k_scale`` / ``v_scale`` ([layers, L, kv_heads]): the value is ``k.float() * k_scale[..., None]``.
    Unquantised KV has no scales (None)."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.k.shape[1]

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors to store, by name (``k``, ``v``, and the scales of quantised KV)."""
        out = {"k": self.k, "v": self.v}
        if self.k_scale is not None:
            out["k_scale"], out["v_scale"] = self.k_scale, self.v_scale
        return out

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> "ChunkKV":
        return cls(tensors["k"], tensors["v"], tensors.get("k_scale"), tensors.get("v_scale"))


class ChunkKVStore(Protocol):
    """A disk store of chunk KV as the engine's chunk tiers use it (``engine.chunk_tiers``).

    ``read`` returns (kv, None), or (None, why): ``"missing"``, or what is wrong with the record;
    the engine then encodes the chunk and hands it to ``write_back``. ``precomputed``: a missing
    record is unexpected (worth a warning). A store may also have ``read_nowait`` (``read`` from
    the page cache only, else (None, ``NOT_IN_MEMORY``)), ``in_memory`` (whether a record is in
    the page cache) and ``reads_pinned`` (its reads take ``pin`` and ``tensor_crcs``)."""

    precomputed: bool

    def read(self, chunk_id: str, token_ids: Sequence[int], **kw) -> tuple[ChunkKV | None, str | None]: ...

    def stored_bytes(self, chunk_id: str) -> int: ...

    def write_back(self, chunk_id: str, token_ids: Sequence[int], kv: ChunkKV) -> int: ...
