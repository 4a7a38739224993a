"""``ModelRunner``: one batched forward per engine step, tensors in, next-token logits out.

All sequences of a step (prefills and decodes) are packed into one token batch; each layer is
the checkpoint's own modules (as ``lazy_rag.decoder``) with attention replaced by the paged
kernels: the new tokens' keys are rotated at their logical positions and written to their
private pages, then ``lazy_prefill`` attends over each sequence's page table with
``rope="rotate_q"`` (query rotated per page by position - rot_shift). On CPU tensors the
kernels dispatch to their torch references, so the same code runs the CPU tests.

Fast paths, exact rewrites of the same attention:
- a *fresh* sequence (nothing cached: full mode, a prefix-mode miss) attends only to its own
  new tokens, causally: torch SDPA (flash on CUDA) over contiguous q/k/v, which is what a user
  of plain transformers gets, so ``full`` is measured at its best;
- a long tail after reused prefix blocks (prefix mode) gathers the sequence's pages once per
  layer and runs SDPA with a lower-right causal mask, as vLLM runs flash attention over its
  paged prefix;
- a step of decodes only (one token per sequence) is replayed from a CUDA graph
  (``cuda_graphs.DecodeGraphs``), so Python launch overhead does not dominate small batches.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from ..architecture import ModelHandles
from ..kernels import PageTable, lazy_decode, lazy_prefill, paged_attention_ref, plan_prefill
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


def is_fresh(seq: Sequence) -> bool:
    """Nothing cached and every token computed now: plain causal attention over the new tokens."""
    return not seq.cached_runs and len(seq.compute_pos) == seq.num_tokens


def contiguous_pages(seq: Sequence, page_size: int) -> list[int] | None:
    """Pages holding the sequence's whole KV in position order when it is one stretch from
    position 0 with keys at logical positions (prefix mode: reused blocks + its own run), and
    its new tokens are that stretch's tail; else None."""
    runs = seq.cached_runs + seq.private_runs
    pages, pos = [], 0
    for r in runs:
        if r.pos != pos or r.rot_shift != 0 or (pos % page_size):
            return None
        pages.extend(r.pages[:-(-r.length // page_size)])
        pos += r.length
    n = len(seq.compute_pos)
    if pos != seq.num_tokens or seq.compute_pos != list(range(pos - n, pos)):
        return None
    return pages


def is_decode_step(seqs: list[Sequence]) -> bool:
    return all(len(s.compute_pos) == 1 and s.kv_len == s.num_tokens - 1 for s in seqs)


class ModelRunner:
    def __init__(self, handles: ModelHandles, pool: PagePool, cuda_graphs: bool = True, max_graph_batch: int = 256):
        self.h, self.pool = handles, pool
        self.inv_freq = handles.rope.inv_freq.to(pool.device)
        self.graphs = None
        if cuda_graphs and pool.device.type == "cuda":
            from .cuda_graphs import DecodeGraphs

            self.graphs = DecodeGraphs(self, max_graph_batch)

    # -- one layer stack, shared by the eager paths and the captured decode ----------------------
    def forward_decode(self, ids, pos, slot_page, slot_off, table: PageTable) -> torch.Tensor:
        """One new token per sequence: ids/pos/slot_page/slot_off [B] on the device; no host
        syncs and no allocation that depends on values, so it can be captured."""
        h, shp = self.h, self.h.shape
        B = ids.shape[0]
        q_pos = pos.to(torch.int32)
        cuda = ids.is_cuda
        qo = None if cuda else torch.arange(B + 1, dtype=torch.int32, device=ids.device)
        cos, sin = h.rope.cos_sin(pos, h.dtype)
        x = h.embed(ids)
        for i, layer in enumerate(h.layers):
            q, k, v = h.project_qkv(layer, layer.input_layernorm(x))
            self.pool.k[i][slot_page, :, slot_off] = apply_cos_sin(k, cos, sin).to(self.pool.dtype)
            self.pool.v[i][slot_page, :, slot_off] = v.to(self.pool.dtype)
            if cuda:
                o = lazy_decode(q, self.pool.k[i], self.pool.v[i], table, q_pos, self.inv_freq, rope="rotate_q",
                                attention_scaling=h.rope.attention_scaling, sm_scale=h.scaling)
            else:  # the CPU runtime is plain torch, as in _run_eager
                o = paged_attention_ref(q, qo, q_pos, self.pool.k[i], self.pool.v[i], table, self.inv_freq,
                                        "rotate_q", h.rope.attention_scaling, h.scaling)
            x = x + layer.self_attn.o_proj(o.reshape(B, shp.num_heads * shp.head_dim))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return h.lm_head(h.final_norm(x)).float()

    @torch.inference_mode()
    def run(self, seqs: list[Sequence]) -> torch.Tensor:
        """Compute every sequence's ``compute_pos`` tokens; returns fp32 logits [len(seqs), vocab]
        of each sequence's last new token."""
        if self.graphs is not None and is_decode_step(seqs):
            out = self.graphs.run(seqs)
            if out is not None:
                return out
        return self._run_eager(seqs)

    def _run_eager(self, seqs: list[Sequence]) -> torch.Tensor:
        h, shp, ps, dev = self.h, self.h.shape, self.pool.page_size, self.pool.device
        cuda = dev.type == "cuda"
        ids, pos, slots, spans = [], [], [], []
        paged, fresh, tails = [], [], []  # through the paged kernel / SDPA / SDPA over gathered pages
        for seq in seqs:
            a = len(ids)
            toks = seq.tokens  # a new list per access: take it once (10k-token prompts)
            ids += [toks[p] for p in seq.compute_pos]
            pos += seq.compute_pos
            slots += write_slots(seq, seq.compute_pos, ps)
            spans.append((a, len(ids)))
            j = len(spans) - 1
            if is_fresh(seq):
                fresh.append(j)
                continue
            # a long tail after reused prefix blocks: gather the pages once per layer and run
            # SDPA (a vLLM-style prefix hit followed by thousands of new tokens)
            history = contiguous_pages(seq, ps) if len(seq.compute_pos) >= 128 else None
            if history is not None:
                tails.append((j, torch.tensor(history, device=dev)))
            else:
                paged.append(j)
        n = len(ids)
        ids_t = torch.tensor(ids, device=dev)
        pos_t = torch.tensor(pos, device=dev)
        slot_page = torch.tensor([s[0] for s in slots], device=dev)
        slot_off = torch.tensor([s[1] for s in slots], device=dev)
        cos, sin = h.rope.cos_sin(pos_t, h.dtype)
        if paged:
            rows = ([], [], [], [])
            qo = [0]
            for j in paged:
                qo.append(qo[-1] + spans[j][1] - spans[j][0])
                for acc, part in zip(rows, page_table_rows(seqs[j], ps)):
                    acc.append(part)
            table = PageTable.from_lists(*rows, device=dev)
            qo_t = torch.tensor(qo, dtype=torch.int32, device=dev)
            rows_idx = None
            if len(paged) < len(seqs):
                rows_idx = torch.tensor([r for j in paged for r in range(*spans[j])], device=dev)
            q_pos = (pos_t if rows_idx is None else pos_t[rows_idx]).to(torch.int32)
            plan = plan_prefill(qo, shp.num_heads, shp.num_kv_heads, dev) if cuda else None
        x = h.embed(ids_t)
        for i, layer in enumerate(h.layers):
            q, k, v = h.project_qkv(layer, layer.input_layernorm(x))
            k_rot = apply_cos_sin(k, cos, sin)
            # private pages hold keys rotated at their logical positions (rot_shift 0)
            self.pool.k[i][slot_page, :, slot_off] = k_rot.to(self.pool.dtype)
            self.pool.v[i][slot_page, :, slot_off] = v.to(self.pool.dtype)
            o = torch.empty_like(q) if fresh or tails else None
            if paged:
                qp = q if rows_idx is None else q[rows_idx]
                if cuda:
                    op = lazy_prefill(qp, qo_t, q_pos, self.pool.k[i], self.pool.v[i], table, self.inv_freq,
                                      rope="rotate_q", attention_scaling=h.rope.attention_scaling,
                                      sm_scale=h.scaling, plan=plan)
                else:  # the CPU runtime is plain torch (the Triton interpreter is for kernel tests only)
                    op = paged_attention_ref(qp, qo_t, q_pos, self.pool.k[i], self.pool.v[i], table,
                                             self.inv_freq, "rotate_q", h.rope.attention_scaling, h.scaling)
                if o is None:
                    o = op
                else:
                    o[rows_idx] = op
            for j in fresh:
                a, b = spans[j]
                o[a:b] = self._causal_sdpa(apply_cos_sin(q[a:b], cos[a:b], sin[a:b]), k_rot[a:b], v[a:b])
            for j, pages_t in tails:
                a, b = spans[j]
                T = seqs[j].num_tokens
                kk = self.pool.k[i][pages_t].transpose(1, 2).reshape(-1, shp.num_kv_heads, shp.head_dim)[:T]
                vv = self.pool.v[i][pages_t].transpose(1, 2).reshape(-1, shp.num_kv_heads, shp.head_dim)[:T]
                o[a:b] = self._causal_sdpa(apply_cos_sin(q[a:b], cos[a:b], sin[a:b]), kk.to(q.dtype), vv.to(q.dtype))
            x = x + layer.self_attn.o_proj(o.reshape(n, shp.num_heads * shp.head_dim))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        last = torch.tensor([b - 1 for _, b in spans], device=dev)
        return h.lm_head(h.final_norm(x[last])).float()

    def _causal_sdpa(self, q, k, v):
        """q [n, H, D], k/v [m, Hkv, D] (rotated, m >= n: q are the last n of the m positions)
        -> [n, H, D]; KV heads repeated for GQA so the flash kernel applies."""
        g = q.shape[1] // k.shape[1]
        if g > 1:
            k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        n, m = q.shape[0], k.shape[0]
        # lower-right causal when the queries are a tail (torch's is_causal is upper-left)
        mask = None if n == m else causal_lower_right(n, m)
        # 4-D [1, H, n, D]: the flash backend takes only batched 4-D inputs (3-D ones fall back
        # to the math backend, which materialises the n x n scores)
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                           v.transpose(0, 1)[None], attn_mask=mask, is_causal=mask is None,
                                           scale=self.h.scaling)
        return o[0].transpose(0, 1)
