"""``PagePool``: the engine's KV memory, one tensor pair for every layer, handed out by page.

Layout (the kernels' HND page layout with a leading layer axis):

    k, v : [num_layers, num_pages, num_kv_heads, page_size, head_dim]

so ``pool.k[layer]`` is exactly the ``k_pages`` argument of ``kernels.lazy_decode`` /
``lazy_prefill``. A page holds up to ``page_size`` tokens of one owner: a cached chunk (shared,
position-free), a prefix-cache block, or one request's private tokens. The pool only knows free
and used pages; who owns a page and for how long is the block manager's business.

Key convention (``kernels.DEFAULT_ROPE_MODE == "rotate_q"``): every page's keys are stored rotated at
(logical position - rot_shift). Chunk pages are rotated at chunk-local positions 0..L-1 (the
table gives rot_shift = the chunk's start in a request); private pages at their logical positions
(rot_shift 0). Values are never rotated.
"""
from __future__ import annotations

from collections import Counter, deque

import torch


class OutOfPages(RuntimeError):
    """No free page and nothing evictable: the scheduler must preempt or wait."""


class PagePool:
    def __init__(self, num_layers: int, num_pages: int, num_kv_heads: int, page_size: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"need num_pages >= 1 and page_size >= 1, got {num_pages}, {page_size}")
        self.num_layers, self.num_pages, self.num_kv_heads = num_layers, num_pages, num_kv_heads
        self.page_size, self.head_dim, self.dtype = page_size, head_dim, dtype
        self.device = torch.device(device)
        # one spare page past the allocator's range: CUDA-graph decode points its padding rows
        # at it, so a padded batch never writes into a page somebody owns
        self.scratch_page = num_pages
        shape = (num_layers, num_pages + 1, num_kv_heads, page_size, head_dim)
        # CPU: memory is committed page by page as pages are written (every slot the CPU paths
        # read was written first), so a generous default budget costs nothing until used.
        # CUDA: zeros, because padded rows of captured decode steps read the scratch page.
        alloc = torch.zeros if self.device.type == "cuda" else torch.empty
        self.k = alloc(shape, dtype=dtype, device=self.device)
        self.v = alloc(shape, dtype=dtype, device=self.device)
        self._free: deque[int] = deque(range(num_pages))
        self._used = bytearray(num_pages)  # 1 while allocated: catches double frees at once
        # CPU: a freed page is handed out again first, so the memory committed stays that of the
        # most pages ever in use at once; handed out in order, a long run (an index build that
        # frees every batch) would touch, and commit, the whole budget
        self._reuse_first = self.device.type == "cpu"

    # -- sizing ---------------------------------------------------------------------------------
    @staticmethod
    def page_bytes(num_layers: int, num_kv_heads: int, page_size: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes of K+V one page occupies across all layers."""
        return 2 * num_layers * num_kv_heads * page_size * head_dim * torch.empty((), dtype=dtype).element_size()

    @classmethod
    def pages_for_budget(cls, budget_bytes: int, num_layers: int, num_kv_heads: int, page_size: int,
                         head_dim: int, dtype: torch.dtype) -> int:
        return max(1, int(budget_bytes) // cls.page_bytes(num_layers, num_kv_heads, page_size, head_dim, dtype))

    @property
    def bytes_per_page(self) -> int:
        return self.page_bytes(self.num_layers, self.num_kv_heads, self.page_size, self.head_dim, self.dtype)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # -- allocation -----------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} pages, {len(self._free)} free")
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self._used[p] = 1
        return pages

    def free(self, pages) -> None:
        pages = list(pages)
        twice = [p for p in pages if not self._used[p]] or [p for p, n in Counter(pages).items() if n > 1]
        if twice:  # checked before any is freed: a bad call changes nothing
            raise RuntimeError(f"page {twice[0]} freed twice")
        for p in pages:
            self._used[p] = 0
        if self._reuse_first:
            self._free.extendleft(reversed(pages))  # the first freed is handed out first
        else:
            self._free.extend(pages)

    def is_used(self, page: int) -> bool:
        return bool(self._used[page])

    # -- data -----------------------------------------------------------------------------------
    def write_run(self, pages: list[int], k: torch.Tensor, v: torch.Tensor, first_slot: int = 0) -> None:
        """Write a run of tokens K/V [layers, n, Hkv, D] into ``pages`` from slot ``first_slot``
        of the first page on (token i goes to slot first_slot + i, spilling into later pages)."""
        n, s = k.shape[1], self.page_size
        i = 0
        while i < n:
            slot = first_slot + i
            page, off = pages[slot // s], slot % s
            m = min(s - off, n - i)
            self.k[:, page, :, off:off + m] = k[:, i:i + m].transpose(1, 2).to(self.dtype)
            self.v[:, page, :, off:off + m] = v[:, i:i + m].transpose(1, 2).to(self.dtype)
            i += m

    def read_run(self, pages: list[int], num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V [layers, num_tokens, Hkv, D] of the first num_tokens slots of ``pages``."""
        idx = torch.tensor(pages, device=self.device, dtype=torch.long)
        k = self.k[:, idx].transpose(2, 3).reshape(self.num_layers, -1, self.num_kv_heads, self.head_dim)
        v = self.v[:, idx].transpose(2, 3).reshape(self.num_layers, -1, self.num_kv_heads, self.head_dim)
        return k[:, :num_tokens], v[:, :num_tokens]
