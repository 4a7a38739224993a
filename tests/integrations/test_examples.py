"""CI runs every example end to end (short outputs; no timing assertions)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize("command, expect", [
    ([sys.executable, "llama_index_query_engine.py"], ["from cached chunk KV", "exact path"]),
    ([sys.executable, "langchain_chain.py"], ["from cached chunk KV", "found in the prompt text"]),
    (["bash", "cli_walkthrough.sh"], ["Indexed 3 file(s)", "kv_bytes", "from cache"]),
])
def test_example_runs(command, expect):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "LAZY_RAG_MAX_NEW_TOKENS": "6"}
    proc = subprocess.run(command, cwd=EXAMPLES, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    for text in expect:
        assert text in proc.stdout, proc.stdout[-2000:]
