"""lazy_prefill: many new tokens per sequence (question, template, a prefill chunk) over the
paged, position-free KV pool, variable lengths across the batch.

The new tokens' own K/V must already be appended to pages listed in the table for their
sequence (stored like any other page: unrotated for rope_mode="rotate_k", rotated at logical
positions with rot_shift 0 for rope_mode="rotate_q"); attention to themselves is then causal
through the visibility rule (key position <= query position).

`plan_prefill` turns qo_indptr into the list of query tiles once per batch shape (host side);
`lazy_prefill` runs every layer with it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from . import paged_attention
from .decode import copy_into
from .page_table import DEFAULT_ROPE_MODE, PageTable, use_triton
from .reference import paged_attention_ref


@dataclass
class PrefillPlan:
    tile_seq: torch.Tensor   # [num_q_tiles] int32: sequence of each query tile
    tile_q0: torch.Tensor    # [num_q_tiles] int32: first query row of each tile
    block_m: int             # query tokens per tile


def default_block_m(longest: int, num_qo_heads: int, num_kv_heads: int, device) -> int:
    """Query tokens per tile for a batch whose longest sequence has ``longest`` new tokens."""
    gp = triton.next_power_of_2(num_qo_heads // num_kv_heads)
    if torch.device(device).type == "cuda":
        # GPU: 256 (token, head) rows per tile when sequences are long enough to fill them
        # (H200 sweep, +512 tokens: 256 rows 6.6 ms vs 128 rows 7.0 ms), else 128.
        rows = 256 if longest * gp >= 256 else 128
    else:
        rows = 32
    return max(1, rows // gp)


def plan_prefill(qo_indptr, num_qo_heads: int, num_kv_heads: int, device,
                 block_m: int | None = None) -> PrefillPlan:
    """qo_indptr: [B+1] host list/tensor. Tiles of block_m tokens (default: 128 or 256 rows of
    (token, head) pairs on the GPU, 32 rows under the interpreter)."""
    ptr = [int(x) for x in (qo_indptr.tolist() if torch.is_tensor(qo_indptr) else qo_indptr)]
    if block_m is None:
        longest = max([ptr[b + 1] - ptr[b] for b in range(len(ptr) - 1)] + [0])
        block_m = default_block_m(longest, num_qo_heads, num_kv_heads, device)
    seq, q0 = [], []
    for b in range(len(ptr) - 1):
        for s in range(ptr[b], ptr[b + 1], block_m):
            seq.append(b)
            q0.append(s)
    mk = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
    return PrefillPlan(mk(seq), mk(q0), block_m)


def lazy_prefill(q: torch.Tensor, qo_indptr: torch.Tensor, q_pos: torch.Tensor,
                 k_pages: torch.Tensor, v_pages: torch.Tensor, table: PageTable,
                 inv_freq: torch.Tensor, *, rope_mode: str = DEFAULT_ROPE_MODE,
                 attention_scaling: float = 1.0, sm_scale: float | None = None,
                 plan: PrefillPlan | None = None, num_splits: int | None = None,
                 out: torch.Tensor | None = None, return_lse: bool = False,
                 **tuning) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Prefill / append attention.

    q          [Tq, H, D]  new tokens of all sequences, packed (unrotated unless
                           rope_mode="none")
    qo_indptr  [B+1] int32 sequence b's queries are rows qo_indptr[b] .. qo_indptr[b+1]-1
    q_pos      [Tq] int32  logical position of every new token
    k_pages, v_pages, table, inv_freq, rope_mode, attention_scaling, sm_scale, num_splits,
    tuning, return_lse: as lazy_decode
    plan       from plan_prefill (built here, with a host sync, if None)
    Returns    [Tq, H, D] in q.dtype (written into `out` if given); with return_lse=True,
               (out, lse): lse [Tq, H] fp32, each row's natural-log log-sum-exp of its visible
               scores sm_scale * q.k, -inf for a row that sees no key (as lazy_decode).
    """
    if not use_triton(q):
        res = paged_attention_ref(q, qo_indptr, q_pos, k_pages, v_pages, table, inv_freq,
                                  rope_mode, attention_scaling, sm_scale, return_lse=return_lse)
        return copy_into(out, res)
    if plan is None:
        plan = plan_prefill(qo_indptr.cpu(), q.shape[1], k_pages.shape[1], q.device)
    return paged_attention.launch(
        q, qo_indptr, q_pos, k_pages, v_pages, table, inv_freq, rope_mode=rope_mode,
        attention_scaling=attention_scaling, sm_scale=sm_scale, tile_seq=plan.tile_seq,
        tile_q0=plan.tile_q0, block_m=plan.block_m, max_tiles_hint=table.max_pages,
        num_splits=num_splits, out=out, return_lse=return_lse, **tuning)
