"""lazy_decode: one new token per sequence over the paged, position-free KV pool.

Flash-decoding: the grid is (sequence, KV head, split of the page list); each program reads its
share of K/V once for all G query heads of the KV head, and a small merge kernel combines the
splits' partial outputs by their log-sum-exp. The split count comes from a heuristic (about two
programs per SM) using table.max_pages, so the call needs no host sync and can be captured in a
CUDA graph.
"""
from __future__ import annotations

import torch

from . import paged_attention
from .page_table import DEFAULT_ROPE_MODE, PageTable, use_triton
from .reference import paged_attention_ref


def lazy_decode(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, table: PageTable,
                q_pos: torch.Tensor, inv_freq: torch.Tensor, *,
                rope_mode: str = DEFAULT_ROPE_MODE, attention_scaling: float = 1.0,
                sm_scale: float | None = None, num_splits: int | None = None,
                out: torch.Tensor | None = None, return_lse: bool = False,
                k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                softcap: float | None = None, window: int | None = None,
                **tuning) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Decode attention.

    q        [B, H, D]   new token's query (unrotated; rope_mode="none": already rotated),
                         H % Hkv == 0
    k_pages, v_pages     [num_pages, Hkv, page_size, D] pool, same dtype as q; or
                         float8_e4m3fn pages with their per-token scales:
    k_scale, v_scale     [num_pages, Hkv, page_size] (fp16) for fp8 pages, else None
                         (kernels/kv_quant.py: value = page * scale; q in the compute dtype)
    table    PageTable   B sequences (see page_table.py, explicit slot positions included); the
                         new token's own K/V must already be in a page listed for it (it attends
                         to itself)
    q_pos    [B] int32   logical position of each new token
    inv_freq [D/2] fp32  model's RoPE inverse frequencies; attention_scaling multiplies cos/sin
    rope_mode            how the pool stores keys: "rotate_q" (the default: chunk-local
                         rotation, table.rot_shift), "none" (q and keys already rotated)
    sm_scale             softmax scale of q.k (default head_dim ** -0.5)
    softcap              scores s = sm_scale * q.k soft-capped, softcap * tanh(s / softcap),
                         before the mask and softmax (Gemma 2; the lse is of the capped
                         scores); None: not capped
    window               a query at position p sees only keys at p - window + 1 .. p (a
                         sliding-window layer); None: every key up to p
    num_splits, tuning   split-KV programs per sequence; block_n, num_warps, num_stages,
                         split_target (paged_attention.launch)
    return_lse           also return each row's log-sum-exp (below)
    Returns  [B, H, D] in q.dtype (written into `out` if given); with return_lse=True,
             (out, lse): lse [B, H] fp32 = logsumexp over the row's visible keys of
             sm_scale * q.k (natural log, the logits the softmax used), -inf for a row that
             sees no key (its out row is zeros). Two calls over disjoint key groups merge
             exactly: o = sum_g exp(lse_g - m) o_g / sum_g exp(lse_g - m), m = max_g lse_g.
    """
    B = q.shape[0]
    if not use_triton(q):
        qo = torch.arange(B + 1, dtype=torch.int32, device=q.device)
        res = paged_attention_ref(q, qo, q_pos, k_pages, v_pages, table, inv_freq,
                                  rope_mode, attention_scaling, sm_scale, return_lse=return_lse,
                                  k_scale=k_scale, v_scale=v_scale, softcap=softcap, window=window)
        return copy_into(out, res)
    ar = torch.arange(B + 1, dtype=torch.int32, device=q.device)
    return paged_attention.launch(
        q, ar, q_pos, k_pages, v_pages, table, inv_freq, rope_mode=rope_mode,
        attention_scaling=attention_scaling, sm_scale=sm_scale, tile_seq=ar[:B], tile_q0=ar[:B],
        block_m=1, max_tiles_hint=table.max_pages, num_splits=num_splits, out=out,
        return_lse=return_lse, k_scale=k_scale, v_scale=v_scale, softcap=softcap, window=window,
        **tuning)


def copy_into(out: torch.Tensor | None, res):
    """The reference path's result, written into `out` when the caller gave one; res is the
    output or (output, lse)."""
    o = res[0] if isinstance(res, tuple) else res
    if out is None:
        return res
    out.copy_(o)
    return (out, res[1]) if isinstance(res, tuple) else out
