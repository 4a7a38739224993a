"""build_precompile: a build's kernels compiled in a child process from the model's config while
the model loads; the build waits for a child that is compiling and stops one still starting."""
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from lazy_rag import build_precompile
from lazy_rag.build_precompile import BuildPrecompile
from lazy_rag.precompile_child import CHILD_VOCAB, one_layer_config

# a stand-in child: names the phases it is given, each after a pause, then exits with the code
STAND_IN = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    folder = Path(sys.argv[-1]); phases = sys.argv[1].split(","); pause = float(sys.argv[2])
    for phase in phases:
        time.sleep(pause)
        (folder / "phase.tmp").write_text(phase); os.replace(folder / "phase.tmp", folder / "phase")
    time.sleep(pause)
    print("the stand-in's last words"); sys.exit(int(sys.argv[3]))
""")


def stand_in(phases: str, pause: float, code: int = 0) -> BuildPrecompile:
    return BuildPrecompile({}, argv=[sys.executable, "-c", STAND_IN, phases, str(pause), str(code)])


def test_the_childs_model_has_the_models_attention_in_one_layer():
    from transformers import Qwen2Config

    from lazy_rag.bench.random_models import random_config

    for cfg in (random_config("llama-3.1-8b"), Qwen2Config(**{**random_config("qwen2.5-0.5b").to_dict(),
                                                            "pad_token_id": 151643})):
        one = one_layer_config(cfg)
        assert one.num_hidden_layers == 1 and one.vocab_size == CHILD_VOCAB and one.pad_token_id is None
        for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "rope_parameters", "model_type"):
            assert getattr(one, key) == getattr(cfg, key), key
        assert cfg.num_hidden_layers > 1    # the model's own config is left as it was
        if getattr(cfg, "layer_types", None):
            assert one.layer_types == cfg.layer_types[:1]


def test_a_build_waits_for_a_child_that_compiles_and_stops_one_still_starting(caplog):
    # compiling: the encode's warm-up waits until the child is past the warm-up, the calibration
    # until it is done
    child = stand_in("warmup,calibration,done", 0.3)
    while child.phase() != "warmup":
        time.sleep(0.01)
    assert 0.1 < build_precompile.wait_in_flight("warmup") < 5
    assert child.phase() == "calibration" and child.ended is None
    build_precompile.wait_in_flight("calibration")
    assert child.phase() == "done"
    child.wait("done", stop_if_starting=False)
    assert child.ok and child.stopped_in is None
    # still starting (importing torch): stopped, and the build compiles as it would have
    child = stand_in("warmup", 30)
    with caplog.at_level("WARNING"):
        assert build_precompile.wait_in_flight("warmup") < 5
    assert child.stopped_in == "starting" and child.ok is False and child.proc.returncode is not None
    assert not caplog.text and not build_precompile._in_flight    # a stop is no failure
    # a child that fails: logged with its last output, nothing raised
    child = stand_in("warmup", 0.05, code=3)
    with caplog.at_level("WARNING"):
        child.wait("done", stop_if_starting=False)
    assert child.ok is False and "failed (exit 3)" in caplog.text and "the stand-in's last words" in caplog.text
    assert not child._dir.exists()
    # a child past its time is stopped
    child = stand_in("warmup", 30)
    with caplog.at_level("WARNING"):
        child.wait(timeout=0.2, stop_if_starting=False)
    assert child.stopped_in == "starting" and "took over" in caplog.text


def test_no_child_off_cuda_or_when_turned_off(monkeypatch):
    from lazy_rag.bench.random_models import random_config

    cfg = random_config("tiny-llama")
    assert BuildPrecompile.start(cfg, dtype=torch.float32, kv_dtype=torch.float32, device="cpu") is None
    assert build_precompile.start_for_pretrained("smollm2", device="cpu") is None
    monkeypatch.setenv(build_precompile.ENV, "off")
    assert BuildPrecompile.start(cfg, dtype=torch.bfloat16, kv_dtype=torch.bfloat16, device="cuda") is None


def test_the_child_runs_the_builds_warmup_and_calibration_on_a_one_layer_model(tmp_path):
    """The real child end to end, here on the CPU (its kernels are torch's; on CUDA, Triton's:
    the GPU test below): it reads the spec, builds the model, names each phase and exits 0."""
    from lazy_rag.bench.random_models import random_config

    spec = {"config": random_config("tiny-llama").to_dict(), "dtype": "float32", "kv_dtype": "float8_e4m3fn",
            "device": "cpu", "prefix_tokens": 5, "engine": {"page_size": 16}}
    child = BuildPrecompile(spec)
    phases = set()
    while child.proc.poll() is None:
        phases.add(child.phase())
        time.sleep(0.02)
    child.wait("done", stop_if_starting=False)
    assert child.ok, child.proc.returncode
    assert "warmup" in phases or "calibration" in phases


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton's kernels compile on CUDA only")
def test_the_childs_kernels_are_the_ones_a_build_of_the_full_model_runs(tmp_path, tokenizer):
    """With an empty Triton cache, the child compiles from the config; a build of the full model
    (two layers, its own weights) in a fresh process then compiles nothing: every kernel it runs
    comes from the cache."""
    from lazy_rag.bench.random_models import random_config

    cache = tmp_path / "triton"
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache), "LAZY_RAG_CALIBRATION": str(tmp_path / "cal.json")}
    for kv in ("bfloat16", "float8_e4m3fn"):
        spec = {"config": random_config("llama-3.1-8b").to_dict(), "dtype": "bfloat16", "kv_dtype": kv,
                "device": "cuda", "prefix_tokens": 0, "engine": {}}
        old = os.environ.get("TRITON_CACHE_DIR")
        os.environ["TRITON_CACHE_DIR"] = str(cache)
        try:
            child = BuildPrecompile(spec)
        finally:
            os.environ.pop("TRITON_CACHE_DIR") if old is None else os.environ.__setitem__("TRITON_CACHE_DIR", old)
        child.wait("done", stop_if_starting=False)
        assert child.ok
        compiled = {p.name for p in cache.iterdir()}
        assert compiled
        build = textwrap.dedent(f"""
            import sys
            from transformers import AutoTokenizer
            from lazy_rag import LazyIndex, LazyLLM
            from lazy_rag.bench.random_models import random_model
            llm = LazyLLM(random_model("llama-3.1-8b", "cuda", layers=2), AutoTokenizer.from_pretrained(sys.argv[2]))
            texts = [" ".join(str(i * 7 + j) for j in range(150 + 13 * i)) for i in range(6)]
            LazyIndex.from_texts(texts, sys.argv[1], llm=llm, vectors=False, split=False, kv_dtype="{kv}",
                                 progress=False)
        """)
        res = subprocess.run([sys.executable, "-c", build, str(tmp_path / f"index-{kv}"), tokenizer.name_or_path], env=env,
                             capture_output=True, text=True)
        assert res.returncode == 0, res.stderr[-3000:]
        assert {p.name for p in cache.iterdir()} == compiled, f"the build compiled kernels the child did not ({kv})"
        assert Path(tmp_path / "cal.json").exists()     # the build ran its calibration (its kernels checked too)
        Path(tmp_path / "cal.json").unlink()
