"""Plain torch references for every kernel: the same math, no tiling.

They are the test oracles (run with compute_dtype=float64) and the CPU runtime path (dispatch
falls back to them on CPU tensors when the Triton interpreter is off). Tensor contracts are the
kernels' own: see page_table.py for the pool and the page table, decode.py / prefill.py /
page_copy.py for the entry points.
"""
from __future__ import annotations

import torch

from .kv_quant import dequantize_rows, quantize_rows
from .page_table import DEFAULT_ROPE_MODE, HIDDEN_POS, PageTable
from .rope import rope_cos_sin, rotate


def gather_tokens(k_pages, v_pages, table: PageTable, b: int):
    """Sequence b's keys/values in table order: k, v [n, Hkv, D], pos [n], shift [n] (int64).

    pos is each slot's logical position: page_pos + slot, or its explicit slot_pos where the
    entry has a row (HIDDEN_POS for a hidden slot: the caller drops those)."""
    s, e = int(table.indptr[b]), int(table.indptr[b + 1])
    dev = k_pages.device
    ids = table.page_ids[s:e].long().to(dev)
    lens = table.page_len[s:e].long().to(dev)
    pos0 = table.page_pos[s:e].long().to(dev)
    n = int(lens.sum())
    tok_entry = torch.repeat_interleave(torch.arange(e - s, device=dev), lens)
    starts = torch.cumsum(lens, 0) - lens
    off = torch.arange(n, device=dev) - starts[tok_entry]
    page = ids[tok_entry]
    k = k_pages[page, :, off]          # [n, Hkv, D]
    v = v_pages[page, :, off]
    pos = pos0[tok_entry] + off
    if table.has_slot_pos and table.slot_pos.shape[0] > 0:
        # an entry with row r >= 0 takes slot j's position from slot_pos[r, j]
        row = table.slot_pos_row[s:e].long().to(dev)[tok_entry]
        explicit = table.slot_pos.long().to(dev)[row.clamp_min(0), off]
        pos = torch.where(row >= 0, explicit, pos)
    if table.rot_shift is not None:
        shift = table.rot_shift[s:e].long().to(dev)[tok_entry]
    else:
        shift = torch.zeros_like(pos)
    return k, v, pos, shift


def visible_tokens(k_pages, v_pages, table: PageTable, b: int):
    """gather_tokens without the hidden slots (never read: their K/V may hold anything)."""
    k, v, pos, shift = gather_tokens(k_pages, v_pages, table, b)
    keep = pos != HIDDEN_POS
    return k[keep], v[keep], pos[keep], shift[keep]


def paged_attention_ref(q, qo_indptr, q_pos, k_pages, v_pages, table: PageTable, inv_freq,
                        rope_mode: str = DEFAULT_ROPE_MODE, attention_scaling: float = 1.0,
                        sm_scale: float | None = None, compute_dtype=torch.float32,
                        return_lse: bool = False, k_scale=None, v_scale=None,
                        softcap: float | None = None, window: int | None = None):
    """Attention of new tokens over a paged, position-free KV pool.

    q [Tq, H, D] (unrotated, except rope_mode="none": already rotated), qo_indptr [B+1]
    (sequence b's queries are rows qo_indptr[b]..qo_indptr[b+1]-1), q_pos [Tq] logical positions.
    Explicit slot positions (table.slot_pos) are honoured; hidden slots are dropped.
    rope_mode: "rotate_q" keys stored rotated at (pos - rot_shift); query rotated by
                          (m - rot_shift);
               "none"     q and keys already rotated.
    Returns [Tq, H, D] in q.dtype. A query with no visible key gets zeros.
    return_lse: return (out, lse), lse [Tq, H] in compute_dtype (fp32 by default, as the
    kernels): each row's natural-log logsumexp of its visible scaled scores sm_scale * q.k, -inf
    for a query with no visible key.
    k_scale, v_scale: fp8 pages' per-token scales (kernels/kv_quant.py): the pages are
    dequantised (exactly, in fp32), then attended as any other.
    softcap: the scaled scores s soft-capped, softcap * tanh(s / softcap), before the mask and
    softmax (Gemma 2's attn_logit_softcapping); window: a query at p sees only keys at
    p - window + 1 .. p (transformers' sliding-window mask). None: neither.
    """
    if k_scale is not None:
        k_pages, v_pages = dequantize_rows(k_pages, k_scale), dequantize_rows(v_pages, v_scale)
    Tq, H, D = q.shape
    Hkv = k_pages.shape[1]
    G = H // Hkv
    scale = D ** -0.5 if sm_scale is None else sm_scale
    out = torch.zeros(Tq, H, D, dtype=compute_dtype, device=q.device)
    lse = torch.full((Tq, H), float("-inf"), dtype=compute_dtype, device=q.device)
    inv_freq = inv_freq.float().to(q.device)
    for b in range(table.batch_size):
        qs, qe = int(qo_indptr[b]), int(qo_indptr[b + 1])
        if qe == qs:
            continue
        k, v, kpos, kshift = visible_tokens(k_pages, v_pages, table, b)
        k = k.to(q.device).repeat_interleave(G, dim=1)        # [n, H, D]
        v = v.to(q.device).repeat_interleave(G, dim=1).to(compute_dtype)
        kpos, kshift = kpos.to(q.device), kshift.to(q.device)
        qb = q[qs:qe]
        mpos = q_pos[qs:qe].long().to(q.device)
        if rope_mode == "none":
            scores = torch.einsum("thd,nhd->htn", qb.to(compute_dtype), k.to(compute_dtype))
        elif rope_mode == "rotate_q":
            scores = torch.empty(H, qe - qs, k.shape[0], dtype=compute_dtype, device=q.device)
            kc = k.to(compute_dtype)
            for u in torch.unique(kshift).tolist():
                sel = kshift == u
                cq, sq = rope_cos_sin(mpos - u, inv_freq, attention_scaling)
                qr = rotate(qb, cq[:, None], sq[:, None]).to(compute_dtype)
                scores[:, :, sel] = torch.einsum("thd,nhd->htn", qr, kc[sel])
        else:
            raise ValueError(f"unknown rope_mode {rope_mode!r}")
        visible = kpos[None, :] <= mpos[:, None]               # [t, n]
        if window is not None:
            visible &= mpos[:, None] - kpos[None, :] < window
        scores = scores * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill(~visible[None], float("-inf"))
        p = torch.softmax(scores, dim=-1).nan_to_num(0.0)      # rows with no visible key -> 0
        out[qs:qe] = torch.einsum("htn,nhd->thd", p, v)
        if k.shape[0]:                                         # no key at all: stays -inf
            lse[qs:qe] = torch.logsumexp(scores, dim=-1).transpose(0, 1)
    out = out.to(q.dtype)
    return (out, lse) if return_lse else out


