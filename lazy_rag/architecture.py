"""Which transformers checkpoints lazy-rag can run, and the parts of them our forward uses.

We reuse the checkpoint's own modules (projections, norms, MLP, embeddings) and replace only
attention, which is where cached chunk KV and lazy RoPE come in. A family is supported when its
decoder layer is exactly: pre-norm -> q/k/v proj (optional bias, optional per-head q/k norm
before RoPE) -> RoPE -> softmax attention -> o_proj -> residual -> pre-norm -> MLP -> residual.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .errors import UnsupportedModelError
from .kernels.rope import RopeTable

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
# default, linear, llama3 and yarn give fixed frequencies; `dynamic` (and longrope) change with the
# sequence length, so a chunk's KV could not be computed once and reused
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass
class ModelShape:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_positions: int

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K+V per token per dtype byte (multiply by element size)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


def check_supported(config) -> None:
    """Refuse checkpoints whose attention is not plain global RoPE attention."""
    mt = getattr(config, "model_type", None)
    if mt not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"Model type {mt!r} is not supported. lazy-rag runs Llama (incl. SmolLM, llama3 RoPE "
            "scaling), Mistral, Qwen2 and Qwen3 checkpoints; pick one of those."
        )
    layer_types = getattr(config, "layer_types", None) or []
    sliding = getattr(config, "sliding_window", None)
    if "sliding_attention" in layer_types or (mt == "mistral" and sliding is not None):
        raise UnsupportedModelError(
            f"This {mt} checkpoint uses sliding-window attention (window {sliding}); lazy-rag "
            "needs global attention so cached chunks stay visible at any position. Use a "
            "checkpoint (or config) without a sliding window."
        )
    params = getattr(config, "rope_parameters", None) or {}
    if isinstance(params, dict) and params and "rope_type" not in params:
        raise UnsupportedModelError(
            "Per-layer-type RoPE parameters are not supported (one RoPE table per model expected)."
        )


def rope_table_of(model) -> RopeTable:
    """The checkpoint's own RoPE: ``inv_freq`` and ``attention_scaling`` from transformers' rotary
    module, so every scaling is computed exactly as the model was trained."""
    params = getattr(model.config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"RoPE type {rope_type!r} is not supported: its frequencies change with sequence length (or per "
            "token), so chunk KV cannot be computed once and reused. Supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)}."
        )
    rotary = model.model.rotary_emb
    return RopeTable(inv_freq=rotary.inv_freq.detach().to(torch.float32).clone(),
                     attention_scaling=float(rotary.attention_scaling), rope_type=rope_type)


class ModelParts:
    """The checkpoint's modules in the order our forward uses them, its shape and RoPE table."""

    def __init__(self, model):
        check_supported(model.config)
        self.model = model
        self.config = model.config
        self.rope_table = rope_table_of(model)
        inner = model.model
        self.embed = inner.embed_tokens
        self.vocab_rows = int(self.embed.weight.shape[0])  # ids from here up are wrapper slots (wrapper.py)
        self.virtual_rows: torch.Tensor | None = None     # the host's WrapperTable rows, if any
        self.final_norm = inner.norm
        self.lm_head = model.lm_head
        self.layers = list(inner.layers)
        attn = self.layers[0].self_attn
        c = self.config
        self.shape = ModelShape(
            num_layers=len(self.layers),
            num_heads=c.num_attention_heads,
            num_kv_heads=c.num_key_value_heads,
            head_dim=attn.head_dim,
            hidden_size=c.hidden_size,
            vocab_size=c.vocab_size,
            max_positions=int(getattr(c, "max_position_embeddings", 1 << 20)),
        )
        self.scaling = float(attn.scaling)
        self.has_qk_norm = hasattr(attn, "q_norm")

    def embed_ids(self, ids: torch.Tensor, virtual: bool = False, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Input embeddings of ``ids`` (any shape); with ``virtual``, ids >= ``vocab_rows`` (chunk
        wrapper slots) read ``rows`` (default ``virtual_rows``; the trainer passes its trainable
        vectors, and gradients reach them) instead. Value-independent (no host sync), so it can be
        captured."""
        rows = self.virtual_rows if rows is None else rows
        if not virtual or rows is None:
            return self.embed(ids)
        extra = ids - self.vocab_rows
        x = self.embed(ids.clamp(max=self.vocab_rows - 1))
        w = rows[extra.clamp(min=0, max=rows.shape[0] - 1)]
        return torch.where((extra >= 0)[..., None], w.to(x.dtype), x)

    def project_qkv(self, layer, y: torch.Tensor):
        """q [n, Hq, D], k and v [n, Hkv, D] of normed hidden states y [n, hidden], before RoPE
        (Qwen3 normalises q and k per head here, before any rotation)."""
        attn, shp, n = layer.self_attn, self.shape, y.shape[0]
        q = attn.q_proj(y).view(n, shp.num_heads, shp.head_dim)
        k = attn.k_proj(y).view(n, shp.num_kv_heads, shp.head_dim)
        v = attn.v_proj(y).view(n, shp.num_kv_heads, shp.head_dim)
        if self.has_qk_norm:
            q, k = self.norm(attn.q_norm, q), self.norm(attn.k_norm, k)
        return q, k, v

    @staticmethod
    def norm(module, x: torch.Tensor) -> torch.Tensor:
        """The checkpoint's RMSNorm ``module`` applied to x (every supported family's is
        ``weight * (x.float() * rsqrt(mean(x.float()**2) + eps)).to(x.dtype)``). On CUDA the
        normalisation is torch's fused ``rms_norm`` (one kernel instead of ~6 small ones per norm,
        65 norms per 8B step: ~1.5 ms of an 82-token step on an H100), then the same weight
        multiply in x's dtype, so it rounds where the module rounds; only the order of the
        mean's fp32 sum differs. Elsewhere the module itself."""
        eps = getattr(module, "variance_epsilon", None)
        if not x.is_cuda or eps is None:
            return module(x)
        return module.weight * F.rms_norm(x, (x.shape[-1],), None, eps)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device
