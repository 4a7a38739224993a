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
squares (one more all-reduce each). A mixture-of-experts block (mixtral, qwen2_moe, qwen3_moe,
olmoe, the granite MoE families) splits every expert's intermediate width the same way (each rank
holds a slice of every expert, so the router, whole on every rank, picks the same experts
everywhere and no token moves between ranks), and a shared expert's too: the block's output is a
partial sum on each rank, all-reduced once after the block (``ReducedOutput``); granitemoeshared's
shared MLP beside the block is row-parallel like a dense MLP.

The ranks' collectives: ``rank_group.RankGroup``. ``layer_shares`` names each rank's share of a
layer's tensors; a rank gets it either by loading only that (``shard_loading``, the way for a
model larger than one device) or by slicing it from a whole model given in memory
(``shard_layer``); ``with_collectives`` then adds the all-reduces.

The pool of a rank holds its KV heads of every chunk; the chunk store on disk is unchanged and
holds all of them. ``HeadShard`` slices a record's heads as a rank reads it and gathers the ranks'
heads of KV a rank encoded before it is written, so an index built at one TP size serves at any
other (or without TP).

A fp32 model's logits differ from the single process's only by summation order (the partial
o_proj and down_proj sums are added after the ranks' own dot products).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from ..architecture import FAMILIES, ModelParts, moe_block
from ..chunk_kv import ChunkKV
from ..errors import LazyRagError
from .rank_group import RankGroup, part


def split_counts(config, layers) -> dict[str, int]:
    """What tensor parallelism splits evenly over the ranks, read from the config and the whole
    decoder ``layers`` (real or on the meta device; a MoE model may mix dense and expert layers)."""
    counts = {"attention heads": config.num_attention_heads, "KV heads": config.num_key_value_heads}
    for i, layer in enumerate(layers):
        for what, width in _mlp_widths(config, layer).items():
            counts.setdefault(what, width)
            if counts[what] != width:   # (the first layer's width is named; any other must divide too)
                counts[f"{what} (layer {i})"] = width
    return counts


def check_split(config, layers, size: int) -> None:
    """Refuse a model whose heads or MLP widths do not split evenly over ``size`` ranks, naming
    the sizes that do. ``layers``: its decoder layers, whole."""
    counts = split_counts(config, layers)
    bad = {k: v for k, v in counts.items() if v % size}
    if bad:
        fits = [n for n in range(1, config.num_key_value_heads + 1) if all(v % n == 0 for v in counts.values())]
        raise LazyRagError(
            f"tensor_parallel={size} must divide the model's {', '.join(f'{k} ({v})' for k, v in counts.items())}; "
            f"{', '.join(bad)} do not split evenly. Use tensor_parallel in {fits}.")


def check_shardable(parts: ModelParts, size: int) -> None:
    """``check_split`` of a loaded model; a model loaded as one rank's share
    (``shard_loading``) was checked as it was loaded, and must have been loaded for ``size`` ranks."""
    share = getattr(parts.model, "rank_share", None)
    if share is None:
        check_split(parts.config, parts.layers, size)
    elif share.size != size:
        raise LazyRagError(f"This model was loaded as one rank's share for tensor_parallel={share.size}; it cannot "
                           f"serve tensor_parallel={size}. Load it again with tensor_parallel={size}.")


def _mlp_width(mlp) -> int:
    if hasattr(mlp, "gate_up_proj"):
        return mlp.gate_up_proj.weight.shape[0] // 2
    return mlp.gate_proj.weight.shape[0]


def _expert_block(config, layer: nn.Module) -> tuple[str, nn.Module] | None:
    """(name in the layer, module) of a layer's mixture-of-experts block; None for a dense MLP
    (every layer of a dense family, a MoE model's dense layers)."""
    if not FAMILIES[config.model_type].moe:
        return None
    block = moe_block(layer)
    if not hasattr(block, "experts"):
        return None
    return ("block_sparse_moe" if block is not getattr(layer, "mlp", None) else "mlp"), block


def _mlp_widths(config, layer: nn.Module) -> dict[str, int]:
    """The intermediate widths a layer's share splits: a dense MLP's, or every expert's (the
    experts' fused gate/up rows are [experts, 2 x width, hidden]) and a shared expert's."""
    found = _expert_block(config, layer)
    if found is None:
        return {"MLP width": _mlp_width(layer.mlp)}
    _, block = found
    widths = {"expert MLP width": block.experts.gate_up_proj.shape[1] // 2}
    if getattr(block, "shared_expert", None) is not None:   # qwen2_moe
        widths["shared expert width"] = _mlp_width(block.shared_expert)
    if getattr(layer, "shared_mlp", None) is not None:   # granitemoeshared: input_linear is gate and up stacked
        widths["shared MLP width"] = layer.shared_mlp.input_linear.weight.shape[0] // 2
    return widths


@dataclass(frozen=True)
class Share:
    """A rank's part of one tensor: the ``slices`` of axis ``dim`` it keeps, in this order
    (several for a fused projection: phi3's q, k and v rows)."""
    dim: int
    slices: tuple[slice, ...]

    def of(self, t: torch.Tensor) -> torch.Tensor:
        """This share of the whole tensor ``t``, a new contiguous tensor."""
        return torch.cat([t.narrow(self.dim, s.start, s.stop - s.start) for s in self.slices], self.dim).contiguous()


def layer_shares(config, layer: nn.Module, rank: int, size: int) -> dict[str, Share]:
    """Megatron's split of one decoder layer: rank ``rank``'s share of every tensor it splits,
    by name inside the layer (a bias listed here that the layer lacks is skipped); the layer's
    other tensors are whole on every rank. ``layer``: whole (real or on the meta device); the
    loader (``shard_loading``) reads these shares from a checkpoint, ``shard_layer`` slices them
    from a loaded model."""
    fam = FAMILIES[config.model_type]
    H, KV, D = config.num_attention_heads, config.num_key_value_heads, layer.self_attn.head_dim
    qh, kvh = part(H, rank, size), part(KV, rank, size)
    q, kv = slice(qh.start * D, qh.stop * D), slice(kvh.start * D, kvh.stop * D)
    rows = lambda *s: Share(0, s)   # noqa: E731  (column-parallel: output rows, and their bias)
    out: dict[str, Share] = {}
    if fam.qkv == "fused":   # phi3: q, k, v stacked in that order
        qkv = rows(q, _offset(kv, H * D), _offset(kv, (H + KV) * D))
        out.update({"self_attn.qkv_proj.weight": qkv, "self_attn.qkv_proj.bias": qkv})
    else:
        for name, s in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            out.update({f"self_attn.{name}.weight": rows(s), f"self_attn.{name}.bias": rows(s)})
    if fam.qk_norm == "whole":   # olmo2: normed over every head's columns at once, each rank its heads'
        out.update({"self_attn.q_norm.weight": rows(q), "self_attn.k_norm.weight": rows(kv)})
    out["self_attn.o_proj.weight"] = Share(1, (q,))   # row-parallel: input columns (its bias stays whole)
    widths = _mlp_widths(config, layer)
    found = _expert_block(config, layer)
    if found is None:
        out.update(_dense_mlp_shares("mlp", layer.mlp, widths["MLP width"], rank, size))
        return out
    name, block = found
    width = widths["expert MLP width"]
    inter = part(width, rank, size)   # of every expert: gate rows, then up rows; down's input columns
    out[f"{name}.experts.gate_up_proj"] = Share(1, (inter, _offset(inter, width)))
    out[f"{name}.experts.down_proj"] = Share(2, (inter,))
    if "shared expert width" in widths:   # its gate (shared_expert_gate) stays whole
        out.update(_dense_mlp_shares(f"{name}.shared_expert", block.shared_expert, widths["shared expert width"],
                                     rank, size))
    if "shared MLP width" in widths:
        shared, s = widths["shared MLP width"], part(widths["shared MLP width"], rank, size)
        out["shared_mlp.input_linear.weight"] = rows(s, _offset(s, shared))
        out["shared_mlp.output_linear.weight"] = Share(1, (s,))
    return out


def _dense_mlp_shares(prefix: str, mlp: nn.Module, width: int, rank: int, size: int) -> dict[str, Share]:
    inter = part(width, rank, size)
    if hasattr(mlp, "gate_up_proj"):   # phi3: gate and up stacked
        out = {f"{prefix}.gate_up_proj.weight": Share(0, (inter, _offset(inter, width)))}
    else:
        out = {f"{prefix}.gate_proj.weight": Share(0, (inter,)), f"{prefix}.up_proj.weight": Share(0, (inter,))}
    out[f"{prefix}.down_proj.weight"] = Share(1, (inter,))
    return out


class RowParallelLinear(nn.Module):
    """A linear layer split by input columns: each rank's partial product, summed over the
    ranks, then the bias once. ``linear`` holds the rank's columns already."""

    def __init__(self, linear: nn.Linear, group: RankGroup):
        super().__init__()
        self.weight, self.bias, self.group = linear.weight, linear.bias, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.group.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class ReducedOutput(nn.Module):
    """A mixture-of-experts block holding a rank's slice of every expert: its output (first of a
    tuple, as transformers 4's blocks return) summed over the ranks. Attribute reads fall through
    to the block (its ``experts``, ``gate``), so code that inspects the block finds it."""

    def __init__(self, block: nn.Module, group: RankGroup):
        super().__init__()
        self.block, self.group = block, group

    def forward(self, *args, **kwargs):
        out = self.block(*args, **kwargs)
        if isinstance(out, tuple):
            return (self.group.all_reduce(out[0]), *out[1:])
        return self.group.all_reduce(out)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("block"), name)


class ShardedRMSNorm(nn.Module):
    """OLMo 2's RMSNorm over all heads at once (``Olmo2RMSNorm``: fp32 mean of squares, weight
    multiplied before rounding) on a rank's slice of the heads: the sum of squares is all-reduced,
    so the mean is over the whole ``width``. ``norm`` holds the rank's slice of the weight already."""

    def __init__(self, norm: nn.Module, width: int, group: RankGroup):
        super().__init__()
        self.weight = norm.weight
        self.eps, self.width, self.group = norm.variance_epsilon, width, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype, xf = x.dtype, x.float()
        variance = self.group.all_reduce(xf.pow(2).sum(-1, keepdim=True)) / self.width
        return (self.weight * (xf * torch.rsqrt(variance + self.eps))).to(dtype)


def _offset(s: slice, by: int) -> slice:
    return slice(s.start + by, s.stop + by)


def _copy_layer(layer: nn.Module) -> nn.Module:
    """A copy of a decoder layer's modules that shares its tensors (none is copied)."""
    shared = {id(t): t for t in [*layer.parameters(), *layer.buffers()]}
    return copy.deepcopy(layer, memo=shared)


def fit_linear_sizes(module: nn.Module) -> None:
    """Make every ``nn.Linear``'s recorded sizes those of the weight it holds (a share's)."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            m.out_features, m.in_features = m.weight.shape


def shard_layer(layer: nn.Module, config, group: RankGroup) -> nn.Module:
    """A copy of one whole decoder layer holding this rank's share, with its collectives (the
    tensors that stay whole are the checkpoint's own, not copies)."""
    mine = _copy_layer(layer)
    for name, share in layer_shares(config, layer, group.rank, group.size).items():
        owner, _, attr = name.rpartition(".")
        module = mine.get_submodule(owner)
        whole = getattr(module, attr, None)
        if whole is not None:
            setattr(module, attr, nn.Parameter(share.of(whole.detach()), requires_grad=False))
    fit_linear_sizes(mine)
    return with_collectives(mine, config, group)


def with_collectives(layer: nn.Module, config, group: RankGroup) -> nn.Module:
    """Make a layer that holds a rank's share (``layer_shares``) compute its part of the whole
    layer: o_proj and down_proj sum their partial products over the ranks, OLMo 2's q/k norms
    their sums of squares. In place."""
    attn = layer.self_attn
    attn.o_proj = RowParallelLinear(attn.o_proj, group)
    found = _expert_block(config, layer)
    if found is None:
        layer.mlp.down_proj = RowParallelLinear(layer.mlp.down_proj, group)
    else:   # routed and shared experts' partial outputs, summed once
        name, block = found
        setattr(layer, name, ReducedOutput(block, group))
        if getattr(layer, "shared_mlp", None) is not None:
            layer.shared_mlp.output_linear = RowParallelLinear(layer.shared_mlp.output_linear, group)
    if FAMILIES[config.model_type].qk_norm == "whole":
        D = attn.head_dim
        attn.q_norm = ShardedRMSNorm(attn.q_norm, config.num_attention_heads * D, group)
        attn.k_norm = ShardedRMSNorm(attn.k_norm, config.num_key_value_heads * D, group)
    return layer


class ShardedParts(ModelParts):
    """``ModelParts`` of one rank: the same embeddings, norms, LM head and RoPE (the host's,
    shared, not copied), its share of every layer, and a shape whose head counts are the rank's.
    The host's model is either whole (each layer's share is sliced from it here) or already this
    rank's share (loaded so, ``shard_loading``: its layers are only given their collectives).
    Chunk wrapper rows are read from the host's parts, where its ``WrapperTable`` registers them."""

    def __init__(self, full: ModelParts, group: RankGroup):   # (ModelParts.__init__ reads the whole model)
        check_shardable(full, group.size)
        self.__dict__.update({k: v for k, v in full.__dict__.items() if k != "virtual_rows"})
        self.full, self.group = full, group
        share = getattr(full.model, "rank_share", None)
        if share is None:
            self.layers = [shard_layer(layer, full.config, group) for layer in full.layers]
        elif share.rank != group.rank:
            raise LazyRagError(f"Rank {group.rank} was given rank {share.rank}'s share of the model.")
        else:   # (a copy: the host's model keeps its layers as loaded, without collectives)
            self.layers = [with_collectives(_copy_layer(layer), full.config, group) for layer in full.layers]
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
        return kv.with_tensors({k: self._gathered(t) for k, t in kv.tensors().items()})

    def _gathered(self, t: torch.Tensor) -> torch.Tensor:
        # as bytes: neither gloo nor NCCL takes float8 (the heads axis is not the last, which the view rescales)
        b = t.contiguous().view(torch.uint8)
        # a host copy on a GPU rank travels over NCCL, not gloo: gloo pushes a chunk's KV through
        # the loopback at a few GB/s (a 70B serving warm-up of 100 documents took 228 s)
        via_gpu = self.group.nccl is not None and not b.is_cuda
        out = torch.cat(self.group.all_gather(b.to(self.group.device) if via_gpu else b), dim=2)
        return (out.cpu() if via_gpu else out).view(t.dtype)
