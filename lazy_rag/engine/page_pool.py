"""``PagePool``: the engine's KV memory, one tensor pair for every layer, handed out by page.

Layout (the kernels' HND page layout with a leading layer axis):

    k, v : [num_layers, num_pages, num_kv_heads, page_size, head_dim]

so ``pool.k[layer]`` is exactly the ``k_pages`` argument of ``kernels.lazy_decode`` /
``lazy_prefill``. A page holds up to ``page_size`` tokens of one owner: a cached chunk (shared,
position-free), a prefix-cache block, or one request's private tokens. The pool only knows free
and used pages; who owns a page and for how long is the block manager's business.

Key convention (``kernels.DEFAULT_ROPE_MODE == "rotate_q"``): every page's keys are stored rotated at
(logical position - rot_shift), in each layer by that layer's own RoPE table
(``ModelParts.layer_rope``: the model's one table, but for Gemma 3's sliding layers). Chunk pages
are rotated at chunk-local positions 0..L-1 (the table gives rot_shift = the chunk's start in a
request); private pages at their logical positions (rot_shift 0). Values are never rotated.

fp8 pools (``dtype=torch.float8_e4m3fn``, ``EngineConfig(kv_dtype="fp8")``): k and v in fp8 plus
one fp16 scale per (layer, page slot, KV head) for each,

    k_scale, v_scale : [num_layers, num_pages, num_kv_heads, page_size]

(``kernels/kv_quant.py``: value = page * scale, a scale computed whenever a token is written).
The model computes in its own dtype; only storage is fp8. Every write goes through this class
(``write_tokens``, ``write_run``, ``copy_rotate``) and quantises; every torch read
(``gather``, ``run_tokens``, ``read_run``) dequantises (to fp32); the kernels take the pages with
``scales(layer)``. An fp8 pool's ``v`` is keys-major in memory (``kernels/v_layout.py``), a
transposed view with the shape above.
"""
from __future__ import annotations

from collections import Counter, deque

import torch

