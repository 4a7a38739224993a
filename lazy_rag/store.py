"""``ChunkKV`` (a chunk's position-free KV) and ``ChunkStore`` (chunk KV on disk, safetensors).

One file per chunk, ``kv/<chunk_id>.safetensors``, holding ``k`` (unrotated) and ``v`` of shape
[layers, tokens, kv_heads, head_dim] plus metadata: checksums of both tensors, a hash of the
token ids, and the fingerprint of the model/tokenizer/RoPE/shared prefix that computed them.
Every write goes to a temp file then ``os.replace``. A missing, corrupt or foreign file is
detected on read (``read`` says why); the engine then recomputes the chunk and writes the file
again (``engine.chunk_tiers``). The store itself never encodes and keeps nothing in memory:
the engine's pool and host tier are the memory tiers.
"""
from __future__ import annotations

import logging
import os
import tempfile
import zlib
from pathlib import Path

from dataclasses import dataclass

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .segments import token_ids_key

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ChunkKV:
    """Position-free KV of one chunk: ``k`` (unrotated) and ``v`` of shape [layers, L, kv_heads, head_dim]."""

    k: torch.Tensor
    v: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.k.shape[1]

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()


def _checksum(t: torch.Tensor) -> str:
    flat = t.contiguous().view(torch.uint8) if t.dtype != torch.uint8 else t
    return format(zlib.crc32(flat.numpy().data), "08x")


class ChunkStore:
    def __init__(self, root: Path, fingerprint_id: str, shared_prefix_ids=(), kv_dtype: torch.dtype | None = None,
                 precomputed: bool = True):
        self.root = Path(root)
        self.kv_dir = self.root / "kv"
        self.fingerprint_id = fingerprint_id
        self.shared_prefix_ids = tuple(shared_prefix_ids)
        self.kv_dtype = kv_dtype
        self.precomputed = precomputed  # False: KV is encoded on first use (a missing file is expected)

    def path(self, chunk_id: str) -> Path:
        return self.kv_dir / f"{chunk_id}.safetensors"

    def _meta_key(self, token_ids) -> str:
        key = token_ids_key(token_ids)
        return f"{token_ids_key(self.shared_prefix_ids)}/{key}" if self.shared_prefix_ids else key

    def write(self, chunk_id: str, token_ids, kv: ChunkKV) -> int:
        """Atomically write one chunk's KV; returns bytes written."""
        self.kv_dir.mkdir(parents=True, exist_ok=True)
        dt = self.kv_dtype or kv.k.dtype
        k = kv.k.detach().to("cpu", dt).contiguous()
        v = kv.v.detach().to("cpu", dt).contiguous()
        meta = {"k_crc32": _checksum(k), "v_crc32": _checksum(v), "tokens": self._meta_key(token_ids),
                "fingerprint": self.fingerprint_id, "dtype": str(dt).removeprefix("torch."), "format": "1"}
        fd, tmp = tempfile.mkstemp(prefix=f".{chunk_id}.", suffix=".tmp", dir=self.kv_dir)
        os.close(fd)
        try:
            save_file({"k": k, "v": v}, tmp, metadata=meta)
            os.replace(tmp, self.path(chunk_id))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return self.path(chunk_id).stat().st_size

    def read(self, chunk_id: str, token_ids) -> tuple[ChunkKV | None, str | None]:
        """(kv, None) if the file is present and intact, else (None, why)."""
        p = self.path(chunk_id)
        if not p.exists():
            return None, "missing"
        try:
            with safe_open(str(p), framework="pt") as f:
                meta = f.metadata() or {}
                # own the bytes: a tensor backed by the mapped file would change if the file did
                k, v = f.get_tensor("k").clone(), f.get_tensor("v").clone()
        except Exception as e:  # truncated or garbled file
            return None, f"unreadable ({type(e).__name__})"
        if meta.get("fingerprint") != self.fingerprint_id:
            return None, "computed by another model/tokenizer/prefix"
        if meta.get("tokens") != self._meta_key(token_ids):
            return None, "token ids differ"
        if meta.get("k_crc32") != _checksum(k) or meta.get("v_crc32") != _checksum(v):
            return None, "checksum mismatch (corrupt)"
        return ChunkKV(k, v), None
