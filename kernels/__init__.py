"""Triton attention kernels with lazy RoPE over a paged, position-free KV pool.

Public API (tensor contracts in each module's docstrings; pool and page table in page_table.py):

    PageTable                       CSR page table: indptr, page_ids, page_pos, page_len,
                                    rot_shift, max_pages, optional explicit slot positions
                                    (slot_pos_row, slot_pos); PageTable.from_lists(...)
    ROPE_MODES, DEFAULT_ROPE_MODE   how the pool stores keys ("none" / "rotate_q");
                                    every entry point's `rope_mode` defaults to "rotate_q"
    HIDDEN_POS                      slot_pos value hiding a slot from every query
    lazy_decode(q, k_pages, v_pages, table, q_pos, inv_freq, *, rope_mode=..., sm_scale=None,
                return_lse=False, ...) -> out, or (out, lse) with return_lse=True
                                    (tuning kwargs: block_n, num_warps, num_stages, split_target,
                                    num_splits: see paged_attention.py); softcap=None,
                                    window=None: Gemma 2's score soft-cap and sliding window
                                    (every attention entry point and the reference take them)
    plan_prefill(qo_indptr, num_qo_heads, num_kv_heads, device) -> PrefillPlan
    lazy_prefill(q, qo_indptr, q_pos, k_pages, v_pages, table, inv_freq, *, rope_mode=...,
                 plan=..., sm_scale=None, return_lse=False) -> out, or (out, lse)
                                    lse [Tq, H] fp32: each query row's natural-log log-sum-exp
                                    of its visible keys' scores sm_scale * q.k, -inf for a row
                                    that sees no key. Calls over disjoint key groups (one page
                                    table each, any sm_scale) merge exactly:
                                    o = sum_g e^(lse_g - m) o_g / sum_g e^(lse_g - m),
                                    m = max_g lse_g (see decode.py). The kernel
                                    (prefill_runs.py) walks the page list as runs of equal
                                    rot_shift, the query rotated once per run and
                                    loop-invariant in a plain flash-attention loop, causal mask
                                    only where a key can be invisible; rope_mode "rotate_q" or
                                    "none". Tuning kwargs as lazy_decode's; plan_prefill's
                                    block_m sets the query rows
    copy_rotate_run(k, v, src_pages, n_tokens, dst_pages, first_slot, shift, inv_freq,
                    k_scale=None, v_scale=None)
                                    Block-Attention's copy inside the engine pool (page_copy.py);
                                    inv_freq [D/2], or [L, D/2] for each layer's own table
    fp8 KV (kv_quant.py): float8_e4m3fn pages with one fp16 scale per (token, KV head),
                                    k_scale / v_scale [num_pages, Hkv, page_size]; lazy_decode,
                                    lazy_prefill, paged_attention_ref and copy_rotate_run take
                                    them as keyword arguments and dequantise in registers.
    FP8, quantize_rows, dequantize_rows, write_kv   the quantisation rule (per-token scale
                                    fp16(amax / 448), row quantised with the rounded scale) and
                                    the fused quantise-and-write of new tokens into a layer's pages
    new_v_pages, to_keys_major, keys_major   V pages keys-major (v_layout.py): the fp8 pool's
                                    layout, which every kernel reads and writes (a transposed
                                    view: indexing and shapes as usual)
    moe_experts(hidden, gate_up, down, top_k_index, top_k_weights) -> [T, H]
                                    a mixture-of-experts layer's routed SiLU-gated experts for
                                    decode-sized batches (moe.py; transformers' concatenated
                                    gate_up [E, 2I, H] and down [E, H, I]); sort_pairs_by_expert
                                    its device-side grouping of the token-expert pairs
    paged_attention_ref / copy_rotate_run_ref / moe_experts_ref   torch references (also the CPU path);
                                    paged_attention_ref(..., return_lse=True) -> (out, lse)
    apply_rope, rope_cos_sin, rotate                RoPE helpers (transformers' rotate_half)

Dispatch: CUDA tensors -> Triton; CPU tensors -> Triton interpreter if TRITON_INTERPRET=1,
else the torch reference.
"""
from .decode import lazy_decode
from .kv_quant import FP8, dequantize_rows, quantize_rows, write_kv
from .page_copy import copy_rotate_run
from .page_table import (DEFAULT_ROPE_MODE, HIDDEN_POS, ROPE_MODES, PageTable, interpreting,
                         use_triton)
from .prefill import PrefillPlan, lazy_prefill, plan_prefill
from .moe import moe_experts, sort_pairs_by_expert
from .reference import copy_rotate_run_ref, moe_experts_ref, paged_attention_ref
from .rope import apply_rope, rope_cos_sin, rotate
from .v_layout import keys_major, new_v_pages, to_keys_major

__all__ = [
    "PageTable", "ROPE_MODES", "DEFAULT_ROPE_MODE", "HIDDEN_POS", "lazy_decode", "lazy_prefill",
    "plan_prefill", "PrefillPlan", "paged_attention_ref", "copy_rotate_run", "copy_rotate_run_ref",
    "apply_rope", "rope_cos_sin", "rotate", "interpreting", "use_triton", "FP8", "quantize_rows",
    "dequantize_rows", "write_kv", "keys_major", "new_v_pages", "to_keys_major", "moe_experts", "moe_experts_ref",
    "sort_pairs_by_expert",
]
