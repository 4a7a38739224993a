#!/usr/bin/env bash
# The kernel tests on a CUDA machine: every test of tests/kernels, in bf16 and fp16 (tolerances
# 1e-2 / 1e-3): test_attention.py (decode, prefill, RoPE scalings, the benchmarks' Block-Attention
# copy, lazy_rag.bench.block_attention),
# test_slot_positions.py (explicit per-slot positions: hidden slots in shared pages, compact
# private runs, all-hidden sequences), test_lse.py (return_lse: each row's log-sum-exp, the
# two-group merge and APE's temperature merge), test_prefill_runs.py (the runs prefill kernel,
# lazy_prefill's: run boundaries, split-KV, the mask segmentation; beside it the benchmarks' tiles
# prefill, lazy_rag.bench.tiles_prefill), test_page_copy.py and test_fp8.py (fp8 pages with
# per-token scales: decode, both prefills and the block copy against the reference over the
# dequantised pages), test_softcap_window.py (Gemma 2's score soft-cap and sliding windows in
# decode, prefill, fp8 decode and the shared-chunk decode), test_moe.py (the mixture-of-experts
# experts kernel against its reference and transformers' eager experts, also under other tiles:
# MoeTiles).
#   tests/kernels/run_gpu.sh [pytest args]      e.g. -x, -k slot
# The kernel benchmarks are separate scripts: python benchmarks/attention_kernels.py, and the MoE
# kernels' tile sweep python benchmarks/moe_tiles.py
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 -c "import lazy_rag.kernels" 2>/dev/null \
  || python3 -m pip install -q --no-deps --no-build-isolation -e .
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'"
python3 -m pytest tests/kernels -q -p no:cacheprovider -n "${NPROC:-8}" "$@"