def copy_rotate_run_ref(k: torch.Tensor, v: torch.Tensor, src_pages: torch.Tensor, n_tokens: int,
                        dst_pages: torch.Tensor, first_slot: int, shift: int, inv_freq: torch.Tensor,
                        k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None) -> None:
    """Torch reference of kernels.page_copy.copy_rotate_run (also the CPU path); inv_freq [D/2]
    or, per layer, [L, D/2]. fp8 pools (k_scale / v_scale [L, P, H, page]): keys dequantised,
    rotated in fp32 and quantised again with new per-token scales; values and their scales
    copied as they are."""
    L, _, H, page, D = k.shape
    src = src_pages.long()
    slots = torch.arange(first_slot, first_slot + n_tokens, device=k.device)
    dpage, doff = dst_pages.long()[slots // page], slots % page

    def tokens(t):   # [L, P, H, page, ...] -> the run's [L, n, H, ...]
        return t[:, src].transpose(2, 3).reshape(L, -1, H, *t.shape[4:])[:, :n_tokens]

    def put(t, x):   # advanced indices on dims 1 and 3 (a slice between): the indexed dim comes first
        t[:, dpage, :, doff] = x.permute(1, 0, 2, *range(3, x.dim()))

    c, s = rope_cos_sin(torch.tensor(float(shift), device=k.device), inv_freq)
    if c.dim() == 2:   # [L, D/2]: each layer's own frequencies, over the run's [L, n, H, D]
        c, s = c[:, None, None], s[:, None, None]
    if k_scale is None:
        put(k, rotate(tokens(k), c, s).to(k.dtype))
        put(v, tokens(v))
        return
    # fp8 pages through uint8 views (indexed copies of float8 are not implemented everywhere)
    keys = dequantize_rows(tokens(k.view(torch.uint8)).view(k.dtype), tokens(k_scale))
    k8, ks = quantize_rows(rotate(keys, c, s))
    put(k.view(torch.uint8), k8.view(torch.uint8))
    put(k_scale, ks.to(k_scale.dtype))
    put(v.view(torch.uint8), tokens(v.view(torch.uint8)))
    put(v_scale, tokens(v_scale))


def moe_experts_ref(hidden: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor, compute_dtype=torch.float32) -> torch.Tensor:
    """Torch reference of kernels.moe.moe_experts (also its CPU path): a mixture-of-experts
    layer's routed SiLU-gated experts. hidden [T, H], gate_up [E, 2I, H] (gate rows first),
    down [E, H, I], top_k_index / top_k_weights [T, K]; returns [T, H] in hidden's dtype.

    The kernel's roundings: products accumulated in compute_dtype, silu(gate) * up rounded to
    hidden's dtype (the kernel stores it there), each pair's weighted output kept in
    compute_dtype and summed over k in k order. One loop step per expert that some pair picked
    (the weights are never gathered per pair: a real layer's would take gigabytes)."""
    T, H = hidden.shape
    K = top_k_index.shape[-1]
    inter = gate_up.shape[1] // 2
    expert_ids = top_k_index.reshape(-1)
    route = top_k_weights.reshape(-1).to(compute_dtype)
    x = hidden.to(compute_dtype)
    per_pair = torch.zeros(T * K, H, dtype=compute_dtype, device=hidden.device)
    for e in torch.unique(expert_ids).tolist():
        pairs = torch.nonzero(expert_ids == e).flatten()
        proj = x[pairs // K] @ gate_up[e].to(compute_dtype).T
        gate, up = proj[:, :inter], proj[:, inter:]
        act = (torch.nn.functional.silu(gate) * up).to(hidden.dtype).to(compute_dtype)
        per_pair[pairs] = (act @ down[e].to(compute_dtype).T) * route[pairs, None]
    return per_pair.view(T, K, H).sum(dim=1).to(hidden.dtype)
