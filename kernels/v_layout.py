"""Value pages stored keys-major: the layout fp8 pools use, and the attention kernels' V load.

Every page tensor is indexed [num_pages, num_kv_heads, page_size, head_dim]. K pages, and V pages
in bf16 / fp16 / fp32, are laid out that way (head_dim contiguous, "dims-major"). fp8 V pages of
the engine's pool are laid out [num_pages, num_kv_heads, head_dim, page_size] in memory (a page's
keys contiguous per dimension, "keys-major") and handed to everyone as the transposed view, so
indexing, the torch reference and every torch writer see the usual shape.

Why: P @ V takes V as the MMA's B operand, whose register fragment holds consecutive keys of
one dimension. From a dims-major fp8 tile in shared memory sm_90 can only gather those one byte
per load (it has no transposed 8-bit ldmatrix: 130 LDS.U8 per thread per tile in the decode
loop, benchmarks/ptx_fp8_loop.py), which held fp8 decode at 0.69 of bf16's bytes/s. Keys-major,
the V tile loads like the K tile does for Q @ K^T (the loop's byte loads go, and with them the
register spills).

The kernels load a keys-major tile masked per page, not per key: a key-level mask along the
contiguous axis would leave Triton unable to vectorise or software-pipeline the load. So every
slot of a listed page is read, and must hold a finite value (its probability is 0, but 0 * NaN
is NaN): new_v_pages zero-fills, and every writer stores quantised, finite values.
"""
from __future__ import annotations

import torch

from .triton_import import tl, triton


def keys_major(v_pages: torch.Tensor) -> bool:
    """Whether V pages [..., page_size, head_dim] are the keys-major view (unit stride along
    slots). head_dim is never 1, so a unit stride along it means dims-major."""
    return v_pages.stride(-1) != 1


def new_v_pages(shape, dtype: torch.dtype, device, zero: bool = True) -> torch.Tensor:
    """Keys-major V pages: memory [..., head_dim, page_size], returned as the view
    [..., page_size, head_dim] (shape). Zero-filled, as the kernels need (module docstring),
    unless ``zero=False`` (pages only the torch reference reads, which reads no unwritten slot)."""
    *lead, page, d = shape
    alloc = torch.zeros if zero else torch.empty
    return alloc((*lead, d, page), dtype=dtype, device=device).transpose(-1, -2)


def to_keys_major(v_pages: torch.Tensor) -> torch.Tensor:
    """A keys-major copy of V pages [..., page_size, head_dim] (tests and benchmarks)."""
    out = new_v_pages(v_pages.shape, v_pages.dtype, v_pages.device)
    out.copy_(v_pages)
    return out


def v_args(v_pages: torch.Tensor) -> dict:
    """The attention kernels' V layout arguments: stride_vd (along head_dim) and V_KEYS_MAJOR.
    A keys-major tensor must be the layout new_v_pages makes (slots contiguous, head_dim rows of
    page_size, pages and heads whole rows), which the kernel's vectorised load relies on."""
    if not keys_major(v_pages):
        return dict(stride_vd=1, V_KEYS_MAJOR=False)
    page = v_pages.shape[-2]
    rows = v_pages.stride()[:-2]
    if v_pages.stride(-2) != 1 or v_pages.stride(-1) != page or any(s % page for s in rows):
        raise ValueError(f"v_pages: strides {v_pages.stride()} are neither dims-major (unit stride "
                         f"along head_dim) nor keys-major as kernels.new_v_pages lays them out")
    return dict(stride_vd=page, V_KEYS_MAJOR=True)


@triton.jit
def load_v(V_h, pid, off, stride_vp, stride_vt, stride_vd, e_ok, k_ok, D: tl.constexpr,
           PAGE: tl.constexpr, KEYS_MAJOR: tl.constexpr):
    """The V tile [BLOCK_N, D] of keys n = (page pid[n], slot off[n]) of one KV head (V_h).
    Dims-major: masked per key (k_ok; masked keys read 0). Keys-major: loaded as [D, BLOCK_N]
    rows of a page's contiguous slots, masked per page (e_ok; module docstring), transposed in
    registers; the hints tell Triton what it cannot see through the gathered page ids: each run
    of PAGE slots is contiguous and starts aligned."""
    d = tl.arange(0, D)
    if KEYS_MAJOR:
        offs = pid.to(tl.int64)[None, :] * stride_vp + off[None, :] * stride_vt \
            + d[:, None] * stride_vd
        offs = tl.max_contiguous(tl.multiple_of(offs, [1, PAGE if PAGE < 16 else 16]), [1, PAGE])
        return tl.trans(tl.load(V_h + offs, mask=e_ok[None, :], other=0.0))
    offs = pid.to(tl.int64)[:, None] * stride_vp + off[:, None] * stride_vt + d[None, :]
    return tl.load(V_h + offs, mask=k_ok[:, None], other=0.0)
