"""Tensor parallelism, the arithmetic: one rank's share of the model and of every chunk's KV,
and the collectives that make N shares compute what one model computes.

Megatron's split of each decoder layer over ``RankGroup.size`` ranks: the q, k and v
projections by heads (columns of their output), o_proj by the same heads' input columns; the
MLP's gate and up projections by columns of the intermediate width, down_proj by the matching
input columns. Attention needs nothing from the other ranks (a head attends alone, and a rank
holds the KV heads its query heads read), so a layer costs two all-reduces: the sums of the
ranks' partial o_proj and down_proj outputs (``RowParallelLinear``, which adds the bias once,
after the sum). Embeddings, norms and the LM head stay whole on every rank, so every rank holds
the same residual stream and the same logits and makes the same choices (``tp_engine``).
OLMo 2 normalises q and k over all heads at once: its ``ShardedRMSNorm`` all-reduces the sum of
squares (one more all-reduce each). Mixture-of-experts MLPs (mixtral, qwen2_moe, qwen3_moe,
olmoe) are not split: such a model is refused (``check_shardable``).

The pool of a rank holds its KV heads of every chunk; the chunk store on disk is unchanged and
holds all of them. ``HeadShard`` slices a record's heads as a rank reads it and gathers the ranks'
heads of KV a rank encoded before it is written, so an index built at one TP size serves at any
other (or without TP).

A fp32 model's logits differ from the single process's only by summation order (the partial
o_proj and down_proj sums are added after the ranks' own dot products).
"""
from __future__ import annotations

import copy
import datetime
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from ..architecture import ModelParts, num_experts
from ..chunk_kv import ChunkKV
from ..errors import LazyRagError

# seconds a rank waits in one collective for the others before its requests fail (a rank that
# died is found at once, by its closed connection; this bounds a rank that hangs)
COLLECTIVE_TIMEOUT_S = 300.0


class RankFailedError(LazyRagError):
    """A tensor-parallel rank died, hung or left lockstep: the requests it was serving fail."""


class RankGroup:
    """This process's place among ``size`` tensor-parallel ranks and the collectives between them
    (gloo over TCP on the CPU). ``describe_failure()``: what rank 0 knows about its workers when
    a collective fails (which one exited, with which code)."""

    def __init__(self, rank: int, size: int, store, timeout_s: float = COLLECTIVE_TIMEOUT_S,
                 describe_failure=None):
        import torch.distributed as dist

        self.rank, self.size = rank, size
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.describe_failure = describe_failure or (lambda: "")
        self.broken: RankFailedError | None = None
        # a process group of its own, outside torch.distributed's default group: the user's
        # process may run its own torch.distributed, and several groups may coexist
        self.pg = dist.ProcessGroupGloo(store, rank, size, self.timeout)

    def _wait(self, work, what: str) -> None:
        if self.broken is not None:
            raise self.broken
        try:
            work.wait(self.timeout)
        except RuntimeError as e:
            why = self.describe_failure() or f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            self.broken = RankFailedError(
                f"Tensor-parallel rank {self.rank} of {self.size} lost the other ranks during {what}: {why}. "
                "Requests in flight fail; create the LazyLLM (or restart the server) again.")
            raise self.broken from e

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks, in place."""
        self._wait(self.pg.allreduce([t]), "an all-reduce")
        return t

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(t) for _ in range(self.size)]
        self._wait(self.pg.allgather([out], [t.contiguous()]), "an all-gather")
        return out

    def check_lockstep(self, values: list[int], what: str) -> None:
        """Every rank must be about to run the same forward: compare ``values`` (token counts
        and id sums) with the other ranks' and fail, naming the ranks, if they differ. A rank
        out of lockstep would otherwise all-reduce tensors of other shapes, or hang."""
        mine = torch.tensor(values, dtype=torch.int64)
        ranks = self.all_gather(mine)
        if any(not torch.equal(r, ranks[0]) for r in ranks):
            got = "; ".join(f"rank {i}: {r.tolist()}" for i, r in enumerate(ranks))
            self.broken = RankFailedError(f"Tensor-parallel ranks left lockstep before {what} ({got}).")
            raise self.broken

    def share(self, n: int) -> slice:
        """This rank's slice of ``n`` things split evenly (checked by ``check_shardable``)."""
        k = n // self.size
        return slice(self.rank * k, (self.rank + 1) * k)


