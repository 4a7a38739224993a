"""RoPE, the one module of it: the model's table (``RopeTable``), the torch helpers the runtime
and the kernels' references use, and the Triton-side cos/sin.

Convention (transformers' LlamaRotaryEmbedding, non-interleaved "rotate_half"):

    angle[p, i] = float32(p) * inv_freq[i]                  (fp32 product, exactly as transformers)
    cos, sin    = cos(angle), sin(angle) repeated over both halves, times attention_scaling
    x'          = x * cos + rotate_half(x) * sin,  rotate_half(x) = cat(-x[D/2:], x[:D/2])

Written on halves x = (x1, x2):  x1' = x1*c - x2*s,  x2' = x2*c + x1*s.

`inv_freq` ([head_dim // 2] fp32) and `attention_scaling` come from the model's rope config
(`transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS[rope_type](config, device)`), which
covers default, linear, llama3 and yarn scaling. `dynamic` scaling depends on sequence length and
cannot serve position-free chunks: refuse it upstream.

Rotations by a *difference* of positions (the chunk-local strategy's correction of a key tile,
or a re-rotation of keys already rotated once) are pure rotations: they do not multiply by
attention_scaling again, because R_s(a) R_s(b) != R_s(a + b) when s != 1.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from .triton_import import tl, triton


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_cos_sin(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., n, heads, head_dim] rotated by full-width cos/sin [n, head_dim], in x's dtype,
    exactly as transformers applies RoPE (so the runtime matches an HF forward bit for bit)."""
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]


@dataclass
class RopeTable:
    """A model's RoPE: its inverse frequencies and attention scaling (``architecture.rope_table_of``
    reads them from a checkpoint), at any logical position."""

    inv_freq: torch.Tensor  # [head_dim // 2], fp32
    attention_scaling: float
    rope_type: str

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        """Full-width cos/sin [n, head_dim] for int positions [n], cast to ``dtype`` as HF does."""
        inv = self.inv_freq.to(positions.device)
        freqs = positions.to(torch.float32)[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate x [..., n, heads, head_dim] by its positions [n]."""
        return apply_cos_sin(x, *self.cos_sin(positions, x.dtype))

    def fingerprint(self) -> str:
        h = hashlib.sha256()
        h.update(self.rope_type.encode())
        h.update(repr(self.attention_scaling).encode())
        h.update(self.inv_freq.cpu().numpy().tobytes())
        return h.hexdigest()[:16]


@dataclass(frozen=True, eq=False)
class LayerRopes:
    """Each layer's own RoPE table, for a model whose layers do not all share one (Gemma 3's
    sliding and global layers): layer i rotates by ``tables[of_layer[i]]``. ``inv_freq`` and
    ``rotate`` are RopeTable's over a leading layer axis, so what rotates a chunk's keys in every
    layer at once (placing it in the pool, Block-Attention's copy) takes either."""

    tables: tuple[RopeTable, ...]
    of_layer: tuple[int, ...]

    @property
    def inv_freq(self) -> torch.Tensor:
        """Each layer's inverse frequencies, [layers, head_dim // 2] fp32."""
        return torch.stack([t.inv_freq for t in self.tables])[list(self.of_layer)]

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate x [layers, n, heads, head_dim] by its positions [n], each layer by its own table."""
        out = torch.empty_like(x)
        for j, table in enumerate(self.tables):
            layers = torch.tensor([i for i, t in enumerate(self.of_layer) if t == j], device=x.device)
            out[layers] = table.rotate(x[layers], positions)
        return out


def rope_cos_sin(pos: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float = 1.0):
    """cos, sin of shape [*pos.shape, D/2] in fp32 (the half table; both halves use it)."""
    ang = pos.to(torch.float32)[..., None] * inv_freq.to(device=pos.device, dtype=torch.float32)
    return torch.cos(ang) * attention_scaling, torch.sin(ang) * attention_scaling


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [..., D] by half tables cos/sin [..., D/2] (broadcast); computed in fp32."""
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def apply_rope(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor,
               attention_scaling: float = 1.0, heads_dim: int | None = -2) -> torch.Tensor:
    """Rotate x [..., H, D] (or [..., D] with heads_dim=None) at integer positions `pos`.

    `pos` has x's shape without the head and feature dims. Returns x's dtype.
    """
    cos, sin = rope_cos_sin(pos, inv_freq, attention_scaling)
    if heads_dim is not None:
        cos, sin = cos.unsqueeze(heads_dim), sin.unsqueeze(heads_dim)
    return rotate(x, cos, sin).to(x.dtype)


# ----------------------------------------------------------------------------------------------
# Triton side
# ----------------------------------------------------------------------------------------------

@triton.jit
def cos_sin(ang, FAST: tl.constexpr):
    """cos, sin of fp32 angles `ang` (any shape), accurate for |ang| up to ~1e7.

    FAST (GPU): reduce to [-pi, pi] with a two-term 2*pi split (the compiler fuses each
    `a - k*C` into one fma, so the reduction is exact to ~1 ulp of pi), then the SFU's
    cos.approx/sin.approx (abs error ~1e-6 on [-pi, pi]). libdevice's precise cosf costs ~30
    instructions per element and a Payne-Hanek slow path past ~1e5 rad, which would make the
    rotate-keys strategy compute-bound.
    Not FAST (the CPU interpreter): fp64 cos/sin, exact.
    """
    if FAST:
        k = tl.floor(ang * 0.15915494309189535 + 0.5)
        r = ang - k * 6.2831854820251465          # fp32(2*pi)
        r = r - k * (-1.7484555314695172e-07)     # 2*pi - fp32(2*pi)
        c = tl.inline_asm_elementwise("cos.approx.f32 $0, $1;", "=f,f", [r],
                                      dtype=tl.float32, is_pure=True, pack=1)
        s = tl.inline_asm_elementwise("sin.approx.f32 $0, $1;", "=f,f", [r],
                                      dtype=tl.float32, is_pure=True, pack=1)
    else:
        a = ang.to(tl.float64)
        c = tl.cos(a).to(tl.float32)
        s = tl.sin(a).to(tl.float32)
    return c, s
