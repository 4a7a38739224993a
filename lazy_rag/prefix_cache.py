"""Exact-prefix KV reuse, like vLLM's automatic prefix caching.

KV is kept in blocks of ``block_size`` tokens, each keyed by a hash chain over the token ids of
all blocks up to and including it, so a block is only found again behind exactly the same
prefix. Keys are stored rotated at their absolute positions (valid only at that prefix).
"""
from __future__ import annotations

import hashlib

import torch

from .lru import ByteLRU


def _block_hashes(ids: list[int], block_size: int) -> list[bytes]:
    hashes, prev = [], b""
    for b in range(len(ids) // block_size):
        h = hashlib.sha256(prev)
        h.update(torch.tensor(ids[b * block_size:(b + 1) * block_size], dtype=torch.int64).numpy().tobytes())
        prev = h.digest()
        hashes.append(prev)
    return hashes


class PrefixCache:
    def __init__(self, max_bytes: int, block_size: int = 16):
        self.block_size = block_size
        self.blocks: ByteLRU[tuple[torch.Tensor, torch.Tensor]] = ByteLRU(
            max_bytes, lambda kv: kv[0].numel() * kv[0].element_size() * 2
        )

    def lookup(self, ids: list[int], max_tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The cached blocks of the longest block-aligned prefix of ``ids`` (at most max_tokens)."""
        hashes = []
        for h in _block_hashes(ids[:max_tokens], self.block_size):
            if h not in self.blocks:
                break
            hashes.append(h)
        # touch tail-first so that a chain's head is the most recently used: eviction then takes
        # tails first, never a head that would make the rest of its chain unreachable (as vLLM)
        found = [self.blocks.get(h) for h in reversed(hashes)]
        return found[::-1]

    def insert(self, ids: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Store every full block of ``ids`` from rotated K/V [layers, len(ids), H, D]."""
        bs = self.block_size
        hashes = _block_hashes(ids, bs)
        for b in reversed(range(len(hashes))):  # tail first, head last: see lookup
            if hashes[b] in self.blocks:
                self.blocks.get(hashes[b])
            else:
                sl = slice(b * bs, (b + 1) * bs)
                self.blocks.put(hashes[b], (k[:, sl].clone(), v[:, sl].clone()))
