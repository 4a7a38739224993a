"""int4 chunk KV for storage (``lazy-rag index --kv-dtype int4``): grouped asymmetric 4-bit
quantisation, KIVI style, and its inverse. Torch only: a chunk's int4 KV lives on disk and in the
host tier and is dequantised (``dequantize_kv``) when it is placed in the engine's pool, which
stays 16/32-bit (no attention kernel reads int4 pages yet).

Layout, for k / v of shape [layers, L, kv_heads, D] (keys unrotated):

    k, v               : [layers, L, kv_heads, ceil(D / 2)]        uint8, two codes a byte
                         (channel 2i in the low nibble, 2i + 1 in the high one; an odd D's
                         last byte has a zero high nibble)
    k_scale, k_zero    : [layers, ceil(L / Gk), kv_heads, D]       float16
    v_scale, v_zero    : [layers, L, kv_heads, ceil(D / Gv)]       float16

Keys are quantised per channel in groups of Gk tokens (``KEY_GROUP``) and values per token in
groups of Gv channels (``VALUE_GROUP``): unrotated keys have a few channels of large magnitude
for every token (outlier channels), which a per-token scale would spread over the whole row,
while values have no such channels and are best scaled per token (KIVI, Liu et al. 2024). A
chunk's last key group holds its remaining tokens (L need not be a multiple of Gk); a group's
stats ignore the padding (it repeats the group's last element).

The rule, for a group's elements x (fp32), with c = (max x - min x) (1 - r) / 2 for the r of
``CLIP_RATIOS`` whose x' has the least squared error over the group (r = 1: no clipping):

    zero  = fp16(min x + c)                           (round to nearest; then used as rounded)
    scale = fp16(max((max x - c - zero) / 15, SCALE_MIN))
    code  = clamp(round((x - zero) / scale), 0, 15)
    x'    = code * scale + zero

so |x' - x| <= scale / 2 inside [zero, zero + 15 scale] and the clipped c past it, plus the
rounding of zero and scale to fp16 at the group's ends (<= 2^-11 of |x| and 15 * 2^-11 scale).

Bytes per element (K and V together, per token): 1 byte of codes for the pair plus
4 / Gk (a key group's scale and zero, per token) plus 4 / Gv (a value group's, per channel),
against 4 for bf16: 0.25 + 1/Gk + 1/Gv of bf16's. The group sizes were chosen by
docs/indexing-at-scale.md's measurement on SmolLM2's KV (reconstruction error against bytes):
Gk = 128 tokens, Gv = 64 channels (0.273 of bf16 for full groups; a head_dim below 64 takes
one value group a row). A record stores the group sizes it was written with.
"""
from __future__ import annotations

import torch

KEY_GROUP = 128          # tokens per key group (per channel)
VALUE_GROUP = 64         # channels per value group (per token)
LEVELS = 15              # codes 0..15
SCALE_DTYPE = torch.float16
SCALE_MIN = 2.0 ** -14   # a normal fp16: a constant group gets this scale and code 0
_F16_MAX = 65504.0
# each group's range is searched for the least squared error over these fractions of its min..max
# (shrunk about its middle; the ends clipped): a clipped outlier costs less than a coarser step
# for all the group's other elements
CLIP_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8)


