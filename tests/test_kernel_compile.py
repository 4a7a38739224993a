"""lazy-rag compile: a model's GPU kernels compiled into Triton's cache from its config alone, on a
one-layer model, so that a machine's first build and query find them there."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from typer.testing import CliRunner

from lazy_rag.random_models import random_config
from lazy_rag.cli import app
from lazy_rag.engine.read_or_encode import CALIBRATION_ENV
from lazy_rag.errors import LazyRagError
from lazy_rag.kernel_compile import (COMPILE_VOCAB, _NumberTokenizer,
                                     compiled_variants, one_layer_config, one_layer_model, parse_kv_dtypes, run_steps)
from lazy_rag.kernels import FP8
from lazy_rag.llm import LazyLLM


def test_the_one_layer_model_has_the_models_attention():
    from transformers import Qwen2Config

    from tiny_models import tiny_model

    qwen = Qwen2Config(**{**random_config("qwen2.5-0.5b").to_dict(), "pad_token_id": 151643})
    gemma2 = tiny_model("gemma2", seed=0, hidden_size=128).config   # global and sliding layers
    two = one_layer_config(gemma2)
    assert two.layer_types == ["full_attention", "sliding_attention"] and two.num_hidden_layers == 2
    assert (two.sliding_window, two.attn_logit_softcapping) == (gemma2.sliding_window, gemma2.attn_logit_softcapping)
    for cfg in (random_config("llama-3.1-8b"), qwen):
        one = one_layer_config(cfg)
        assert one.num_hidden_layers == 1 and one.vocab_size == COMPILE_VOCAB and one.pad_token_id is None
        for key in ("hidden_size", "num_attention_heads", "num_key_value_heads", "rope_parameters", "model_type",
                    "head_dim"):
            assert getattr(one, key, None) == getattr(cfg, key, None), key
        assert cfg.num_hidden_layers > 1    # the model's own config is left as it was
        if getattr(cfg, "layer_types", None):
            assert one.layer_types == cfg.layer_types[:1]


def test_kv_dtypes_are_named_as_index_names_them():
    assert parse_kv_dtypes("auto,fp8", torch.bfloat16) == [torch.bfloat16, FP8]
    assert parse_kv_dtypes("bf16, auto ,bfloat16", torch.bfloat16) == [torch.bfloat16]
    assert parse_kv_dtypes("fp32", torch.bfloat16) == [torch.float32]
    assert parse_kv_dtypes("int4,bf16", torch.bfloat16) == [torch.bfloat16]  # int4 stores, the pool holds bf16
    with pytest.raises(LazyRagError, match=r"'int2' in --kv-dtype 'fp8,int2'.*auto,fp8"):
        parse_kv_dtypes("fp8,int2", torch.bfloat16)
    with pytest.raises(LazyRagError, match="names no KV dtype"):
        parse_kv_dtypes(" , ", torch.bfloat16)


def test_the_steps_run_a_builds_encodes_its_calibration_and_queries_and_keep_no_fit(tmp_path, monkeypatch):
    """The steps end to end on the CPU (torch's kernels here; on CUDA, Triton's: the GPU test
    below): each stored KV dtype's encode, the calibration, a query in each pool dtype. The
    calibration runs, but its one-layer fit is neither kept nor read, and the setting is restored."""
    kept = tmp_path / "calibration.json"
    monkeypatch.setenv(CALIBRATION_ENV, str(kept))
    model = one_layer_model(random_config("tiny-llama"), "cpu", torch.float32)
    llm = LazyLLM(model, _NumberTokenizer(), kv_bytes=1 << 26)
    ran = []

    def step(name, fn):
        ran.append(name)
        assert os.environ[CALIBRATION_ENV] == "off"
        fn()

    sweep = dict(contexts=(1, 3), encoded=(2,), questions=(8, 40, 72), short_long=(8, 72))   # (the CPU's time)
    run_steps(llm, [torch.float32, FP8], step, **sweep)
    assert ran == ["build, fp32 KV", "build, fp8 KV", "build encode calibration",
                   "query, fp32 KV into fp32 pages", "query, fp8 KV into fp32 pages", "16 queries at once, fp32 pages",
                   "query, fp32 KV into fp8 pages", "query, fp8 KV into fp8 pages", "16 queries at once, fp8 pages"]
    assert llm.engine.planner.chooser.calibrated     # measured,
    assert not kept.exists() and os.environ[CALIBRATION_ENV] == str(kept)   # not kept
    stats = llm.stats()     # per index: each context's chunks read per question, then again before a warm query
    reads = sum(sweep["contexts"]) * (len(sweep["questions"]) + len(sweep["short_long"]))
    # then the batch reads its index's first chunks once more: the fp8 index's host copies of the
    # same passages are not the fp32 index's KV
    assert stats["tier_disk_hits"] == 2 * reads + min(4, max(sweep["contexts"]))
    # (the fp8 index's chunks are always read: stored quantised KV is never encoded again instead)
    assert stats["tier_recomputed_not_read"] == sum(sweep["encoded"]) * len(sweep["short_long"])
    assert stats["chunk_hits"] >= 2 * sum(sweep["contexts"]) * len(sweep["short_long"])
    assert stats["requests_running"] == 0


def test_a_variant_counts_as_compiled_when_it_adds_to_the_cache_on_disk(tmp_path, monkeypatch):
    """compiled_variants through Triton's jit hooks, called here as Triton calls them around a
    compile: a launch whose compile wrote a cache entry is named with its options, upper-case
    constexprs and value specialisations, one loaded from the cache is not; hooks set before are
    chained and put back."""
    import triton
    from types import SimpleNamespace

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    rt = triton.knobs.runtime
    seen = []
    monkeypatch.setattr(rt, "jit_cache_hook", lambda **kw: seen.append("ahead") or False)
    monkeypatch.setattr(rt, "jit_post_compile_hook", lambda **kw: seen.append("after"))
    fn = SimpleNamespace(name="_kern", jit_function=SimpleNamespace(
        params=[SimpleNamespace(name=n) for n in ("X", "n", "BLOCK", "DIRECT")]))
    compile = {"constants": {(1,): 1, (2,): 64, (3,): False}, "num_warps": 8, "num_stages": 2,
               "configs": [{(0,): [["tt.divisibility", 16]]}]}
    with compiled_variants() as found:
        for key, writes in (("a", True), ("b", False)):
            assert rt.jit_cache_hook(key=key, repr="", fn=fn, compile=compile, is_manual_warmup=False,
                                     already_compiled=False) is False
            if writes:
                (tmp_path / "ENTRY").mkdir()
            rt.jit_post_compile_hook(key=key, repr="", fn=fn, compile=compile, is_manual_warmup=False,
                                     already_compiled=False)
    assert found == ["_kern[warps 8, stages 2](BLOCK=64, DIRECT=False; =1: n; /16: X)"]
    assert seen == ["ahead", "after"] * 2
    rt.jit_cache_hook(key="c")
    assert seen[-1] == "ahead"      # the previous hook is back


def test_an_unwritable_triton_cache_is_refused_with_the_fix(tmp_path, monkeypatch):
    from lazy_rag.kernel_compile import writable_cache_dir

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    assert writable_cache_dir() == tmp_path / "cache" and (tmp_path / "cache").is_dir()
    assert not list((tmp_path / "cache").iterdir())     # its probe file removed
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "file" / "cache"))
    with pytest.raises(LazyRagError, match=r"file/cache cannot be written .*set TRITON_CACHE_DIR to a writable"):
        writable_cache_dir()


def test_a_failing_step_raises_instead_of_leaving_the_build_to_compile():
    model = one_layer_model(random_config("tiny-llama"), "cpu", torch.float32)
    llm = LazyLLM(model, _NumberTokenizer(), kv_bytes=1 << 26)

    def broken(*a, **k):
        raise RuntimeError("no kernel for this shape")

    llm.engine.encode_chunks = broken
    with pytest.raises(RuntimeError, match="no kernel for this shape"):
        run_steps(llm, [torch.float32])


def test_the_command_says_there_is_nothing_to_compile_on_a_cpu():
    res = CliRunner().invoke(app, ["compile", "--model", "random:tiny-llama", "--device", "cpu"])
    assert res.exit_code == 2
    assert "Nothing to compile on 'cpu'" in res.output and "GPU" in res.output
    res = CliRunner().invoke(app, ["compile", "--model", "no-such-model", "--device", "cpu"])
    assert res.exit_code == 2 and "Nothing to compile" in res.output   # the device is checked before the model


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_the_command_refuses_cuda_where_torch_sees_no_gpu():
    res = CliRunner().invoke(app, ["compile", "--model", "random:tiny-llama", "--device", "cuda"])
    assert res.exit_code == 2 and "sees no CUDA GPU" in res.output


BUILD_AND_QUERY = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from transformers import AutoTokenizer
    from lazy_rag import LazyIndex, LazyLLM
    from lazy_rag.random_models import random_model
    from lazy_rag.kernel_compile import compiled_variants

    out, tok, kv = Path(sys.argv[1]), AutoTokenizer.from_pretrained(sys.argv[2]), sys.argv[3]
    llm = LazyLLM(random_model("llama-3.1-8b", "cuda", layers=2), tok)
    texts = [" ".join(str(i * 7 + j) for j in range(150 + 13 * i)) for i in range(6)]
    with compiled_variants() as in_build:
        idx = LazyIndex.from_texts(texts, out, llm=llm, vectors=False, split=False, kv_dtype=kv, progress=False)
    ids = [idx.records.row(int(r)).id for r in idx.records.rowids()[:3]]
    with compiled_variants() as in_queries:   # a cold query, then a warm one
        for _ in range(2):
            llm.generate(idx.segments("what is 7 times 13?", ids), max_new_tokens=6, source=idx.chunk_source)
    print(json.dumps([in_build, in_queries]))
""")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton's kernels compile on CUDA only")
def test_compiled_kernels_are_the_ones_a_build_of_the_full_model_runs(tmp_path, tokenizer):
    """With an empty Triton cache, `lazy-rag compile` compiles from the 8B config; a build of the
    model (two layers, its own weights) in a fresh process then compiles nothing: every kernel it
    runs, its calibration's included, comes from the cache."""
    cache = tmp_path / "triton"
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache), CALIBRATION_ENV: str(tmp_path / "cal.json")}
    res = subprocess.run([sys.executable, "-m", "lazy_rag.cli", "compile", "--model", "random:llama-3.1-8b", "--list"],
                         env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    compile_log = res.stderr
    assert "new Triton cache entries" in res.stdout and str(cache) in res.stdout
    compiled = {p.name for p in cache.iterdir()}
    assert compiled and not (tmp_path / "cal.json").exists()     # compiled, no one-layer fit kept
    for kv in ("bf16", "fp8"):
        res = subprocess.run([sys.executable, "-c", BUILD_AND_QUERY, str(tmp_path / f"index-{kv}"),
                              tokenizer.name_or_path, kv], env=env, capture_output=True, text=True)
        assert res.returncode == 0, res.stderr[-3000:]
        in_build, in_queries = json.loads(res.stdout.strip().splitlines()[-1])
        assert not in_build, f"the {kv} build compiled kernels `lazy-rag compile` did not: {in_build}\n{compile_log}"
        assert not in_queries, f"queries after the {kv} build compiled kernels: {in_queries}\n{compile_log}"
        assert (tmp_path / "cal.json").exists()     # the build ran its calibration (its kernels checked too)
        (tmp_path / "cal.json").unlink()


def test_triton_setup_starts_once_per_process_on_cuda_only_and_is_waited_for(monkeypatch):
    """kernels.compiler_setup: Triton's own cache key computed on one thread, begun at the model's
    load on a CUDA device (never on a CPU), and joined by the first launch on CUDA (the kernels'
    dispatch rule, use_triton), never by a CPU one."""
    import threading
    from types import SimpleNamespace

    from lazy_rag.kernels import compiler_setup
    from lazy_rag.kernels.page_table import interpreting, use_triton

    release, calls = threading.Event(), []
    monkeypatch.setattr(compiler_setup, "_thread", None)
    monkeypatch.setattr(compiler_setup, "_done", False)
    monkeypatch.setattr(compiler_setup, "_set_up", lambda: calls.append(release.wait(5)))
    compiler_setup.wait()                       # none begun: returns at once
    compiler_setup.start("cpu")
    assert compiler_setup._thread is None
    compiler_setup.start(torch.device("cuda"))
    compiler_setup.start("cuda:0")              # once per process
    first = compiler_setup._thread
    assert first is not None and first.is_alive() and calls == []
    assert use_triton(torch.zeros(1)) == interpreting()   # a CPU launch does not wait for it
    assert first.is_alive() and calls == []
    release.set()
    assert use_triton(SimpleNamespace(is_cuda=True))      # a CUDA launch joins it
    assert calls == [True] and not first.is_alive() and compiler_setup._done


def test_the_real_triton_setup_computes_tritons_cache_key():
    from triton.runtime.cache import triton_key

    from lazy_rag.kernels import compiler_setup

    triton_key.cache_clear()
    compiler_setup._set_up()
    assert triton_key.cache_info().currsize == 1


def test_the_per_split_counts_are_not_specialised_on_their_value():
    """The attention kernels' per-split counts follow the context's length; specialised (divisible
    by 16, equal to 1) each length class compiled a variant of its own, which a machine's first
    build then compiled in its first batch after `lazy-rag compile`. Read from the compiled
    (not interpreted) kernels, in a process without TRITON_INTERPRET."""
    import json
    import os
    import subprocess
    import sys

    code = ("import json; from lazy_rag.kernels import paged_attention as a, prefill_runs as r, shared_chunks as s\n"
            "ks = {'runs': r._prefill_runs_kernel, 'tiles': a._paged_attn_kernel, 'merge': a._merge_kernel,\n"
            "      'shared': s._shared_chunk_kernel, 'merge_shared': s._merge_shared_kernel}\n"
            "print(json.dumps({n: [p.name for p in k.params if p.do_not_specialize] for n, k in ks.items()}))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert json.loads(out.strip().splitlines()[-1]) == {
        "runs": ["entries_per_split"], "tiles": ["tiles_per_split"], "merge": ["num_splits"],
        "shared": ["tiles_per_split"], "merge_shared": ["num_splits"]}
