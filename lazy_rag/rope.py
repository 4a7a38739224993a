"""RoPE at arbitrary logical positions, from the model's own ``inv_freq`` table.

We take ``inv_freq`` and ``attention_scaling`` from transformers' rotary module, so default,
linear, llama3 and yarn scaling are computed exactly as the model was trained; angles are
``pos.float() * inv_freq`` in fp32, as in ``LlamaRotaryEmbedding.forward``.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from .errors import UnsupportedModelError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_cos_sin(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., n, heads, head_dim] rotated by cos/sin [n, head_dim]."""
    return x * cos[:, None, :] + rotate_half(x) * sin[:, None, :]


@dataclass
class RopeTable:
    inv_freq: torch.Tensor  # [head_dim // 2], fp32
    attention_scaling: float
    rope_type: str

    @classmethod
    def from_model(cls, model) -> "RopeTable":
        config = model.config
        params = getattr(config, "rope_parameters", None) or {}
        rope_type = params.get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"RoPE type {rope_type!r} is not supported: its frequencies change with sequence "
                "length (or per token), so chunk KV cannot be computed once and reused. Supported: "
                f"{', '.join(SUPPORTED_ROPE_TYPES)}."
            )
        rotary = model.model.rotary_emb
        return cls(
            inv_freq=rotary.inv_freq.detach().to(torch.float32).clone(),
            attention_scaling=float(rotary.attention_scaling),
            rope_type=rope_type,
        )

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos/sin of shape [n, head_dim] for int positions [n], cast to ``dtype`` like HF."""
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
