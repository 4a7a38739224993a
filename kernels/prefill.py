"""lazy_prefill: many new tokens per sequence (question, template, a prefill chunk) over the
paged, position-free KV pool, variable lengths across the batch.

The new tokens' own K/V must already be appended to pages listed in the table for their
sequence (stored like any other page: rotated at their logical positions, with rot_shift 0
for rope_mode="rotate_q"); attention to themselves is then causal
through the visibility rule (key position <= query position).

`plan_prefill` turns qo_indptr into the list of query tiles once per batch shape (host side);
`lazy_prefill` runs every layer with it through prefill_runs.py's kernel (runs of equal
rot_shift, a plain flash-attention inner loop).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .triton_import import triton
from . import paged_attention, prefill_runs
from .decode import copy_into
from .page_table import DEFAULT_ROPE_MODE, PageTable, use_triton
from .reference import paged_attention_ref


@dataclass
class PrefillPlan:
    tile_seq: torch.Tensor   # [num_q_tiles] int32: sequence of each query tile
    tile_q0: torch.Tensor    # [num_q_tiles] int32: first query row of each tile
    block_m: int             # query tokens per tile
    split_target: float = 2.0  # split-KV programs per SM (plan_split_target)
    # an index build's encode batch (plan_prefill's ``encode``): launched as a full one whatever
    # its size, with one split and the runs kernel's tuning for a GPU full of programs
    full_batch: bool = False


def default_block_m(longest: int, num_qo_heads: int, num_kv_heads: int, device,
                    total: int | None = None, dtype: torch.dtype | None = None, head_dim: int = 128) -> int:
    """Query tokens per tile for a batch whose longest sequence has ``longest`` new tokens and
    all sequences ``total`` (default: longest), in compute `dtype` (None: a 16-bit one), heads of
    ``head_dim``."""
    gp = triton.next_power_of_2(num_qo_heads // num_kv_heads)
    device = torch.device(device)
    if device.type != "cuda":
        rows = 32
    else:
        rows = runs_rows(longest * gp, (total or longest) * gp, num_kv_heads,
                         paged_attention._num_sms(device))
    return max(1, max_rows(rows, dtype, head_dim) // gp)


def max_rows(rows: int, dtype: torch.dtype | None, head_dim: int = 128) -> int:
    """rows, capped so that a tile's rows x head_dim stay what sm_90 compiles at head_dim 128:
    256 rows in a 16-bit dtype (wider tiles run out of registers: 256 rows at head_dim 256 fail
    in ptxas), 128 in a 32-bit one (its larger tiles need more shared memory than an SM has and
    fail to launch: 256 rows take 263 KB against Hopper's 227 KB, 128 rows 164 KB)."""
    elements = (128 if dtype is not None and dtype.itemsize > 2 else 256) * 128
    return min(rows, max(16, elements // head_dim))


def encode_block_m(longest: int, num_qo_heads: int, num_kv_heads: int, device,
                   dtype: torch.dtype | None = None, head_dim: int = 128) -> int:
    """Query tokens per tile for an index build's encode batch, whatever its size: the tiles a
    full build batch takes (runs_rows at its many programs: 256 (token, head) rows once a chunk
    fills more than one 128-row tile), launched with one split (what a full batch's count is).
    A small batch (an update of a few documents, a build's short last batch) then runs the
    kernel the build compiled instead of compiling the variant its own size would pick: seconds
    of compile on a machine's first run, for a forward of milliseconds."""
    device = torch.device(device)
    if device.type != "cuda":
        return default_block_m(longest, num_qo_heads, num_kv_heads, device, head_dim=head_dim)
    gp = triton.next_power_of_2(num_qo_heads // num_kv_heads)
    return max(1, max_rows(runs_rows(longest * gp, 1 << 40, num_kv_heads, 1), dtype, head_dim) // gp)


def plan_split_target(longest: int, num_qo_heads: int, num_kv_heads: int) -> float:
    """Split-KV programs per SM for the runs kernel: one when every sequence's new tokens fit one
    128-row tile (+32 tokens on the H100: B1 40.6 us vs 49.3 us at two, B16 306 vs 400 us), else
    two (the long cases' sweep setting)."""
    gp = triton.next_power_of_2(num_qo_heads // num_kv_heads)
    return 1.0 if longest * gp <= 128 else 2.0


def runs_rows(longest_rows: int, total_rows: int, num_kv_heads: int, num_sms: int) -> int:
    """(token, head) rows per query tile of the runs kernel: as many as keep the GPU full of
    (tile, KV head) programs. H100 sweep (benchmarks/results/kernels_h100_sweep.json, 10k cached,
    rotate_q): every token of a sequence in one 128-row tile when it fits (+32 tokens: B16 74% of
    roofline); 256 rows with 16 warps when that still gives >= 4 programs per SM (B16 +512: 51%
    vs 48% at 128 rows); else 128 rows when >= 2 per SM; else 64 (B1 +512: 40% vs 31% at 128)."""
    if longest_rows <= 128:
        return 128
    programs = lambda rows: -(-total_rows // rows) * num_kv_heads  # noqa: E731
    if programs(256) >= 4 * num_sms:
        return 256
    return 128 if programs(128) >= 2 * num_sms else 64


def plan_prefill(qo_indptr, num_qo_heads: int, num_kv_heads: int, device,
                 block_m: int | None = None, dtype: torch.dtype | None = None,
                 encode: bool = False, head_dim: int = 128) -> PrefillPlan:
    """qo_indptr: [B+1] host list/tensor. Tiles of block_m tokens (default_block_m: on the GPU
    64-256 (token, head) rows (runs_rows); 32 rows under the interpreter). ``encode``: an index build's encode batch, planned as a full
    one whatever its size (encode_block_m's tiles; one split and a full batch's launch tuning,
    PrefillPlan.full_batch)."""
    ptr = [int(x) for x in (qo_indptr.tolist() if torch.is_tensor(qo_indptr) else qo_indptr)]
    longest = max([ptr[b + 1] - ptr[b] for b in range(len(ptr) - 1)] + [0])
    if block_m is None and encode:
        block_m = encode_block_m(longest, num_qo_heads, num_kv_heads, device, dtype, head_dim)
    elif block_m is None:
        block_m = default_block_m(longest, num_qo_heads, num_kv_heads, device,
                                  total=ptr[-1] - ptr[0] if ptr else 0, dtype=dtype, head_dim=head_dim)
    seq, q0 = query_tiles(ptr, block_m)
    mk = lambda x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
    return PrefillPlan(mk(seq), mk(q0), block_m,
                       plan_split_target(longest, num_qo_heads, num_kv_heads), encode)


def query_tiles(ptr: list[int], block_m: int) -> tuple[list[int], list[int]]:
    """(sequence, first query row) of every tile of block_m query tokens, sequence by sequence,
    for the host list qo_indptr ``ptr``."""
    seq, q0 = [], []
    for b in range(len(ptr) - 1):
        starts = range(ptr[b], ptr[b + 1], block_m)
        seq += [b] * len(starts)
        q0 += starts
    return seq, q0


def lazy_prefill(q: torch.Tensor, qo_indptr: torch.Tensor, q_pos: torch.Tensor,
                 k_pages: torch.Tensor, v_pages: torch.Tensor, table: PageTable,
                 inv_freq: torch.Tensor, *, rope_mode: str = DEFAULT_ROPE_MODE,
                 attention_scaling: float = 1.0, sm_scale: float | None = None,
                 plan: PrefillPlan | None = None, num_splits: int | None = None,
                 out: torch.Tensor | None = None, return_lse: bool = False,
                 k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                 softcap: float | None = None, window: int | None = None,
                 **tuning) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Prefill / append attention.

    q          [Tq, H, D]  new tokens of all sequences, packed (unrotated unless
                           rope_mode="none")
    qo_indptr  [B+1] int32 sequence b's queries are rows qo_indptr[b] .. qo_indptr[b+1]-1
    q_pos      [Tq] int32  logical position of every new token
    k_pages, v_pages, table, inv_freq, rope_mode, attention_scaling, sm_scale, num_splits,
    tuning, return_lse, k_scale, v_scale (fp8 pages), softcap, window: as lazy_decode
    plan       from plan_prefill (built here, with a host sync, if None)
    Returns    [Tq, H, D] in q.dtype (written into `out` if given); with return_lse=True,
               (out, lse): lse [Tq, H] fp32, each row's natural-log log-sum-exp of its visible
               scores sm_scale * q.k, -inf for a row that sees no key (as lazy_decode).
    """
    if not use_triton(q):
        res = paged_attention_ref(q, qo_indptr, q_pos, k_pages, v_pages, table, inv_freq,
                                  rope_mode, attention_scaling, sm_scale, return_lse=return_lse,
                                  k_scale=k_scale, v_scale=v_scale, softcap=softcap, window=window)
        return copy_into(out, res)
    if plan is None:
        plan = plan_prefill(qo_indptr.cpu(), q.shape[1], k_pages.shape[1], q.device,
                            dtype=q.dtype, head_dim=q.shape[2])
    if plan.full_batch:      # an encode batch runs the kernel a full build batch compiled
        num_splits = 1 if num_splits is None else num_splits
        tuning.setdefault("full_batch", True)
    tuning.setdefault("split_target", plan.split_target)
    return prefill_runs.launch_runs(
        q, qo_indptr, q_pos, k_pages, v_pages, table, inv_freq, rope_mode=rope_mode,
        attention_scaling=attention_scaling, sm_scale=sm_scale, tile_seq=plan.tile_seq,
        tile_q0=plan.tile_q0, block_m=plan.block_m, max_tiles_hint=table.max_pages,
        num_splits=num_splits, out=out, return_lse=return_lse, k_scale=k_scale, v_scale=v_scale,
        softcap=softcap, window=window, **tuning)

