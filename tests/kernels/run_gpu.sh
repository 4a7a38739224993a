#!/usr/bin/env bash
# The kernel tests on a CUDA machine: same tests, bf16 and fp16 (tolerances 1e-2 / 1e-3).
#   tests/kernels/run_gpu.sh [pytest args]      e.g. -x, -k decode
set -euo pipefail
cd "$(dirname "$0")/../.."
python3 -c "import lazy_rag.kernels" 2>/dev/null \
  || python3 -m pip install -q --no-deps --no-build-isolation -e .
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'"
python3 -m pytest tests/kernels -q -p no:cacheprovider -n "${NPROC:-8}" "$@"
