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
    rot_shift [nnz]    (rope_mode="rotate_q" only) logical position of the page's rotation
                       origin: the page's keys are stored rotated at (position - rot_shift), so
                       a query at m is rotated by m - rot_shift. 0 = keys already rotated at
                       their logical positions (request-private pages, or a plain positional
                       cache).
    max_pages int      host-side max entries per sequence (sizes the split-KV grid, no sync)

Explicit per-slot positions (optional, both None or both set):

    slot_pos_row [nnz]            -1: an ordinary entry (slot j holds the token at page_pos + j).
                                  r >= 0: slot j of this entry holds the token at logical
                                  position slot_pos[r, j] instead (still only slots j < page_len).
    slot_pos     [m, page_size]   explicit positions; HIDDEN_POS hides a slot from every query.
                                  A hidden slot is never read: its K/V may hold anything.

They let one request see a shared chunk page with some of its tokens hidden (recomputed
privately for that request) without writing the shared page, and store those recomputed tokens
compactly in private pages whose slots carry scattered positions. RoPE does not change: a key's
stored rotation is still described by its entry's rot_shift (rotate_q: stored rotated at its
logical position - rot_shift), "none" uses keys as stored. Explicit rows only exist for the
attention kernels (lazy_decode, lazy_prefill, paged_attention_ref); the benchmarks'
Block-Attention copy (lazy_rag.bench.block_attention) refuses them.

Key visibility: key at logical position p is visible to a query at position m iff p <= m
(queries sit below HIDDEN_POS, so a hidden slot is never visible; a query row with no visible
key returns zeros). The new tokens' own K/V (question, template, generated tokens) are appended
by the caller to private pages listed in the same table, so causal self-attention comes from the
same rule. Entries need not be sorted by position; positions must be distinct within a sequence
for the result to mean a prompt, but the kernels do not rely on it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from . import compiler_setup


# How the pool stores keys, and so how the kernels apply RoPE (the `rope_mode` of every entry
# point): "none" keys stored rotated at their logical positions (q passed already rotated),
# "rotate_q" keys stored rotated at chunk-local positions (position - rot_shift; the query is
# rotated once per chunk). Keys stored unrotated and rotated per key in the loop cost 32% over
# "none" in H200 decode (B32 x 8k: 328 vs 248 us; benchmarks/results/kernels_h200.json, rope
# "rotate_k"), so no kernel serves that storage. The codes are the kernels' ROPE_MODE constexpr.
ROPE_MODES = {"none": 0, "rotate_q": 2}
# The engine's store format and every entry point's default: on the H200, rotate_q decode costs
# <= 2% over "none" at batch >= 32 and context >= 8k (BENCHMARKS.md, "Decode, bf16").
DEFAULT_ROPE_MODE = "rotate_q"
# slot_pos value of a slot no query sees (int32 max: above every query position).
HIDDEN_POS = 2**31 - 1


@dataclass
class PageTable:
    """The CSR page table of one batch (fields as in the module docstring)."""

    indptr: torch.Tensor
    page_ids: torch.Tensor
    page_pos: torch.Tensor
    page_len: torch.Tensor
    rot_shift: torch.Tensor | None = None
    max_pages: int = 0
    slot_pos_row: torch.Tensor | None = None
    slot_pos: torch.Tensor | None = None

    def __post_init__(self):
        if (self.slot_pos_row is None) != (self.slot_pos is None):
            raise ValueError("PageTable: slot_pos_row and slot_pos must both be given or both None")

    @property
    def batch_size(self) -> int:
        return self.indptr.numel() - 1

    @property
    def has_slot_pos(self) -> bool:
        return self.slot_pos_row is not None

    @staticmethod
    def from_lists(page_ids, page_pos, page_len, rot_shift=None, device="cpu", *,
                   slot_pos=None) -> "PageTable":
        """Build from per-sequence python lists (lists of lists of ints).

        slot_pos: per sequence, per entry, None (an ordinary entry) or a list of page_size ints
        (that entry's explicit slot positions, HIDDEN_POS for a hidden slot; values past the
        entry's page_len are ignored). Omitted: a table without explicit positions.
        """
        lens = [len(p) for p in page_ids]
        indptr = [0]
        for n in lens:
            indptr.append(indptr[-1] + n)

        def cat(x):
            return torch.tensor([v for row in x for v in row], dtype=torch.int32, device=device)

        rows, explicit = None, None
        if slot_pos is not None:
            rows, explicit = _slot_pos_tensors(slot_pos, lens, device)
        return PageTable(
            indptr=torch.tensor(indptr, dtype=torch.int32, device=device),
            page_ids=cat(page_ids), page_pos=cat(page_pos), page_len=cat(page_len),
            rot_shift=None if rot_shift is None else cat(rot_shift),
            max_pages=max(lens) if lens else 0, slot_pos_row=rows, slot_pos=explicit,
        )

    def to(self, device) -> "PageTable":
        mv = lambda t: None if t is None else t.to(device)  # noqa: E731
        return PageTable(mv(self.indptr), mv(self.page_ids), mv(self.page_pos),
                         mv(self.page_len), mv(self.rot_shift), self.max_pages,
                         mv(self.slot_pos_row), mv(self.slot_pos))

    def sequences(self, start: int, stop: int) -> "PageTable":
        """Sequences start .. stop-1 as a table of their own (views of the entries; reads indptr
        on the host). slot_pos is shared whole: the rows slot_pos_row points at keep their
        indices."""
        bounds = self.indptr[start:stop + 1]
        ptr = bounds.tolist()
        s, e = ptr[0], ptr[-1]
        part = lambda t: None if t is None else t[s:e]  # noqa: E731
        max_pages = max([b - a for a, b in zip(ptr, ptr[1:])] + [0])
        return PageTable(bounds - s, part(self.page_ids), part(self.page_pos),
                         part(self.page_len), part(self.rot_shift), max_pages,
                         part(self.slot_pos_row), self.slot_pos)


def _slot_pos_tensors(slot_pos, lens, device):
    """slot_pos_row [nnz] and slot_pos [m, page_size] from per-sequence, per-entry lists."""
    if [len(s) for s in slot_pos] != lens:
        raise ValueError("slot_pos: one list per sequence, one item (None or a list) per entry")
    rows, explicit = [], []
    for entry in (x for seq in slot_pos for x in seq):
        if entry is None:
            rows.append(-1)
        else:
            rows.append(len(explicit))
            explicit.append(list(entry))
    widths = {len(x) for x in explicit}
    if len(widths) > 1:
        raise ValueError(f"slot_pos: every explicit row needs page_size ints, got lengths {widths}")
    width = widths.pop() if widths else 0
    return (torch.tensor(rows, dtype=torch.int32, device=device),
            torch.tensor(explicit, dtype=torch.int32, device=device).reshape(len(explicit), width))


def rope_mode_code(rope_mode: str, table: PageTable) -> int:
    """The kernels' ROPE_MODE constant for `rope_mode`; rotate_q needs table.rot_shift."""
    if rope_mode not in ROPE_MODES:
        raise ValueError(f"unknown rope_mode {rope_mode!r}: one of {sorted(ROPE_MODES)}")
    if rope_mode == "rotate_q" and table.rot_shift is None:
        raise ValueError("rope_mode='rotate_q' needs table.rot_shift")
    return ROPE_MODES[rope_mode]


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
    """Dispatch rule: CUDA tensors -> Triton (after Triton's set-up begun at the model's load,
    ``compiler_setup``); CPU tensors -> Triton interpreter when enabled, else the torch reference."""
    if t.is_cuda:
        compiler_setup.wait()
        return True
    return interpreting()