def check_shardable(parts: ModelParts, size: int) -> None:
    """Refuse a model whose heads or MLP width do not split evenly over ``size`` ranks, naming
    the sizes that do; and a mixture-of-experts model, whose expert blocks are not split."""
    if parts.family.moe:
        raise LazyRagError(
            f"tensor_parallel={size} does not split mixture-of-experts MLPs yet: this {parts.config.model_type} "
            f"model's expert blocks ({num_experts(parts.config)} experts) would need their experts spread over the "
            "ranks, which lazy-rag's sharding does not do. Use tensor_parallel=1.")
    shp = parts.shape
    inter = parts.layers[0].mlp
    width = _mlp_width(inter)
    counts = {"attention heads": shp.num_heads, "KV heads": shp.num_kv_heads, "MLP width": width}
    bad = {k: v for k, v in counts.items() if v % size}
    if bad:
        fits = [n for n in range(1, shp.num_kv_heads + 1) if all(v % n == 0 for v in counts.values())]
        raise LazyRagError(
            f"tensor_parallel={size} must divide the model's {', '.join(f'{k} ({v})' for k, v in counts.items())}; "
            f"{', '.join(bad)} do not split evenly. Use tensor_parallel in {fits}.")


def _mlp_width(mlp) -> int:
    if hasattr(mlp, "gate_up_proj"):
        return mlp.gate_up_proj.weight.shape[0] // 2
    return mlp.gate_proj.weight.shape[0]


class RowParallelLinear(nn.Module):
    """A linear layer split by input columns: each rank's partial product, summed over the
    ranks, then the bias once."""

    def __init__(self, linear: nn.Linear, columns: slice, group: RankGroup):
        super().__init__()
        self.weight = nn.Parameter(linear.weight.detach()[:, columns].contiguous(), requires_grad=False)
        self.bias = linear.bias
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.group.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class ShardedRMSNorm(nn.Module):
    """OLMo 2's RMSNorm over all heads at once (``Olmo2RMSNorm``: fp32 mean of squares, weight
    multiplied before rounding) on a rank's slice of the heads: the sum of squares is all-reduced,
    so the mean is over the whole width."""

    def __init__(self, norm: nn.Module, columns: slice, width: int, group: RankGroup):
        super().__init__()
        self.weight = nn.Parameter(norm.weight.detach()[columns].contiguous(), requires_grad=False)
        self.eps, self.width, self.group = norm.variance_epsilon, width, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype, xf = x.dtype, x.float()
        variance = self.group.all_reduce(xf.pow(2).sum(-1, keepdim=True)) / self.width
        return (self.weight * (xf * torch.rsqrt(variance + self.eps))).to(dtype)


def _keep_rows(linear: nn.Linear, rows: list[slice]) -> None:
    """Keep only ``rows`` of the layer's output (and bias): a column-parallel share."""
    w = linear.weight.detach()
    linear.weight = nn.Parameter(torch.cat([w[r] for r in rows]).contiguous(), requires_grad=False)
    if linear.bias is not None:
        b = linear.bias.detach()
        linear.bias = nn.Parameter(torch.cat([b[r] for r in rows]).contiguous(), requires_grad=False)
    linear.out_features = linear.weight.shape[0]


def _offset(s: slice, by: int) -> slice:
    return slice(s.start + by, s.stop + by)


