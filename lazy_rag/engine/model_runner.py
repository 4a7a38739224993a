"""``ModelRunner``: one batched forward per engine step, tensors in, next-token logits out.

All sequences of a step (prefills and decodes) are packed into one token batch; each layer is
the checkpoint's own modules (as ``lazy_rag.decoder``) with attention replaced by the paged
kernels: the new tokens' keys are rotated at their logical positions and written to their
private pages, then ``lazy_prefill`` attends over each sequence's page table with
``rope="rotate_q"`` (query rotated per page by position - rot_shift). On CPU tensors the
kernels dispatch to their torch references, so the same code runs the CPU tests.
"""
from __future__ import annotations

import torch

from ..architecture import ModelHandles
from ..kernels import PageTable, lazy_prefill, paged_attention_ref, plan_prefill
from ..rope import apply_cos_sin
from .page_pool import PagePool
from .sequence import Sequence


def page_table_rows(seq: Sequence, page_size: int):
    """(page_ids, page_pos, page_len, rot_shift) of every page the sequence attends to."""
    ids, pos, lens, shift = [], [], [], []
    for run in seq.cached_runs + seq.private_runs:
        for i, page in enumerate(run.pages):
            n = min(page_size, run.length - i * page_size)
            if n <= 0:
                break
            ids.append(page)
            pos.append(run.pos + i * page_size)
            lens.append(n)
            shift.append(run.rot_shift)
    return ids, pos, lens, shift


def write_slots(seq: Sequence, positions: list[int], page_size: int) -> list[tuple[int, int]]:
    """(page, slot) where the KV of each new token goes (its private run)."""
    out = []
    runs = seq.private_runs
    r = 0
    for p in positions:
        while not (runs[r].pos <= p < runs[r].pos + runs[r].length):
            r += 1
        i = p - runs[r].pos
        out.append((runs[r].pages[i // page_size], i % page_size))
    return out


class ModelRunner:
    def __init__(self, handles: ModelHandles, pool: PagePool):
        self.h, self.pool = handles, pool
        self.inv_freq = handles.rope.inv_freq.to(pool.device)

    @torch.inference_mode()
    def run(self, seqs: list[Sequence]) -> torch.Tensor:
        """Compute every sequence's ``compute_pos`` tokens; returns fp32 logits [len(seqs), vocab]
        of each sequence's last new token."""
        h, shp, ps, dev = self.h, self.h.shape, self.pool.page_size, self.pool.device
        ids, pos, slots, qo, rows = [], [], [], [0], ([], [], [], [])
        for seq in seqs:
            toks = seq.tokens
            ids += [toks[p] for p in seq.compute_pos]
            pos += seq.compute_pos
            slots += write_slots(seq, seq.compute_pos, ps)
            qo.append(len(ids))
            for acc, part in zip(rows, page_table_rows(seq, ps)):
                acc.append(part)
        table = PageTable.from_lists(*rows, device=dev)
        n = len(ids)
        ids_t = torch.tensor(ids, device=dev)
        pos_t = torch.tensor(pos, device=dev)
        q_pos = pos_t.to(torch.int32)
        qo_t = torch.tensor(qo, dtype=torch.int32, device=dev)
        plan = plan_prefill(qo, shp.num_heads, shp.num_kv_heads, dev) if dev.type == "cuda" else None
        slot_page = torch.tensor([s[0] for s in slots], device=dev)
        slot_off = torch.tensor([s[1] for s in slots], device=dev)
        cos, sin = h.rope.cos_sin(pos_t, h.dtype)
        x = h.embed(ids_t)
        for i, layer in enumerate(h.layers):
            attn = layer.self_attn
            q, k, v = h.project_qkv(layer, layer.input_layernorm(x))
            # private pages hold keys rotated at their logical positions (rot_shift 0)
            self.pool.k[i][slot_page, :, slot_off] = apply_cos_sin(k, cos, sin).to(self.pool.dtype)
            self.pool.v[i][slot_page, :, slot_off] = v.to(self.pool.dtype)
            if dev.type == "cuda":
                o = lazy_prefill(q, qo_t, q_pos, self.pool.k[i], self.pool.v[i], table, self.inv_freq,
                                 rope="rotate_q", attention_scaling=h.rope.attention_scaling,
                                 sm_scale=h.scaling, plan=plan)
            else:  # the CPU runtime is plain torch (the Triton interpreter is for kernel tests only)
                o = paged_attention_ref(q, qo_t, q_pos, self.pool.k[i], self.pool.v[i], table, self.inv_freq,
                                        "rotate_q", h.rope.attention_scaling, h.scaling)
            x = x + attn.o_proj(o.reshape(n, shp.num_heads * shp.head_dim))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        last = torch.tensor(qo[1:], device=dev) - 1
        return h.lm_head(h.final_norm(x[last])).float()
