"""Answer quality of KV reuse vs full re-encoding on SQuAD-format data, with paired intervals.

Same as `lazy-rag eval squad` (see lazy_rag/quality/); writes JSON records, per-question
answers and a plot to benchmarks/results/ and a section to QUALITY.md.

    python benchmarks/quality_squad.py --model qwen2.5-0.5b --n 100 --top-k 4
    python benchmarks/quality_squad.py --task bridge --n 60
"""
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from lazy_rag.cli import app  # noqa: E402

if __name__ == "__main__":
    app(["eval", "squad", *sys.argv[1:]])