def shard_layer(layer: nn.Module, parts: ModelParts, group: RankGroup) -> nn.Module:
    """A copy of one decoder layer holding this rank's share (its parameters that stay whole are
    the checkpoint's own tensors, not copies)."""
    shared = {id(t): t for t in [*layer.parameters(), *layer.buffers()]}
    mine = copy.deepcopy(layer, memo=shared)
    shp, attn, mlp = parts.shape, mine.self_attn, mine.mlp
    D = shp.head_dim
    q = slice(group.share(shp.num_heads).start * D, group.share(shp.num_heads).stop * D)
    kv = slice(group.share(shp.num_kv_heads).start * D, group.share(shp.num_kv_heads).stop * D)
    if parts.family.qkv == "fused":   # phi3: q, k, v stacked in that order
        qw, kw = shp.num_heads * D, shp.num_kv_heads * D
        _keep_rows(attn.qkv_proj, [q, _offset(kv, qw), _offset(kv, qw + kw)])
    else:
        _keep_rows(attn.q_proj, [q])
        _keep_rows(attn.k_proj, [kv])
        _keep_rows(attn.v_proj, [kv])
    if parts.family.qk_norm == "whole":   # olmo2: normed over every head's columns at once
        attn.q_norm = ShardedRMSNorm(attn.q_norm, q, shp.num_heads * D, group)
        attn.k_norm = ShardedRMSNorm(attn.k_norm, kv, shp.num_kv_heads * D, group)
    attn.o_proj = RowParallelLinear(attn.o_proj, q, group)
    inter = group.share(_mlp_width(mlp))
    if hasattr(mlp, "gate_up_proj"):   # phi3: gate and up stacked
        _keep_rows(mlp.gate_up_proj, [inter, _offset(inter, _mlp_width(mlp))])
    else:
        _keep_rows(mlp.gate_proj, [inter])
        _keep_rows(mlp.up_proj, [inter])
    mlp.down_proj = RowParallelLinear(mlp.down_proj, inter, group)
    return mine


class ShardedParts(ModelParts):
    """``ModelParts`` of one rank: the same embeddings, norms, LM head and RoPE (the whole
    model's, shared, not copied), its share of every layer, and a shape whose head counts are
    the rank's. Chunk wrapper rows are read from the whole model's parts, where the host's
    ``WrapperTable`` registers them."""

    def __init__(self, full: ModelParts, group: RankGroup):   # (ModelParts.__init__ reads the whole model)
        check_shardable(full, group.size)
        self.__dict__.update({k: v for k, v in full.__dict__.items() if k != "virtual_rows"})
        self.full, self.group = full, group
        self.layers = [shard_layer(layer, full, group) for layer in full.layers]
        self.shape = replace(full.shape, num_heads=full.shape.num_heads // group.size,
                             num_kv_heads=full.shape.num_kv_heads // group.size)

    @property
    def virtual_rows(self):
        return self.full.virtual_rows


class HeadShard:
    """A rank's KV heads of chunk KV: ``mine`` slices a stored record (all heads) to this rank's,
    ``whole`` gathers every rank's heads of KV this rank holds (a collective: every rank calls it
    at the same point). Every ``ChunkKV`` tensor (fp8 scales and int4 codes, scales and zeros
    included) has the KV heads on axis 2. ``writes``: only rank 0 writes records."""

    def __init__(self, group: RankGroup, num_kv_heads: int):
        self.group, self.heads = group, group.share(num_kv_heads)
        self.writes = group.rank == 0

    def mine(self, kv: ChunkKV) -> ChunkKV:
        return kv.with_tensors({k: t[:, :, self.heads].contiguous() for k, t in kv.tensors().items()})

    def whole(self, kv: ChunkKV) -> ChunkKV:
        # gathered as bytes: gloo takes no float8 (the heads axis is not the last, which the view rescales)
        return kv.with_tensors({k: torch.cat(self.group.all_gather(t.contiguous().view(torch.uint8)), dim=2).view(t.dtype)
                                for k, t in kv.tensors().items()})
