"""Triton attention kernels with lazy RoPE over a paged, position-free KV pool.

Public API (tensor contracts in each module's docstrings; pool and page table in page_table.py):

    PageTable                       CSR page table: indptr, page_ids, page_pos, page_len,
                                    rot_shift, max_pages
    lazy_decode(q, k_pages, v_pages, table, q_pos, inv_freq, *, rope="rotate_k", ...)
                                    (DEFAULT_ROPE = "rotate_q" is the recommended store/strategy;
                                    tuning kwargs: block_n, num_warps, num_stages, split_target,
                                    heads_per_program, multi_shift: see paged_attention.py)
    plan_prefill(qo_indptr, num_qo_heads, num_kv_heads, device) -> PrefillPlan
    lazy_prefill(q, qo_indptr, q_pos, k_pages, v_pages, table, inv_freq, *, rope=..., plan=...)
    block_gather_rotate(k_pages, v_pages, table, inv_freq, *, source=...) -> k, v, kv_len
    block_attention_decode(q, k_pages, v_pages, table, q_pos, inv_freq, *, source=...)
    copy_rotate_run(k, v, src_pages, n_tokens, dst_pages, first_slot, shift, inv_freq)
                                    Block-Attention's copy inside the engine pool (page_copy.py)
    paged_attention_ref / block_gather_rotate_ref   torch references (also the CPU path)
    apply_rope, rope_cos_sin, rotate                RoPE helpers (transformers' rotate_half)

Dispatch: CUDA tensors -> Triton; CPU tensors -> Triton interpreter if TRITON_INTERPRET=1,
else the torch reference.
"""
from .block_copy import block_attention_decode, block_gather_rotate
from .decode import lazy_decode
from .page_copy import copy_rotate_run
from .page_table import PageTable, ROPE_MODES, interpreting, use_triton
from .prefill import PrefillPlan, lazy_prefill, plan_prefill
from .reference import block_gather_rotate_ref, copy_rotate_run_ref, paged_attention_ref
from .rope import apply_rope, rope_cos_sin, rotate

# Default RoPE strategy of the engine (set from benchmarks/kernels.py on the GPU): the KV store
# format the engine should use, and the `rope` to pass to lazy_decode / lazy_prefill. Changed from
# "rotate_k" to "rotate_q" (chunk-local store, query rotated once per chunk) after the H200
# measurements: rotate_q decode costs <= 2% over rope="none" at batch >= 32, context >= 8k, while
# rotate_k pays ~29% for per-key cos/sin (SFU) and staging keys through registers. The entry
# points' own `rope=` defaults are unchanged ("rotate_k") so existing callers keep their meaning.
DEFAULT_ROPE = "rotate_q"

__all__ = [
    "PageTable", "ROPE_MODES", "DEFAULT_ROPE", "lazy_decode", "lazy_prefill", "plan_prefill",
    "PrefillPlan", "block_gather_rotate", "block_attention_decode", "paged_attention_ref",
    "block_gather_rotate_ref", "copy_rotate_run", "copy_rotate_run_ref", "apply_rope", "rope_cos_sin", "rotate", "interpreting",
    "use_triton",
]
