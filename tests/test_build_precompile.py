"""build_precompile: a new index's encode kernel compiled from the model's config (a one-layer
model of it) while the build loads the weights; the build's own warm-up waits for it."""
import json
import subprocess
import sys
import textwrap
import time
from types import SimpleNamespace

import pytest
import torch

from lazy_rag import build_precompile
from lazy_rag.bench.random_models import random_config
from lazy_rag.build_pipeline import EncodeWarmup


def test_the_one_layer_model_has_the_models_attention():
    from transformers import Qwen2Config

    for cfg in (random_config("llama-3.1-8b"), Qwen2Config(**{**random_config("qwen2.5-0.5b").to_dict(),
                                                            "pad_token_id": 151643})):
        one = build_precompile.one_layer_config(cfg)
        assert (one.num_hidden_layers, one.vocab_size, one.intermediate_size, one.pad_token_id) == \
            (1, build_precompile.VOCAB, build_precompile.INTERMEDIATE, None)
        for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "rope_parameters", "model_type",
                    "head_dim"):
            assert getattr(one, key, None) == getattr(cfg, key, None), key
        assert cfg.num_hidden_layers > 1    # the model's own config is left as it was
        if getattr(cfg, "layer_types", None):
            assert one.layer_types == cfg.layer_types[:1]


def test_a_warmup_waits_for_the_one_it_comes_after():
    """The build's warm-up waits for the warm-up from the config before it encodes: one kernel is
    never compiled by two threads at once."""
    order = []

    class Before:
        def wait(self):
            time.sleep(0.2)
            order.append("before")
            return 0.2

    class Engine:
        def encode_chunks(self, chunks, prefix, wrapper, cache=True, quantize=False, host_alloc=None):
            order.append("encode")

    w = EncodeWarmup(SimpleNamespace(engine=Engine(), device=torch.device("cuda")), (), None, torch.bfloat16,
                     after=Before(), thread_name="t")
    w.wait()
    assert order == ["before", "encode"] and w.after_wait_s >= 0.2 and w.thread.name == "t"


def test_no_warmup_off_cuda_or_when_turned_off(monkeypatch):
    cfg = random_config("tiny-llama")
    assert build_precompile.warm_from_config(cfg, dtype=torch.float32, kv_dtype=torch.float32, device="cpu") is None
    assert build_precompile.warm_for_pretrained("smollm2", device="cpu") is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert build_precompile.wanted("cuda")
    monkeypatch.setenv(build_precompile.ENV, "off")
    assert not build_precompile.wanted("cuda")


def test_the_warmup_from_a_config_encodes_on_a_one_layer_model(monkeypatch, caplog):
    """On the CPU here (a CUDA build's path, its kernels torch's): the one-layer model is built
    from the config, its engine's pool is small, the warm-up runs on its own thread; a config
    that cannot be built is logged, not raised."""
    monkeypatch.setattr(build_precompile, "wanted", lambda device: True)
    w = build_precompile.warm_from_config(random_config("tiny-llama"), dtype=torch.float32,
                                          kv_dtype=torch.float8_e4m3fn, device="cpu", prefix_tokens=5)
    assert w is not None and w.thread.name == build_precompile.THREAD
    assert w.wait() > 0 and w.error is None
    broken = random_config("tiny-llama")
    broken.num_attention_heads = 3   # hidden 128 is not a multiple of 3 heads
    with caplog.at_level("WARNING"):
        assert build_precompile.warm_from_config(broken, dtype=torch.float32, kv_dtype=torch.float32,
                                                 device="cpu") is None
    assert "Could not start compiling the build's kernels" in caplog.text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton's kernels compile on CUDA only")
def test_a_new_index_compiles_its_encode_kernel_from_the_config_while_the_model_loads(tmp_path, tokenizer):
    """A build by model name (``LazyIndex.from_texts(model=...)``), in a fresh process with an empty Triton cache: the
    encode kernel compiles on the precompile's thread, and the build's own warm-up and batches
    compile no variant of it (Triton's JIT hook sees every kernel that was not in memory)."""
    from transformers import AutoModelForCausalLM

    cfg = random_config("tiny-llama")
    cfg.vocab_size = len(tokenizer)
    ckpt = tmp_path / "model"
    AutoModelForCausalLM.from_config(cfg).save_pretrained(ckpt)
    tokenizer.save_pretrained(ckpt)
    texts = [" ".join(f"word{i * 7 + j}" for j in range(100 + 13 * i)) for i in range(6)]
    script = textwrap.dedent("""
        import json, sys, threading
        import triton
        from lazy_rag import LazyIndex
        seen = []
        def hook(*, fn, **kw):
            seen.append([fn.name, threading.current_thread().name])
            return False
        triton.knobs.runtime.jit_cache_hook = hook
        idx = LazyIndex.from_texts(json.loads(sys.argv[1]), sys.argv[2], model=sys.argv[3], device="cuda",
                                   kv_dtype=sys.argv[4], split=False, vectors=False, progress=False)
        print("RESULT " + json.dumps({"seen": seen, "stages": idx.build_report.stages}))
    """)
    for kv in ("bf16", "fp8"):
        env = {"TRITON_CACHE_DIR": str(tmp_path / f"triton-{kv}"), "LAZY_RAG_CALIBRATION": "off"}
        res = subprocess.run([sys.executable, "-c", script, json.dumps(texts), str(tmp_path / f"index-{kv}"), str(ckpt), kv],
                             env={**__import__("os").environ, **env}, capture_output=True, text=True)
        assert res.returncode == 0, res.stderr[-3000:]
        out = json.loads(next(ln for ln in res.stdout.splitlines() if ln.startswith("RESULT "))[len("RESULT "):])
        encode = [thread for name, thread in out["seen"] if name == "_prefill_runs_kernel"]
        assert encode and set(encode) == {build_precompile.THREAD}, (kv, out["seen"])
        assert out["stages"]["precompile_s"] > 0 and "precompile_wait_s" in out["stages"]
