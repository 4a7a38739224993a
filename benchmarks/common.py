"""Shared helpers for benchmark scripts: records, JSON output, environment description."""
from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"

# Python puts this folder first on sys.path when a script in it runs, and our kernels.py would then
# shadow the `kernels` package that transformers probes for (seen on the GPU image: importing
# LlamaConfig failed). Scripts import this module first; from here on the folder is off the path.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]

# Random-weight architectures and the id-only tokenizer live in the package (lazy_rag.bench) so that
# `lazy-rag bench` has them too; re-exported for the scripts here.
from lazy_rag.bench.random_models import IdTokenizer, random_llama31_8b  # noqa: E402,F401
from lazy_rag.bench.records import environment  # noqa: E402,F401


def write_records(name: str, records: list[dict]) -> Path:
    """Write a list of flat records to benchmarks/results/<name>.json."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(records, indent=1) + "\n")
    return path


def print_table(records: list[dict], columns: list[str]) -> None:
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in records)) for c in columns]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for r in records:
        print("  ".join(_fmt(r.get(c)).ljust(w) for c, w in zip(columns, widths)))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.2f}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)
