"""``ChunkKV`` (a chunk's position-free KV) and ``ChunkStore`` (chunk KV on disk, safetensors).

One file per chunk, ``kv/<chunk_id>.safetensors`` (``kv-w<digest>/`` for chunks encoded inside a
chunk wrapper, so a re-encode with a new wrapper commits atomically) (an id that is not a plain file name, e.g.
one with a path separator, is stored under its hash: ``kv/id-<sha256>.safetensors``), holding ``k`` (unrotated) and ``v`` of shape
[layers, tokens, kv_heads, head_dim] plus metadata: checksums of both tensors, a hash of the
token ids (a wrapper's slots left out: the wrapper is in the fingerprint), and the fingerprint
of the model/tokenizer/RoPE/shared prefix/wrapper that computed them.
Every write goes to a temp file then ``os.replace``. A missing, corrupt or foreign file is
detected on read (``read`` says why); the engine then recomputes the chunk and writes the file
again (``engine.chunk_tiers``). The store itself never encodes and keeps nothing in memory:
the engine's pool and host tier are the memory tiers.
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
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


def _checksum(t: torch.Tensor) -> str:
    flat = t.contiguous().view(torch.uint8) if t.dtype != torch.uint8 else t
    return format(zlib.crc32(flat.numpy().data), "08x")


class ChunkStore:
    def __init__(self, root: Path, fingerprint_id: str, shared_prefix_ids=(), kv_dtype: torch.dtype | None = None,
                 precomputed: bool = True, kv_subdir: str = "kv", vocab_rows: int | None = None):
        self.root = Path(root)
        self.kv_dir = self.root / kv_subdir
        # ids from vocab_rows up are a chunk wrapper's slots, numbered per process: never hashed
        self.vocab_rows = vocab_rows
        self.fingerprint_id = fingerprint_id
        self.shared_prefix_ids = tuple(shared_prefix_ids)
        self.kv_dtype = kv_dtype
        self.precomputed = precomputed  # False: KV is encoded on first use (a missing file is expected)
        # for write-backs by queries (repairs, first use): a callable giving a context manager that
        # yields None when writing is safe now, else why not (LazyIndex: the writer lock and the
        # generation); None: the owner (a build) holds the lock itself
        self.write_guard = None

    @staticmethod
    def file_name(chunk_id: str) -> str:
        """The KV file's name: the id itself when it is a plain name, else its hash (no id can
        name a path outside the store)."""
        if re.fullmatch(r"[A-Za-z0-9_\-][A-Za-z0-9_.\-]{0,127}", chunk_id):
            return f"{chunk_id}.safetensors"
        return f"id-{hashlib.sha256(chunk_id.encode()).hexdigest()[:40]}.safetensors"

    def path(self, chunk_id: str) -> Path:
        return self.kv_dir / self.file_name(chunk_id)

    def _meta_key(self, token_ids) -> str:
        if self.vocab_rows is not None:
            token_ids = [t for t in token_ids if t < self.vocab_rows]
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
        fd, tmp = tempfile.mkstemp(prefix=f".{self.path(chunk_id).stem}.", suffix=".tmp", dir=self.kv_dir)
        os.close(fd)
        try:
            save_file({"k": k, "v": v}, tmp, metadata=meta)
            os.replace(tmp, self.path(chunk_id))
        except BaseException as e:
            Path(tmp).unlink(missing_ok=True)
            # safetensors reports a failed write (a full disk) as its own error: callers handle OSError
            m = None if isinstance(e, OSError) else re.search(r"os error (\d+)", str(e))
            if m:
                code = int(m.group(1))
                raise OSError(code, os.strerror(code), str(self.path(chunk_id))) from e
            raise
        return self.path(chunk_id).stat().st_size

    def write_back(self, chunk_id: str, token_ids, kv: ChunkKV) -> int:
        """A query's write of KV it had to encode (a repair, or first use): only when the guard
        allows it and the folder is writable; otherwise the KV is served from memory and the file
        is left for a later query or build (0 bytes written)."""
        if self.write_guard is None:
            return self.write(chunk_id, token_ids, kv)
        with self.write_guard() as refused:
            if refused:  # served from memory; a folder that cannot be written deserves a word
                (log.warning if "not writable" in refused else log.info)(
                    "Chunk %s KV not written back: %s.", chunk_id, refused)
                return 0
            try:
                return self.write(chunk_id, token_ids, kv)
            except OSError as e:
                log.warning("Could not write the KV of chunk %s to %s (%s); it is served from memory and will "
                            "be recomputed by a later query.", chunk_id, self.kv_dir, e.strerror or e)
                return 0

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
            return None, "computed by another model/tokenizer/prefix/wrapper"
        if meta.get("tokens") != self._meta_key(token_ids):
            return None, "token ids differ"
        if meta.get("k_crc32") != _checksum(k) or meta.get("v_crc32") != _checksum(v):
            return None, "checksum mismatch (corrupt)"
        return ChunkKV(k, v), None