def _groups(x: torch.Tensor, dim: int, group: int, fill: float | None = None) -> torch.Tensor:
    """x with ``dim`` split into (groups, group), the last group padded by repeating x's last
    element along ``dim`` (so that a group's min and max are its real elements'), or ``fill``."""
    n = x.shape[dim]
    pad = -n % group
    if pad:
        last = x.narrow(dim, n - 1, 1)
        if fill is not None:
            last = torch.full_like(last, fill)
        x = torch.cat([x, last.expand(*[pad if d == dim % x.dim() else s for d, s in enumerate(last.shape)])], dim)
    shape = list(x.shape)
    d = dim % x.dim()
    return x.reshape(*shape[:d], shape[d] // group, group, *shape[d + 1:])


def _expand(stat: torch.Tensor, dim: int, group: int, n: int) -> torch.Tensor:
    """A per-group stat broadcast back over its group's elements along ``dim`` (n of them)."""
    return stat.repeat_interleave(group, dim=dim).narrow(dim, 0, n)


def quantize(x: torch.Tensor, dim: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [..., D] (any float dtype, ``dim`` any axis) -> (codes [..., ceil(D/2)] uint8, scale,
    zero), with one fp16 scale and zero per ``group`` elements along ``dim`` (the module's rule;
    the stats have ``dim`` of size ceil(n / group))."""
    if x.numel() == 0 or x.shape[dim] == 0:
        raise ValueError("int4 quantisation of an empty tensor")
    xf = x.float()
    n = xf.shape[dim]
    g = _groups(xf, dim, group)
    gd = (dim % xf.dim()) + 1          # the axis of a group's elements
    lo, hi = g.amin(gd), g.amax(gd)
    best = None
    if len(CLIP_RATIOS) > 1:   # a short last group's padding counts for nothing in its error
        shape = [1] * xf.dim()
        shape[dim % xf.dim()] = n
        real = _groups(torch.ones(shape, device=xf.device), dim, group, fill=0.0)
    for r in CLIP_RATIOS:
        c = (hi - lo) * (1 - r) / 2
        zero = (lo + c).clamp(-_F16_MAX, _F16_MAX).to(SCALE_DTYPE)
        scale = ((hi - c - zero.float()) / LEVELS).clamp(SCALE_MIN, _F16_MAX).to(SCALE_DTYPE)
        if len(CLIP_RATIOS) > 1:
            zf, sf = zero.float().unsqueeze(gd), scale.float().unsqueeze(gd)
            err = ((((g - zf) / sf).round().clamp(0, LEVELS) * sf + zf - g).square() * real).sum(gd)
            if best is None:
                best = (err, zero, scale)
            else:
                better = err < best[0]
                best = (torch.where(better, err, best[0]), torch.where(better, zero, best[1]),
                        torch.where(better, scale, best[2]))
    if best is not None:
        zero, scale = best[1], best[2]
    s, z = _expand(scale.float(), dim, group, n), _expand(zero.float(), dim, group, n)
    codes = ((xf - z) / s).round().clamp(0, LEVELS).to(torch.uint8)
    return pack_nibbles(codes), scale, zero


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dim: int, group: int,
               head_dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """codes [..., ceil(D/2)] with their scale and zero (``quantize``'s) -> x' [..., D] in ``dtype``."""
    q = unpack_nibbles(codes, head_dim).float()
    n = q.shape[dim]
    s, z = _expand(scale.float(), dim, group, n), _expand(zero.float(), dim, group, n)
    return (q * s + z).to(dtype)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 [..., D] -> [..., ceil(D/2)] bytes: element 2i low nibble, 2i+1 high."""
    if codes.shape[-1] % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``pack_nibbles``' inverse: [..., ceil(D/2)] bytes -> [..., D] uint8 codes."""
    if packed.shape[-1] != (head_dim + 1) // 2:
        raise ValueError(f"int4 codes of {packed.shape[-1]} bytes a row do not hold head_dim {head_dim}")
    out = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)
    return out[..., :head_dim]


def quantize_kv(k: torch.Tensor, v: torch.Tensor, key_group: int = KEY_GROUP,
                value_group: int = VALUE_GROUP) -> dict[str, torch.Tensor]:
    """A chunk's k, v [layers, L, kv_heads, D] -> its int4 tensors by ChunkKV's names: keys per
    channel in groups of ``key_group`` tokens, values per token in groups of ``value_group``
    channels (the module's layout)."""
    if k.shape != v.shape:
        raise ValueError(f"int4 KV needs k and v of one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    kc, ks, kz = quantize(k, 1, key_group)
    vc, vs, vz = quantize(v, -1, value_group)
    return {"k": kc, "v": vc, "k_scale": ks, "v_scale": vs, "k_zero": kz, "v_zero": vz}


def dequantize_kv(t: dict[str, torch.Tensor], groups: tuple[int, int],
                  dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_kv``'s tensors (and its (key_group, value_group)) -> (k, v) in ``dtype``."""
    head_dim = t["k_scale"].shape[-1]      # keys have a scale per channel
    k = dequantize(t["k"], t["k_scale"], t["k_zero"], 1, groups[0], head_dim, dtype)
    v = dequantize(t["v"], t["v_scale"], t["v_zero"], -1, groups[1], head_dim, dtype)
    return k, v


def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, key_group: int = KEY_GROUP,
                    value_group: int = VALUE_GROUP) -> float:
    """Stored bytes of one token's int4 K and V over every layer and KV head, scales and zeros
    included, for chunks of whole key groups (a chunk's last, partial key group costs its scales
    over fewer tokens)."""
    per_head = (2 * ((head_dim + 1) // 2)                               # k and v codes
                + 4 * head_dim / key_group                              # k scale + zero, per channel
                + 4 * -(-head_dim // value_group))                      # v scale + zero, per group
    return num_layers * num_kv_heads * per_head
