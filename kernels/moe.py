"""moe_experts: a mixture-of-experts layer's routed experts (SiLU-gated MLPs) for decode-sized batches.

Why a kernel of our own: at a decode step a layer's few hundred token-expert pairs touch most of
its experts with a handful of rows each, so the step's cost is reading every hit expert's weights
once; the time goes to bandwidth, not to FLOPs. Each program here owns one expert and one tile of
output columns and walks all of that expert's rows in blocks of ``BLOCK_M``: a weight tile is read
from DRAM once per step however many rows use it (later row blocks find it in L2), and an expert
that no pair picked costs a program that exits at once.

Contract (transformers' concatenated, untransposed experts: ``Qwen3MoeExperts`` and its kin):

    hidden     [T, H]              the layer's tokens (fp32, fp16 or bf16)
    gate_up    [E, 2I, H]          rows 0..I-1 the gate, I..2I-1 the up projection
                                   (``_default_apply_gate``: gate, up = chunk(2))
    down       [E, H, I]
    top_k_index [T, K] int         each token's experts, top_k_weights [T, K] their mixing weights
    returns    [T, H] in hidden's dtype: sum_k w[t,k] * down[e] @ (silu(g) * u),
               g, u = split(gate_up[e] @ hidden[t]), e = top_k_index[t, k]

Three steps, all on the device with fixed-size buffers (no host sync: a CUDA graph captures a
decode step's layers whole):
1. ``sort_pairs_by_expert``: the T*K pairs ordered by expert (a stable sort) with each expert's
   first position and row count. A program walks its own expert's segment and masks the rows past
   its count, so segments need no padding to the block size (vLLM's ``moe_align_block_size``
   pads them because there a program is one block of rows, which must not span two experts).
2. ``_gate_up_silu_kernel``: per (expert, column tile of I) the gate and up GEMMs over the
   expert's rows, fp32 accumulators, ``silu(gate) * up`` in the epilogue, stored in sorted order
   in the hidden dtype (transformers rounds the projection there too).
3. ``_down_kernel``: per (expert, column tile of H) the down GEMM, times the pair's routing
   weight, stored in fp32 to the pair's own row of a [T*K, H] buffer; a sum over k then gives each
   token's output. Every element has one writer, so the result is deterministic (atomic adds
   into [T, H] would not be), and the sum's order is that of transformers' ``grouped_mm`` path.

Tiles: each kernel's launch configuration (output columns per program, the reduction's step,
warps, pipeline stages) is a ``MoeTiles``, whose defaults are the one place they are set;
``moe_experts`` takes another as ``tiles=``, and benchmarks/moe_tiles.py sweeps them on a GPU.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .page_table import interpreting, use_triton
from .reference import moe_experts_ref
from .triton_import import tl, triton

# rows per block: the fewest tl.dot takes; a decode step's experts hold ~2-16 rows each
BLOCK_M = 16


def sort_pairs_by_expert(top_k_index: torch.Tensor, num_experts: int):
    """The token-expert pairs (flat index p = token * K + k) grouped by expert, as device tensors:
    pair_order [T*K] int32 (expert e's pairs are pair_order[start[e] : start[e] + count[e]], in
    token order), start [E] int32, count [E] int32. Fixed shapes, no host sync."""
    expert_ids = top_k_index.reshape(-1)
    _, pair_order = torch.sort(expert_ids, stable=True)
    count = torch.zeros(num_experts, dtype=torch.int32, device=expert_ids.device)
    count.scatter_add_(0, expert_ids.long(), torch.ones_like(expert_ids, dtype=torch.int32))
    start = torch.cumsum(count, 0, dtype=torch.int32) - count
    return pair_order.to(torch.int32), start, count


@triton.jit
def _gate_up_silu_kernel(X, W, ACT, PAIR_ORDER, START, COUNT, top_k, H, I, sx_t, sw_e, sw_n, sa_r,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         PRECISION: tl.constexpr):
    e = tl.program_id(0)
    n_tile = tl.program_id(1)
    first = tl.load(START + e)
    rows = tl.load(COUNT + e)            # 0: the loop below does not run
    offs_n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I
    w_gate = W + e.to(tl.int64) * sw_e + offs_n[None, :].to(tl.int64) * sw_n
    w_up = w_gate + I * sw_n
    for m0 in range(0, rows, BLOCK_M):
        m = m0 + tl.arange(0, BLOCK_M)
        row_ok = m < rows
        slot = first + m                 # position in the sorted order
        pair = tl.load(PAIR_ORDER + slot, mask=row_ok, other=0)
        token = (pair // top_k).to(tl.int64)
        acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < H
            x = tl.load(X + token[:, None] * sx_t + offs_k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                        other=0.0)
            w_mask = k_ok[:, None] & n_ok[None, :]
            wg = tl.load(w_gate + offs_k[:, None], mask=w_mask, other=0.0)     # [BLOCK_K, BLOCK_N]
            wu = tl.load(w_up + offs_k[:, None], mask=w_mask, other=0.0)
            acc_gate = tl.dot(x, wg, acc_gate, input_precision=PRECISION)
            acc_up = tl.dot(x, wu, acc_up, input_precision=PRECISION)
        act = acc_gate * tl.sigmoid(acc_gate) * acc_up
        tl.store(ACT + slot[:, None].to(tl.int64) * sa_r + offs_n[None, :], act.to(ACT.dtype.element_ty),
                 mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(ACT, W, OUT, ROUTE_W, PAIR_ORDER, START, COUNT, H, I, sa_r, sw_e, sw_n, so_p,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 PRECISION: tl.constexpr):
    e = tl.program_id(0)
    n_tile = tl.program_id(1)
    first = tl.load(START + e)
    rows = tl.load(COUNT + e)
    offs_n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    w_down = W + e.to(tl.int64) * sw_e + offs_n[None, :].to(tl.int64) * sw_n
    for m0 in range(0, rows, BLOCK_M):
        m = m0 + tl.arange(0, BLOCK_M)
        row_ok = m < rows
        slot = (first + m).to(tl.int64)
        pair = tl.load(PAIR_ORDER + slot, mask=row_ok, other=0)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < I
            a = tl.load(ACT + slot[:, None] * sa_r + offs_k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                        other=0.0)
            w = tl.load(w_down + offs_k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
        route = tl.load(ROUTE_W + pair, mask=row_ok, other=0.0).to(tl.float32)
        tl.store(OUT + pair[:, None].to(tl.int64) * so_p + offs_n[None, :], acc * route[:, None],
                 mask=row_ok[:, None] & n_ok[None, :])


def _block(n: int, most: int) -> int:
    """A power-of-2 tile of at least 16 (tl.dot's least) and at most ``most``, no wider than n needs."""
    return max(16, min(most, triton.next_power_of_2(n)))


def _power_of_2(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0 and v & (v - 1) == 0


@dataclass(frozen=True)
class MoeTiles:
    """The two kernels' launch configurations: ``gate_up_*`` for ``_gate_up_silu_kernel``,
    ``down_*`` for ``_down_kernel``. block_n: output columns per program (of I, of H); block_k:
    the reduction's step (over H, over I); each a power of 2 of at least 16 (tl.dot's least), and
    narrowed at launch to what its dimension needs (``_block``). num_warps: a power of 2 up to
    32; num_stages: software-pipeline stages, None for Triton's default; neither is passed to the
    CPU interpreter, which refuses them. The defaults are the kernels' own."""

    gate_up_block_n: int = 64
    gate_up_block_k: int = 64
    gate_up_num_warps: int = 4
    gate_up_num_stages: int | None = None
    down_block_n: int = 64
    down_block_k: int = 64
    down_num_warps: int = 4
    down_num_stages: int | None = None

    def __post_init__(self):
        for kernel in ("gate_up", "down"):
            for name in (f"{kernel}_block_n", f"{kernel}_block_k"):
                v = getattr(self, name)
                if not _power_of_2(v) or v < 16:
                    raise ValueError(f"MoeTiles.{name} must be a power of 2 of at least 16 "
                                     f"(tl.dot's least), got {v!r}")
            name = f"{kernel}_num_warps"
            v = getattr(self, name)
            if not _power_of_2(v) or v > 32:
                raise ValueError(f"MoeTiles.{name} must be a power of 2 from 1 to 32, got {v!r}")
            name = f"{kernel}_num_stages"
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"MoeTiles.{name} must be None (Triton's default) or an int >= 1, got {v!r}")

    def of(self, kernel: str) -> tuple[int, int, int, int | None]:
        """(block_n, block_k, num_warps, num_stages) of kernel "gate_up" or "down"."""
        if kernel not in ("gate_up", "down"):
            raise ValueError(f"unknown MoE kernel {kernel!r}: 'gate_up' or 'down'")
        return tuple(getattr(self, f"{kernel}_{f}") for f in ("block_n", "block_k", "num_warps", "num_stages"))


DEFAULT_TILES = MoeTiles()


def _launch_options(t: torch.Tensor, tiles: MoeTiles, kernel: str) -> dict:
    """num_warps / num_stages for a CUDA launch; none under the CPU interpreter (it refuses them)."""
    if interpreting() and not t.is_cuda:
        return {}
    _, _, warps, stages = tiles.of(kernel)
    return {"num_warps": warps} if stages is None else {"num_warps": warps, "num_stages": stages}


def _precision(dtype: torch.dtype):
    # fp32 operands: exact products (the oracle tests' tolerance), not the GPU's default tf32;
    # 16-bit operands: Triton's default
    return "ieee" if dtype == torch.float32 else None


def gate_up_silu(hidden: torch.Tensor, gate_up: torch.Tensor, act: torch.Tensor, pair_order: torch.Tensor,
                 start: torch.Tensor, count: torch.Tensor, top_k: int, tiles: MoeTiles = DEFAULT_TILES) -> torch.Tensor:
    """Step 2 alone (moe_experts runs all three; benchmarks/moe_tiles.py times it by itself):
    act [T*K, I] in sorted-pair order, silu(gate) * up, from sort_pairs_by_expert's grouping."""
    E, two_i, H = gate_up.shape
    inter = two_i // 2
    block_n, block_k, _, _ = tiles.of("gate_up")
    bn, bk = _block(inter, block_n), _block(H, block_k)
    _gate_up_silu_kernel[(E, triton.cdiv(inter, bn))](
        hidden, gate_up, act, pair_order, start, count, top_k, H, inter, hidden.stride(0), gate_up.stride(0),
        gate_up.stride(1), act.stride(0), BLOCK_M=BLOCK_M, BLOCK_N=bn, BLOCK_K=bk,
        PRECISION=_precision(hidden.dtype), **_launch_options(hidden, tiles, "gate_up"))
    return act


def down_proj(act: torch.Tensor, down: torch.Tensor, per_pair: torch.Tensor, route: torch.Tensor,
              pair_order: torch.Tensor, start: torch.Tensor, count: torch.Tensor,
              tiles: MoeTiles = DEFAULT_TILES) -> torch.Tensor:
    """Step 3 alone (see gate_up_silu): per_pair [T*K, H] fp32, each pair's routing weight times
    down[e] @ act, in the pair's own row (route: the flat [T*K] routing weights)."""
    E, H, inter = down.shape
    block_n, block_k, _, _ = tiles.of("down")
    bn, bk = _block(H, block_n), _block(inter, block_k)
    _down_kernel[(E, triton.cdiv(H, bn))](
        act, down, per_pair, route, pair_order, start, count, H, inter, act.stride(0), down.stride(0),
        down.stride(1), per_pair.stride(0), BLOCK_M=BLOCK_M, BLOCK_N=bn, BLOCK_K=bk,
        PRECISION=_precision(act.dtype), **_launch_options(act, tiles, "down"))
    return per_pair


def moe_experts(hidden: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor, tiles: MoeTiles | None = None) -> torch.Tensor:
    """The routed experts' output [T, H] (contract in the module docstring). CUDA tensors: the
    Triton kernels (launched with ``tiles``, default ``MoeTiles()``); CPU: the interpreter under
    TRITON_INTERPRET=1, else the torch reference."""
    if tiles is None:
        tiles = DEFAULT_TILES
    elif not isinstance(tiles, MoeTiles):
        raise TypeError(f"tiles must be a MoeTiles, got {type(tiles).__name__}")
    if not use_triton(hidden):
        return moe_experts_ref(hidden, gate_up, down, top_k_index, top_k_weights)
    T, H = hidden.shape
    E, two_i, _ = gate_up.shape
    inter = two_i // 2
    K = top_k_index.shape[-1]
    assert gate_up.shape == (E, 2 * inter, H) and down.shape == (E, H, inter), "concatenated, untransposed experts"
    assert gate_up.stride(-1) == 1 and down.stride(-1) == 1 and hidden.stride(-1) == 1
    pair_order, start, count = sort_pairs_by_expert(top_k_index, E)
    act = torch.empty(T * K, inter, dtype=hidden.dtype, device=hidden.device)
    per_pair = torch.empty(T * K, H, dtype=torch.float32, device=hidden.device)
    gate_up_silu(hidden, gate_up, act, pair_order, start, count, K, tiles)
    down_proj(act, down, per_pair, top_k_weights.reshape(-1), pair_order, start, count, tiles)
    return per_pair.view(T, K, H).sum(dim=1).to(hidden.dtype)