from ..kernels import (FP8, copy_rotate_run, dequantize_rows, interpreting, new_v_pages, quantize_rows,
                       write_kv)


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
        if dtype == FP8:
            # fp8 V keys-major (a transposed view, indexed as above): the attention kernels'
            # P @ V loads it without byte-wise shared-memory gathers; zero-filled wherever the
            # Triton kernels run, because they read whole pages (kernels/v_layout.py)
            self.v = new_v_pages(shape, dtype, self.device,
                                 zero=self.device.type == "cuda" or interpreting())
        else:
            self.v = alloc(shape, dtype=dtype, device=self.device)
        self.k_scale = self.v_scale = None
        if self.quantized:
            self.k_scale = alloc(shape[:-1], dtype=torch.float16, device=self.device)
            self.v_scale = alloc(shape[:-1], dtype=torch.float16, device=self.device)
        self._free: deque[int] = deque(range(num_pages))
        self._used = bytearray(num_pages)  # 1 while allocated: catches double frees at once
        # CPU: a freed page is handed out again first, so the memory committed stays that of the
        # most pages ever in use at once; handed out in order, a long run (an index build that
        # frees every batch) would touch, and commit, the whole budget
        self._reuse_first = self.device.type == "cpu"

    # -- sizing ---------------------------------------------------------------------------------
    @staticmethod
    def page_bytes(num_layers: int, num_kv_heads: int, page_size: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes of K+V one page occupies across all layers (an fp8 pool's scales included: 2 bytes
        per head_dim-byte row, 50.8% of bf16 at head_dim 128)."""
        row = head_dim * torch.empty((), dtype=dtype).element_size() + (2 if dtype == FP8 else 0)
        return 2 * num_layers * num_kv_heads * page_size * row

    @property
    def quantized(self) -> bool:
        """fp8 pages with per-token scales."""
        return self.dtype == FP8

    @property
    def lossy(self) -> bool:
        """A read returns other values than were written (an fp8 pool's, quantised): a step that
        attends to its new tokens' exact K/V cannot read them back from such a pool."""
        return self.quantized

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
    def scales(self, layer: int) -> dict:
        """The kernels' scale arguments for ``layer`` (``k_scale=, v_scale=``; none unless fp8)."""
        if not self.quantized:
            return {}
        return {"k_scale": self.k_scale[layer], "v_scale": self.v_scale[layer]}

    def write_tokens(self, layer: int, page: torch.Tensor, slot: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor) -> None:
        """A step's new tokens' K/V [n, Hkv, D] to (page [n], slot [n]) of ``layer`` (quantised per
        token for fp8: the fused kernel on CUDA). No host sync: captured in the step graphs."""
        write_kv(self.k[layer], self.v[layer], None if self.k_scale is None else self.k_scale[layer],
                 None if self.v_scale is None else self.v_scale[layer], page, slot, k, v)

    def write_run(self, pages: list[int], k: torch.Tensor, v: torch.Tensor, first_slot: int = 0) -> None:
        """Write a run of tokens K/V [layers, n, Hkv, D] into ``pages`` from slot ``first_slot``
        of the first page on (token i goes to slot first_slot + i, spilling into later pages)."""
        n, s = k.shape[1], self.page_size
        kq = vq = None
        if self.quantized:   # quantised once; the bytes go through uint8 views
            kq, vq = quantize_rows(k), quantize_rows(v)
        i = 0
        while i < n:
            slot = first_slot + i
            page, off = pages[slot // s], slot % s
            m = min(s - off, n - i)
            if kq is None:
                self.k[:, page, :, off:off + m] = k[:, i:i + m].transpose(1, 2).to(self.dtype)
                self.v[:, page, :, off:off + m] = v[:, i:i + m].transpose(1, 2).to(self.dtype)
            else:
                for pool, scale, (x8, xs) in ((self.k, self.k_scale, kq), (self.v, self.v_scale, vq)):
                    pool.view(torch.uint8)[:, page, :, off:off + m] = x8[:, i:i + m].view(torch.uint8).transpose(1, 2)
                    scale[:, page, :, off:off + m] = xs[:, i:i + m].transpose(1, 2)
            i += m

    def copy_rotate(self, src_pages: torch.Tensor, n_tokens: int, dst_pages: torch.Tensor, first_slot: int,
                    shift: int, inv_freq: torch.Tensor) -> None:
        """Block-Attention's copy of a run inside the pool, keys rotated by ``shift`` positions of
        ``inv_freq`` ([D/2], or each layer's own [layers, D/2]; ``kernels.copy_rotate_run``; fp8:
        dequantised, rotated, quantised again)."""
        copy_rotate_run(self.k, self.v, src_pages, n_tokens, dst_pages, first_slot, shift, inv_freq,
                        k_scale=self.k_scale, v_scale=self.v_scale)

    def gather(self, layer: int, page: torch.Tensor, slot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V [n, Hkv, D] of the slots (page [n], slot [n]) of ``layer``: the pool dtype, or fp32
        dequantised from an fp8 pool."""
        if not self.quantized:
            return self.k[layer][page, :, slot], self.v[layer][page, :, slot]
        return tuple(dequantize_rows(x.view(torch.uint8)[layer][page, :, slot].view(FP8), s[layer][page, :, slot])
                     for x, s in ((self.k, self.k_scale), (self.v, self.v_scale)))

    def run_tokens(self, layer: int, pages: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V [num_tokens, Hkv, D] of the first num_tokens slots of ``pages`` (a tensor) in
        ``layer`` (dequantised to fp32 from an fp8 pool)."""
        out = []
        for x, s in ((self.k, self.k_scale), (self.v, self.v_scale)):
            if s is None:
                t = x[layer][pages]
            else:
                t = dequantize_rows(x.view(torch.uint8)[layer][pages].view(FP8), s[layer][pages])
            out.append(t.transpose(1, 2).reshape(-1, self.num_kv_heads, self.head_dim)[:num_tokens])
        return out[0], out[1]

    def read_run(self, pages: list[int], num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V [layers, num_tokens, Hkv, D] of the first num_tokens slots of ``pages`` (dequantised to
        fp32 from an fp8 pool)."""
        idx = torch.tensor(pages, device=self.device, dtype=torch.long)
        out = []
        for x, s in ((self.k, self.k_scale), (self.v, self.v_scale)):
            if s is None:
                t = x[:, idx]
            else:
                t = dequantize_rows(x.view(torch.uint8)[:, idx].view(FP8), s[:, idx])
            out.append(t.transpose(2, 3).reshape(self.num_layers, -1, self.num_kv_heads, self.head_dim)[:, :num_tokens])
        return out[0], out[1]
