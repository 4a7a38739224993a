"""Answer quality of lazy reuse vs full re-encoding on open-retrieval SQuAD v1.1 dev.

Same as `lazy-rag eval squad` (see lazy_rag/quality.py); writes JSON records to
benchmarks/results/ and the table to QUALITY.md.

    python benchmarks/quality_squad.py --model qwen2.5-0.5b --n 200 --top-k 4
"""
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from lazy_rag.cli import app  # noqa: E402

if __name__ == "__main__":
    app(["eval", "squad", *sys.argv[1:]])
