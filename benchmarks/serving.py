"""Serving benchmark: the paper's RAG workload through the engine (lazy, block, prefix, full) and
plain transformers `generate`, over request rates and KV budgets. The same runner as
`lazy-rag bench` (lazy_rag/bench/), with argparse: the GPU image has no typer, rich or matplotlib.

    python benchmarks/serving.py                        # CUDA: Llama-3.1-8B shape, random weights, paper workload
    python benchmarks/serving.py --out serving_h200 --rates offline,1,2,4 --budgets 1.0,0.1
    python benchmarks/serving.py --preset decode-shared   # issue 16: lazy with/without shared-chunk grouping vs block
    python benchmarks/serving.py --plot-only benchmarks/results/serving_h200.json   # PNGs, where matplotlib is

Records: benchmarks/results/<out>.json, written after every point.
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from lazy_rag.bench.command import argparse_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(argparse_main())
