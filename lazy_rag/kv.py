"""KV layouts for one request: how attention finds the keys and values of every earlier token.

- ``ChunkKV``: one cached chunk, position-free (keys stored *before* RoPE), shared read-only by
  any number of requests at any offset.
- ``LazyKV`` (mode ``lazy``): attention reads the shared chunk tensors in place and rotates
  their keys at this request's logical positions while computing scores; only the request's own
  tokens live in a private buffer. Nothing of a chunk is copied.
- ``ContiguousKV`` (modes ``block``, ``prefix``, ``full``): one private buffer in logical order
  holding rotated keys, as an ordinary KV cache does. ``block`` fills it with re-rotated copies of
  the chunks (Block-Attention's materialisation); ``prefix`` with a reused exact prefix.

Both answer ``attend(layer, q, q_pos)`` with the same rule: a key is visible to a query iff its
logical position <= the query's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from .rope import RopeTable, apply_cos_sin


@dataclass
class ChunkKV:
    """Position-free KV of one chunk: ``k`` (unrotated) and ``v`` of shape [layers, L, kv_heads, head_dim]."""

    k: torch.Tensor
    v: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.k.shape[1]

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    def to(self, device=None, dtype=None) -> "ChunkKV":
        return ChunkKV(self.k.to(device=device, dtype=dtype), self.v.to(device=device, dtype=dtype))


def _empty_kv(num_layers, capacity, num_kv_heads, head_dim, dtype, device):
    shape = (num_layers, capacity, num_kv_heads, head_dim)
    return torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device)


class ContiguousKV:
    """A private KV cache in logical order (slot index == logical position), keys rotated."""

    def __init__(self, rope: RopeTable, num_layers, num_kv_heads, head_dim, capacity, dtype, device, scaling):
        self.rope, self.scaling = rope, scaling
        self.k, self.v = _empty_kv(num_layers, capacity, num_kv_heads, head_dim, dtype, device)
        self.length = 0  # slots [0, length) hold valid KV
        self._cos_sin = None
        self._slots = None

    @property
    def capacity(self) -> int:
        return self.k.shape[1]

    def place_rotated(self, start: int, k_rot: torch.Tensor, v: torch.Tensor) -> None:
        """Copy already-rotated KV [layers, n, H, D] into slots [start, start+n)."""
        n = k_rot.shape[1]
        self.k[:, start:start + n] = k_rot
        self.v[:, start:start + n] = v
        self.length = max(self.length, start + n)

    def place_chunk(self, start: int, chunk: ChunkKV) -> None:
        """Block-Attention: a copy of the chunk with keys re-rotated to their logical positions."""
        pos = torch.arange(start, start + chunk.num_tokens, device=self.k.device)
        self.place_rotated(start, self.rope.rotate(chunk.k.to(self.k.dtype), pos), chunk.v)

    def begin_step(self, positions: torch.Tensor) -> None:
        self._slots = positions
        self._cos_sin = self.rope.cos_sin(positions, self.k.dtype)
        first, last = int(positions[0]), int(positions[-1])
        self.length = max(self.length, last + 1)
        # new tokens that are one run ending at the last slot (full prefill, a prefix-cache tail,
        # decode) need only the causal rule, so SDPA can take its flash path instead of a mask
        self._causal_run = last - first + 1 == positions.shape[0] and last + 1 == self.length

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer, self._slots] = apply_cos_sin(k, *self._cos_sin)
        self.v[layer, self._slots] = v

    def attend(self, layer: int, q: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
        """q [n, Hq, D] rotated -> out [n, Hq, D]."""
        n, t = q.shape[0], self.length
        k = self.k[layer, :t].transpose(0, 1)[None]  # [1, Hkv, t, D]
        v = self.v[layer, :t].transpose(0, 1)[None]
        gqa = q.shape[1] != k.shape[1]
        qh = q.transpose(0, 1)[None]
        if self._causal_run and n == 1:
            out = F.scaled_dot_product_attention(qh, k, v, scale=self.scaling, enable_gqa=gqa)
        elif self._causal_run and n == t:
            out = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=self.scaling, enable_gqa=gqa)
        elif self._causal_run:  # a run after reused slots: causal, aligned to the bottom right
            out = F.scaled_dot_product_attention(qh, k, v, attn_mask=causal_lower_right(n, t), scale=self.scaling,
                                                 enable_gqa=gqa)
        else:
            mask = torch.arange(t, device=q.device)[None, :] <= q_pos[:, None]
            out = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, scale=self.scaling, enable_gqa=gqa)
        return out[0].transpose(0, 1)

    def export(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[:, :length], self.v[:, :length]


class LazyKV:
    """Shared chunk KV read in place + a private buffer for this request's own tokens.

    Chunk keys are rotated at this request's positions inside ``attend`` (the CPU counterpart of
    the Triton kernels' in-register rotation); cos/sin for each placed chunk are computed once
    per request, like the kernels' table.
    """

    def __init__(self, rope: RopeTable, pieces: list[tuple[int, ChunkKV]], num_layers, num_kv_heads,
                 head_dim, capacity, dtype, device, scaling):
        self.rope, self.scaling, self.dtype = rope, scaling, dtype
        self.pieces = []
        for start, chunk in pieces:
            pos = torch.arange(start, start + chunk.num_tokens, device=device)
            self.pieces.append((chunk, pos, rope.cos_sin(pos, dtype)))
        self.k, self.v = _empty_kv(num_layers, capacity, num_kv_heads, head_dim, dtype, device)
        self.pos = torch.empty(capacity, dtype=torch.long, device=device)
        self.used = 0
        self._slots = slice(0, 0)
        self._cos_sin = None

    def begin_step(self, positions: torch.Tensor) -> None:
        n = positions.shape[0]
        if self.used + n > self.k.shape[1]:
            raise RuntimeError(f"LazyKV private buffer full ({self.k.shape[1]} slots)")
        self._slots = slice(self.used, self.used + n)
        self.pos[self._slots] = positions
        self.used += n
        self._cos_sin = self.rope.cos_sin(positions, self.dtype)
        self._biases = None  # per-step visibility as additive biases, built by the first layer

    def _step_biases(self, q_pos: torch.Tensor, g: int) -> list[torch.Tensor]:
        """0 where a key is visible to a query row, -inf where not: one [1, n*g, L] per piece,
        added inside the score matmul (baddbmm) instead of a separate masking pass."""
        if self._biases is None:
            qp = q_pos.repeat_interleave(g)[None, :, None]  # query position per row of the grouped q
            keys = [pos for _, pos, _ in self.pieces] + [self.pos[:self.used]]
            self._biases = [torch.zeros((), dtype=torch.float32, device=qp.device).masked_fill(
                pos[None, None, :] > qp, float("-inf")) for pos in keys]
        return self._biases

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer, self._slots] = apply_cos_sin(k, *self._cos_sin)
        self.v[layer, self._slots] = v

    def attend(self, layer: int, q: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
        """Softmax over every piece's scores at once; no KV is concatenated or copied."""
        n, hq, d = q.shape
        hkv = self.k.shape[2]
        g = hq // hkv
        qg = q.reshape(n, hkv, g, d).permute(1, 0, 2, 3).reshape(hkv, n * g, d).float()
        biases = self._step_biases(q_pos, g)
        keys = [apply_cos_sin(chunk.k[layer].to(self.dtype), cos, sin)  # lazy RoPE
                for chunk, _, (cos, sin) in self.pieces] + [self.k[layer, :self.used]]
        values = [chunk.v[layer] for chunk, _, _ in self.pieces] + [self.v[layer, :self.used]]
        scores = [torch.baddbmm(bias, qg, k.permute(1, 2, 0).float(), alpha=self.scaling)
                  for k, bias in zip(keys, biases)]
        probs = torch.softmax(torch.cat(scores, dim=-1), dim=-1)
        out = torch.zeros(hkv, n * g, d, dtype=torch.float32, device=q.device)
        col = 0
        for v in values:
            L = v.shape[0]
            out += torch.matmul(probs[..., col:col + L], v.transpose(0, 1).float())
            col += L
        return out.reshape(hkv, n, g, d).permute(1, 0, 2, 3).reshape(n, hq, d).to(q.dtype)
