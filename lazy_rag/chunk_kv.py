"""``ChunkKV``, a chunk's position-free KV as the engine holds it in memory, and ``ChunkKVStore``,
what the engine asks of a store that keeps it on disk (an index's ``store.ChunkStore``, or the
replicas' shared one). The engine needs nothing else of the disk: how records are laid out is
``kv_record``'s, where they are is ``store``'s."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol, Sequence

import torch

# ``why`` of a store's ``read_nowait`` for a record that is intact as far as it knows but would be
# read from the disk (not in the page cache): the engine then weighs the disk against encoding again
NOT_IN_MEMORY = "not in memory"


@dataclass
class ChunkKV:
    """Position-free KV of one chunk: ``k`` (unrotated) and ``v`` of shape [layers, L, kv_heads, head_dim].

    fp8 KV (``k.dtype == torch.float8_e4m3fn``, ``quantized``) carries one scale per (layer, token,
    kv head) in ``k_scale`` / ``v_scale`` ([layers, L, kv_heads]): the value is
    ``k.float() * k_scale[..., None]``.

    int4 KV (``int4``; a storage format: disk and host tier, never pool pages) holds uint8 codes,
    two a byte ([layers, L, kv_heads, ceil(head_dim / 2)]), with fp16 ``k_scale`` / ``k_zero`` per
    channel and group of key tokens and ``v_scale`` / ``v_zero`` per token and group of value
    channels; ``groups`` is (key group, value group) (``kv_int4``'s layout; ``dequantized`` gives
    the values). Unquantised KV has no scales (None)."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    k_zero: torch.Tensor | None = None
    v_zero: torch.Tensor | None = None
    groups: tuple[int, int] | None = None

    @property
    def num_tokens(self) -> int:
        return self.k.shape[1]

    @property
    def quantized(self) -> bool:
        """fp8 with per-token scales (the format an fp8 pool holds)."""
        return self.k_scale is not None and self.k_zero is None

    @property
    def int4(self) -> bool:
        return self.k_zero is not None

    @property
    def format(self) -> str | None:
        """"fp8", "int4", or None (unquantised): what a host tier keys its copy by."""
        return "int4" if self.int4 else "fp8" if self.quantized else None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors to store, by name (``k``, ``v``, and the scales of quantised KV)."""
        out = {"k": self.k, "v": self.v}
        if self.k_scale is not None:
            out["k_scale"], out["v_scale"] = self.k_scale, self.v_scale
        if self.k_zero is not None:
            out["k_zero"], out["v_zero"] = self.k_zero, self.v_zero
        return out

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], groups: tuple[int, int] | None = None) -> "ChunkKV":
        return cls(tensors["k"], tensors["v"], tensors.get("k_scale"), tensors.get("v_scale"),
                   tensors.get("k_zero"), tensors.get("v_zero"), tuple(groups) if groups else None)

    def with_tensors(self, tensors: dict[str, torch.Tensor]) -> "ChunkKV":
        """This KV's format with other tensors of the same names (a copy elsewhere)."""
        return replace(self, **tensors)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) of int4 KV in ``dtype`` on the codes' device."""
        from .kv_int4 import dequantize_kv

        return dequantize_kv(self.tensors(), self.groups, dtype)


class ChunkKVStore(Protocol):
    """A disk store of chunk KV as the engine's chunk tiers use it (``engine.chunk_tiers``).

    ``read`` returns (kv, None), or (None, why): ``"missing"``, or what is wrong with the record;
    the engine then encodes the chunk and hands it to ``write_back``. ``precomputed``: a missing
    record is unexpected (worth a warning). A store may also have ``read_nowait`` (``read`` from
    the page cache only, else (None, ``NOT_IN_MEMORY``)), ``in_memory`` (whether a record is in
    the page cache), ``reads_pinned`` (its reads take ``pin`` and ``tensor_crcs``) and ``kv_format``
    ("fp8" or "int4" when it stores quantised KV: ``engine.chunk_tiers.stored_format``)."""

    precomputed: bool

    def read(self, chunk_id: str, token_ids: Sequence[int], **kw) -> tuple[ChunkKV | None, str | None]: ...

    def stored_bytes(self, chunk_id: str) -> int: ...

    def write_back(self, chunk_id: str, token_ids: Sequence[int], kv: ChunkKV) -> int: ...
