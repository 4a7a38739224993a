"""Prefill through the tiles kernel (kernels/paged_attention.py, lazy_decode's) with BLOCK_M
query tokens per program: the kernel lazy_prefill's runs kernel (kernels/prefill_runs.py)
replaced, kept for the kernel benchmarks' side-by-side timings (benchmarks/attention_kernels.py,
benchmarks/ptx_fp8_loop.py) and for the tests that hold the tiles kernel's multi-row tiles to the
reference. Nothing of the runtime imports this.
"""
from __future__ import annotations

import torch

from lazy_rag.kernels import paged_attention
from lazy_rag.kernels.page_table import DEFAULT_ROPE_MODE, PageTable, use_triton
from lazy_rag.kernels.prefill import PrefillPlan, lazy_prefill, plan_prefill
from lazy_rag.kernels.triton_import import triton


def tiles_block_m(longest: int, num_qo_heads: int, num_kv_heads: int, device,
                  dtype: torch.dtype | None = None) -> int:
    """Query tokens per tile for a batch whose longest sequence has ``longest`` new tokens: on
    the GPU 256 (token, head) rows when sequences are long enough to fill them (H200 sweep, +512
    tokens: 256 rows 6.6 ms vs 128 rows 7.0 ms), else 128, and at most 64 in a 32-bit compute
    `dtype` (128 rows need 263 KB of shared memory at head_dim 128, past Hopper's 227 KB: the
    launch fails); 32 rows off the GPU."""
    gp = triton.next_power_of_2(num_qo_heads // num_kv_heads)
    if torch.device(device).type != "cuda":
        rows = 32
    else:
        rows = 256 if longest * gp >= 256 else 128
    if dtype is not None and dtype.itemsize > 2:
        rows = min(rows, 64)
    return max(1, rows // gp)


def plan_tiles_prefill(qo_indptr, num_qo_heads: int, num_kv_heads: int, device,
                       block_m: int | None = None,
                       dtype: torch.dtype | None = None) -> PrefillPlan:
    """kernels.plan_prefill's plan, with tiles_block_m's tiles by default."""
    if block_m is None:
        bounds = qo_indptr.tolist() if torch.is_tensor(qo_indptr) else list(qo_indptr)
        longest = max((int(b) - int(a) for a, b in zip(bounds, bounds[1:])), default=0)
        block_m = tiles_block_m(longest, num_qo_heads, num_kv_heads, device, dtype)
    return plan_prefill(qo_indptr, num_qo_heads, num_kv_heads, device, block_m=block_m,
                        dtype=dtype)


def tiles_prefill(q: torch.Tensor, qo_indptr: torch.Tensor, q_pos: torch.Tensor,
                  k_pages: torch.Tensor, v_pages: torch.Tensor, table: PageTable,
                  inv_freq: torch.Tensor, *, plan: PrefillPlan | None = None,
                  rope_mode: str = DEFAULT_ROPE_MODE, attention_scaling: float = 1.0,
                  sm_scale: float | None = None, num_splits: int | None = None,
                  out: torch.Tensor | None = None,
                  **options) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """kernels.lazy_prefill's arguments (``options``: return_lse, k_scale, v_scale and the
    tuning) and result, through the tiles kernel. The plan's split_target is the runs kernel's:
    this launch keeps its own (the tuning's, or 2 programs per SM)."""
    if not use_triton(q):    # no kernel runs: lazy_prefill's torch reference
        return lazy_prefill(q, qo_indptr, q_pos, k_pages, v_pages, table, inv_freq,
                            rope_mode=rope_mode, attention_scaling=attention_scaling,
                            sm_scale=sm_scale, out=out, **options)
    if plan is None:
        plan = plan_tiles_prefill(qo_indptr.cpu(), q.shape[1], k_pages.shape[1], q.device,
                                  dtype=q.dtype)
    return paged_attention.launch(
        q, qo_indptr, q_pos, k_pages, v_pages, table, inv_freq, rope_mode=rope_mode,
        attention_scaling=attention_scaling, sm_scale=sm_scale, tile_seq=plan.tile_seq,
        tile_q0=plan.tile_q0, block_m=plan.block_m, max_tiles_hint=table.max_pages,
        num_splits=num_splits, out=out, **options)
