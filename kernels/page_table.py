"""Paged KV description shared by every kernel, and the device dispatch rule.

Page pool (one per layer), layout HND:

    k_pages, v_pages : [num_pages, num_kv_heads, page_size, head_dim]   (bf16 / fp16 / fp32)

HND rather than NHD because a kernel program works on one KV head: with HND a page of one head
is one contiguous run of page_size * head_dim elements (16 KiB at page 64, d 128, bf16), so a
tile load is a few long contiguous bursts instead of page_size rows of 256 B strided by
num_kv_heads * head_dim. The kernels take strides, so any view with a unit stride on head_dim
works (an NHD pool passed as `pool.transpose(1, 2)` is accepted too, at some cost in coalescing).

A page holds up to page_size tokens of one chunk (or of one request's private tokens). It may be
shared by any number of sequences at different logical offsets and is never copied to place it.

Per batch, the pages each sequence attends to, in CSR form (all int32, on the pool's device):

    indptr    [B + 1]  sequence b owns entries indptr[b] .. indptr[b+1]-1
    page_ids  [nnz]    physical page index into the pool
    page_pos  [nnz]    logical position of the page's first token in this sequence
    page_len  [nnz]    valid tokens in the page (1 .. page_size); token j has position page_pos + j
    rot_shift [nnz]    (rope="rotate_q" only) logical position of the page's rotation origin: the
                       page's keys are stored rotated at (position - rot_shift), so a query at m is
                       rotated by m - rot_shift. 0 = keys already rotated at their logical
                       positions (request-private pages, or a plain positional cache).
    max_pages int      host-side max entries per sequence (sizes the split-KV grid, no sync)

Key visibility: key at logical position p is visible to a query at position m iff p <= m.
The new tokens' own K/V (question, template, generated tokens) are appended by the caller to
private pages listed in the same table, so causal self-attention comes from the same rule.
Entries need not be sorted by position; positions must be distinct within a sequence for the
result to mean a prompt, but the kernels do not rely on it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass
class PageTable:
    indptr: torch.Tensor
    page_ids: torch.Tensor
    page_pos: torch.Tensor
    page_len: torch.Tensor
    rot_shift: torch.Tensor | None = None
    max_pages: int = 0

    @property
    def batch_size(self) -> int:
        return self.indptr.numel() - 1

    @staticmethod
    def from_lists(page_ids, page_pos, page_len, rot_shift=None, device="cpu") -> "PageTable":
        """Build from per-sequence python lists (lists of lists of ints)."""
        lens = [len(p) for p in page_ids]
        indptr = [0]
        for n in lens:
            indptr.append(indptr[-1] + n)

        def cat(x):
            return torch.tensor([v for row in x for v in row], dtype=torch.int32, device=device)

        return PageTable(
            indptr=torch.tensor(indptr, dtype=torch.int32, device=device),
            page_ids=cat(page_ids), page_pos=cat(page_pos), page_len=cat(page_len),
            rot_shift=None if rot_shift is None else cat(rot_shift),
            max_pages=max(lens) if lens else 0,
        )

    def to(self, device) -> "PageTable":
        mv = lambda t: None if t is None else t.to(device)  # noqa: E731
        return PageTable(mv(self.indptr), mv(self.page_ids), mv(self.page_pos),
                         mv(self.page_len), mv(self.rot_shift), self.max_pages)


ROPE_MODES = {"none": 0, "rotate_k": 1, "rotate_q": 2}


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1)."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return True
    try:
        import triton
        return bool(triton.knobs.runtime.interpret)
    except Exception:  # older triton without knobs
        return False


def use_triton(t: torch.Tensor) -> bool:
    """Dispatch rule: CUDA tensors -> Triton; CPU tensors -> Triton interpreter when enabled,
    else the torch reference."""
    return t.is_cuda or interpreting()
