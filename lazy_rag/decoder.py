"""One forward pass of a supported decoder over new tokens, attention delegated to a KV layout.

Reads like the model's equations; every module except attention is the checkpoint's own.
"""
from __future__ import annotations

import torch

from .architecture import ModelHandles
from .rope import apply_cos_sin


class Decoder:
    def __init__(self, handles: ModelHandles):
        self.h = handles

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, kv, *, capture_kv: bool = False,
                logits: str = "last"):
        """Run ``ids`` [n] at logical ``positions`` [n] through every layer.

        ``kv`` receives each layer's new keys (unrotated) and values and answers attention.
        ``capture_kv`` also returns the new tokens' unrotated K and V [layers, n, Hkv, D] (how a
        chunk's position-free KV is produced). ``logits``: "last", "all" or "none".
        """
        h = self.h
        shp = h.shape
        n = ids.shape[0]
        kv.begin_step(positions)
        cos, sin = h.rope.cos_sin(positions, h.dtype)
        x = h.embed(ids)
        caught_k = caught_v = None
        if capture_kv:
            caught_k = torch.empty(shp.num_layers, n, shp.num_kv_heads, shp.head_dim, dtype=h.dtype, device=x.device)
            caught_v = torch.empty_like(caught_k)
        for i, layer in enumerate(h.layers):
            attn = layer.self_attn
            q, k, v = h.project_qkv(layer, layer.input_layernorm(x))
            if capture_kv:
                caught_k[i], caught_v[i] = k, v
            kv.write(i, k, v)
            q = apply_cos_sin(q, cos, sin)
            o = kv.attend(i, q, positions)
            x = x + attn.o_proj(o.reshape(n, shp.num_heads * shp.head_dim))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        out = None
        if logits != "none":
            rows = x[-1:] if logits == "last" else x
            out = h.lm_head(h.final_norm(rows)).float()
        return out, caught_k, caught_v

