"""The serving benchmark (lazy_rag.bench, `lazy-rag bench`) on a tiny random model: workload
statistics, metrics, the sweep's records for every system, the shared_chunks sweep, presets, plots,
the CLI and its errors. No timing assertions."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from lazy_rag.bench.command import argparse_main, resolve_options, run_command
from lazy_rag.bench.defaults import SYSTEMS
from lazy_rag.bench.metrics import cache_metrics, latency_summary, throughput
from lazy_rag.random_models import random_llm
from lazy_rag.bench.plots import with_series
from lazy_rag.bench.runner import Bench, BenchConfig, run_bench, summary_table
from lazy_rag.bench.workload import WorkloadSpec, arrival_times, make_workload
from lazy_rag.cli import app
from lazy_rag.errors import LazyRagError
from tests.helpers import torch_kernels

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(docs=6, doc_tokens=24, k=2, question_tokens=4, output_tokens=3, requests=5)
CASE_KEYS = {"benchmark", "mode", "device", "model", "rate_rps", "budget_chunks", "budget_fraction", "popularity",
             "zipf_a", "requests", "docs", "doc_tokens", "k", "question_tokens", "output_tokens", "seed",
             "shared_chunks"}
METRIC_KEYS = {f"{m}_{s}" for m in ("ttft_ms", "e2e_ms") for s in ("mean", "p50", "p99")} | {
    "throughput_rps", "output_tokens_per_s", "peak_gpu_mem_gib", "torch", "transformers", "date"}
CACHE_KEYS = {"gpu_hit_ratio", "host_hit_ratio", "disk_hit_ratio", "encoded_ratio", "gpu_chunk_hits",
              "gpu_chunk_misses", "tier_host_hits", "tier_disk_hits", "tier_encoded"}


@pytest.fixture(scope="module")
def llm():
    return random_llm("tiny-llama", "cpu")


@pytest.fixture(scope="module")
def records(llm, tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "tiny.json"
    cfg = BenchConfig(spec=WorkloadSpec(**TINY), rates=(None, 200.0), budgets=(1.0, 0.5), hf_requests=2,
                      page_size=8, max_num_seqs=4)
    with torch_kernels():   # (in Triton's interpreter this sweep took 23 s)
        recs = run_bench(llm, cfg, "random:tiny-llama", out, progress="off")
    return recs, out


# -- workload ---------------------------------------------------------------------------------------
def test_workload_is_seeded_and_uses_no_special_ids(llm):
    from lazy_rag.bench.workload import allowed_token_ids

    vocab = allowed_token_ids(llm)
    assert not set(llm.eos_ids) & set(vocab.tolist()) and 1 not in vocab  # EOS (2) and BOS (1) excluded
    a, b = (make_workload(WorkloadSpec(**TINY, seed=3), vocab) for _ in range(2))
    c = make_workload(WorkloadSpec(**TINY, seed=4), vocab)
    ids = lambda w: [[list(s.content) if hasattr(s, "content") else list(s) for s in r.segments] for r in w.requests]
    assert ids(a) == ids(b) and ids(a) != ids(c)
    r = a.requests[0]
    assert len(r.segments) == 1 + TINY["k"] + 1 and len(set(r.doc_ids)) == TINY["k"]
    assert [s.chunk_id for s in r.segments[1:-1]] == [f"doc{d}" for d in r.doc_ids]
    assert len(r.segments[-1]) == TINY["question_tokens"]
    assert np.array_equal(arrival_times(50, 2.0, 3), arrival_times(50, 2.0, 3))


def test_zipf_concentrates_on_popular_documents_and_uniform_does_not():
    vocab = np.arange(10, 100)
    n, docs = 3000, 20
    counts = {}
    for pop in ("zipf", "uniform"):
        w = make_workload(WorkloadSpec(docs=docs, doc_tokens=1, k=1, question_tokens=1, requests=n, popularity=pop,
                                       zipf_a=2.1, head_tokens=0), vocab)
        counts[pop] = np.bincount([r.doc_ids[0] for r in w.requests], minlength=docs)
    z, u = counts["zipf"], counts["uniform"]
    # Zipf(2.1) over 20 ranks: P(rank 1) = 1 / H(20, 2.1) ~ 0.64, P(rank 2) ~ 0.15
    p1 = 1 / sum(1 / i ** 2.1 for i in range(1, docs + 1))
    assert abs(z[0] / n - p1) < 0.05 and z[0] > z[1] > z[4]
    assert u.max() / n < 0.1 and u.min() > 0  # 1/20 each; generous bound


def test_documents_of_a_request_come_in_random_order():
    w = make_workload(WorkloadSpec(docs=10, doc_tokens=1, k=3, question_tokens=1, requests=400, head_tokens=0),
                      np.arange(10, 100))
    # without the shuffle the most popular document (0) would nearly always come first
    first = sum(r.doc_ids[0] == 0 for r in w.requests if 0 in r.doc_ids)
    has = sum(0 in r.doc_ids for r in w.requests)
    assert 0.2 < first / has < 0.5


def test_arrivals_are_poisson_at_the_requested_rate():
    for rate in (0.5, 4.0):
        t = arrival_times(4000, rate, seed=1)
        gaps = np.diff(np.concatenate([[0.0], t]))
        assert np.all(gaps >= 0)
        assert abs(gaps.mean() - 1 / rate) < 0.1 / rate          # mean gap 1/rate (sd ~1.6% here)
        assert abs(gaps.std() / gaps.mean() - 1) < 0.1             # exponential: coefficient of variation 1
        assert abs(np.mean(gaps < 1 / rate) - (1 - math.exp(-1))) < 0.03
    assert not arrival_times(5, None).any()


# -- metrics ----------------------------------------------------------------------------------------
def test_metrics_math():
    s = latency_summary("ttft_ms", range(1, 101))
    assert s == {"ttft_ms_mean": 50.5, "ttft_ms_p50": 50.5, "ttft_ms_p99": 99.01}
    assert latency_summary("e2e_ms", [])["e2e_ms_p99"] is None
    assert throughput(10, 160, 4.0) == {"throughput_rps": 2.5, "output_tokens_per_s": 40.0}
    c = cache_metrics({"chunk_hits": 6, "chunk_misses": 4, "chunk_from_host": 3, "chunk_from_encoded": 1,
                       "prefix_hit_tokens": 0}, 1000)
    assert (c["gpu_hit_ratio"], c["host_hit_ratio"], c["disk_hit_ratio"], c["encoded_ratio"]) == (0.6, 0.3, 0.0, 0.1)
    assert cache_metrics({}, 10)["gpu_hit_ratio"] is None
    assert cache_metrics({"prefix_hit_tokens": 250}, 1000)["prefix_hit_ratio"] == 0.25


# -- the sweep --------------------------------------------------------------------------------------
def test_runner_records_every_system_flat_with_required_keys(records):
    recs, path = records
    assert json.loads(path.read_text()) == recs
    # 2 budgets x 2 rates x 4 engine modes + transformers once per rate
    assert len(recs) == 2 * 2 * 4 + 2
    assert {r["mode"] for r in recs} == set(SYSTEMS)
    for r in recs:
        assert all(not isinstance(v, (dict, list)) for v in r.values()), r
        missing = (CASE_KEYS | METRIC_KEYS) - set(r)
        assert not missing, (r["mode"], missing)
        assert r["benchmark"] == "serving" and r["rate_rps"] in ("offline", 200.0)
        assert r["requests"] == (2 if r["mode"] == "transformers" else TINY["requests"])
        assert 0 < r["ttft_ms_p50"] <= r["e2e_ms_p50"] and r["ttft_ms_mean"] <= r["e2e_ms_mean"]
        assert r["throughput_rps"] > 0 and 0 < r["output_tokens_per_s"] <= r["throughput_rps"] * 3 * 1.001
        assert r["peak_gpu_mem_gib"] is None  # CPU
        if r["mode"] == "transformers":
            assert r["budget_chunks"] is None and r["budget_fraction"] is None and r["shared_chunks"] is None
        else:
            assert r["shared_chunks"] == "auto"  # the engine's default: one run per point, as before
            assert r["budget_chunks"] in (6, 3) and r["budget_fraction"] == r["budget_chunks"] / 6
            # the engine's step timers: every request was prefilled and decoded inside the wall time
            assert 0 < r["engine_schedule_s"] and 0 < r["engine_prefill_steps_s"] and 0 < r["engine_decode_steps_s"]
            assert r["engine_schedule_s"] + r["engine_prefill_steps_s"] + r["engine_decode_steps_s"] <= r["wall_s"]
    for r in recs:
        if r["mode"] in ("lazy", "block"):
            assert not CACHE_KEYS - set(r)
            # every document was encoded by the warm-up: the pool misses come from the host tier
            assert r["encoded_ratio"] == 0 and r["tier_encoded"] == 0
            total = r["gpu_hit_ratio"] + r["host_hit_ratio"] + r["disk_hit_ratio"] + r["encoded_ratio"]
            assert abs(total - 1) < 1e-3 and r["chunk_lookups"] == TINY["requests"] * TINY["k"]
        if r["mode"] in ("prefix", "full"):
            assert r["gpu_hit_ratio"] is None


def test_shared_chunks_sweep_runs_lazy_per_value_and_other_modes_once(llm):
    cfg = BenchConfig(spec=WorkloadSpec(**TINY), rates=(None,), budgets=(1.0,), systems=("lazy", "block", "full"),
                      shared_chunks=("auto", "off"), page_size=8, max_num_seqs=4)
    recs = run_bench(llm, cfg, "random:tiny-llama", progress="off")
    # side by side in sweep order; block and full share no chunk pages: once, with the first value
    assert [(r["mode"], r["shared_chunks"]) for r in recs] == [("lazy", "auto"), ("lazy", "off"), ("block", "auto"),
                                                             ("full", "auto")]
    for r in recs:
        assert r["output_tokens_per_s"] > 0 and r["requests"] == TINY["requests"]
    table = summary_table(recs)
    assert "shared_chunks" in table.splitlines()[0] and "output_tokens_per_s" in table.splitlines()[0]
    assert [" ".join(line.split()[:2]) for line in table.splitlines()[1:]] == ["lazy auto", "lazy off", "block auto",
                                                                              "full auto"]
    # the plots draw lazy with and without grouping as two lines, the others under their mode
    assert [r["series"] for r in with_series(recs)] == ["lazy[auto]", "lazy[off]", "block", "full"]


def test_the_warm_up_encodes_documents_only_for_a_chunk_reuse_system(llm):
    """full and prefix never read the host tier: encoding every document ahead for them is time
    (minutes for a 12B model) the sweep spends for nothing."""
    said = []
    for systems, encoded in [(("full", "prefix"), False), (("full", "lazy"), True)]:
        cfg = BenchConfig(spec=WorkloadSpec(**TINY), rates=(None,), budgets=(1.0,), systems=systems, page_size=8,
                          max_num_seqs=4)
        bench = Bench(llm, cfg, "random:tiny-llama", progress="off")
        with torch_kernels():
            bench.warm_up(said.append)
        assert (bench.tiers.host.bytes > 0) == encoded, systems
    assert "no document encoded" in said[0] and f"{TINY['docs']} documents encoded" in said[1]


def test_plots_are_written(records, tmp_path):
    pytest.importorskip("matplotlib")
    from lazy_rag.bench.plots import plot_results

    paths = plot_results(records[0], tmp_path, "tiny")
    assert sorted(p.name for p in paths) == ["tiny_hit_ratio_vs_budget.png", "tiny_throughput_vs_budget.png",
                                             "tiny_ttft_vs_rate.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000


# -- command line -----------------------------------------------------------------------------------
TINY_CLI = ["--random-weights", "tiny-llama", "--device", "cpu", "--docs", "4", "--doc-tokens", "16", "--k", "2",
            "--question-tokens", "4", "--output-tokens", "2", "--requests", "3", "--hf-requests", "1",
            "--rates", "offline", "--budgets", "1.0", "--page-size", "8", "--progress", "off"]


def test_cli_bench_smoke_and_plot(tmp_path):
    runner = CliRunner()
    res = runner.invoke(app, ["bench", *TINY_CLI, "--results-dir", str(tmp_path), "--out", "smoke", "--no-plots"])
    assert res.exit_code == 0, res.output
    recs = json.loads((tmp_path / "smoke.json").read_text())
    assert [r["mode"] for r in recs] == list(SYSTEMS)
    assert "ttft_ms_p50" in res.output and "transformers" in res.output  # the summary table
    pytest.importorskip("matplotlib")
    res = runner.invoke(app, ["bench", "plot", str(tmp_path / "smoke.json")])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "smoke_throughput_vs_budget.png").exists()


PRESET_KEYS = ("model", "random_weights", "docs", "doc_tokens", "k", "question_tokens", "output_tokens", "requests",
               "hf_requests", "popularity", "zipf_a", "rates", "budgets", "systems", "shared_chunks", "max_num_seqs",
               "out")


def resolved(device, preset=None, **given):
    return resolve_options(device, preset, **({k: None for k in PRESET_KEYS} | given))


def test_decode_shared_preset_values_per_device():
    gpu = resolved("cuda", "decode-shared")
    assert {k: gpu[k] for k in PRESET_KEYS} == dict(
        model=None, random_weights="llama-3.1-8b", docs=100, doc_tokens=2048, k=5, question_tokens=32,
        output_tokens=256, requests=256, hf_requests=20, popularity="zipf", zipf_a=2.1, rates="offline",
        budgets="0.25", systems="lazy,block", shared_chunks="auto,off", max_num_seqs=128, out="decode_shared_gpu")
    cpu = resolved("cpu", "decode-shared")
    assert (cpu["model"], cpu["random_weights"], cpu["docs"], cpu["doc_tokens"], cpu["k"], cpu["output_tokens"],
            cpu["requests"], cpu["max_num_seqs"]) == ("smollm2", None, 20, 128, 4, 32, 16, 16)
    assert (cpu["rates"], cpu["budgets"], cpu["systems"], cpu["shared_chunks"], cpu["popularity"]) == (
        "offline", "0.25", "lazy,block", "auto,off", "zipf")
    for dev in ("cuda", "cpu"):
        uniform = resolved(dev, "decode-shared-uniform")
        assert uniform["popularity"] == "uniform" and uniform["out"] != resolved(dev, "decode-shared")["out"]
        assert uniform | {"popularity": "zipf", "out": None} == resolved(dev, "decode-shared") | {"out": None}
    # no preset: the sweep of before (every system, the engine's default shared_chunks only)
    plain = resolved("cpu")
    assert plain["systems"] == ",".join(SYSTEMS) and plain["shared_chunks"] == "auto" and plain["budgets"] == "1.0,0.2"


def test_explicit_options_override_the_preset():
    o = resolved("cuda", "decode-shared", docs=7, popularity="uniform", shared_chunks="on", random_weights="tiny-llama")
    assert (o["docs"], o["popularity"], o["shared_chunks"]) == (7, "uniform", "on")
    assert o["model"] is None and o["random_weights"] == "tiny-llama"  # a given model replaces the preset's
    assert o["output_tokens"] == 256 and o["budgets"] == "0.25"        # the rest stays the preset's
    assert resolved("cpu", "decode-shared", model="tiny.gguf")["random_weights"] is None


def test_cli_bench_preset_runs_lazy_with_and_without_grouping_beside_block(tmp_path):
    res = CliRunner().invoke(app, ["bench", "--preset", "decode-shared", "--random-weights", "tiny-llama", "--device",
                                   "cpu", "--docs", "6", "--doc-tokens", "16", "--k", "2", "--question-tokens", "4",
                                   "--output-tokens", "3", "--requests", "4", "--max-num-seqs", "4", "--page-size",
                                   "8", "--progress", "off", "--no-plots", "--results-dir", str(tmp_path)])
    assert res.exit_code == 0, res.output
    recs = json.loads((tmp_path / "decode_shared_cpu.json").read_text())  # the preset's results name
    assert [(r["mode"], r["shared_chunks"]) for r in recs] == [("lazy", "auto"), ("lazy", "off"), ("block", "auto")]
    for r in recs:
        assert (r["rate_rps"], r["popularity"], r["zipf_a"], r["budget_chunks"]) == ("offline", "zipf", 2.1, 2)
        assert (r["docs"], r["output_tokens"], r["requests"], r["max_num_seqs"]) == (6, 3, 4, 4)  # given: they win


def test_serving_script_rejects_an_unknown_preset(capsys):
    assert argparse_main(["--preset", "decode-sharded", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "Unknown --preset 'decode-sharded'" in err and "decode-shared, decode-shared-uniform" in err


@pytest.mark.parametrize("args, message", [
    (["--k", "9"], "--k 9 exceeds --docs 4"),
    (["--budgets", "1.5"], "outside (0, 1]"),
    (["--budgets", "0.25"], "block mode"),
    (["--rates", "fast"], "--rates: 'fast'"),
    (["--systems", "lazy,vllm"], "Unknown system 'vllm'"),
    (["--popularity", "pareto"], "Unknown --popularity"),
    (["--random-weights", "gpt-5"], "Unknown random architecture 'gpt-5'"),
    (["--model", "smollm2"], "either --model or --random-weights"),
    (["--shared-chunks", "auto,sometimes"], "Unknown --shared-chunks value 'sometimes'"),
    (["--shared-chunks", ","], "--shared-chunks is empty"),
    (["--preset", "decode"], "Unknown --preset 'decode'; choose one of decode-shared, decode-shared-uniform"),
])
def test_cli_bench_bad_input_names_the_option(tmp_path, args, message):
    res = CliRunner().invoke(app, ["bench", *TINY_CLI, "--results-dir", str(tmp_path), *args])
    assert res.exit_code == 2, res.output
    assert message in " ".join(res.output.split()), res.output


def test_bench_core_runs_without_optional_libraries(tmp_path):
    """benchmarks/serving.py with typer, rich, matplotlib, faiss, llama-index and langchain unimportable
    (the GPU image): the run completes and says how to make the plots later."""
    blocked = ["typer", "rich", "matplotlib", "faiss", "llama_index", "langchain_core", "langchain"]
    code = ("import runpy, sys\n"
            f"for m in {blocked!r}: sys.modules[m] = None\n"
            f"sys.path.insert(0, {str(ROOT / 'benchmarks')!r})\n"
            f"sys.argv = ['serving.py', *{TINY_CLI!r}, '--systems', 'lazy,transformers', '--results-dir', "
            f"{str(tmp_path)!r}, '--out', 'core']\n"
            f"runpy.run_path({str(ROOT / 'benchmarks' / 'serving.py')!r}, run_name='__main__')\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert res.returncode == 0, res.stderr[-3000:]
    assert [r["mode"] for r in json.loads((tmp_path / "core.json").read_text())] == ["lazy", "transformers"]
    assert "pip install matplotlib" in res.stderr


def test_run_command_rejects_a_bad_out_name(tmp_path):
    with pytest.raises(LazyRagError, match="plain name"):
        run_command(random_weights="tiny-llama", device="cpu", docs=4, doc_tokens=8, k=2, requests=2,
                    rates="offline", budgets="1.0", out="a/b", results_dir=tmp_path, plots=False)


def test_a_kept_write_probe_holds_its_blocks_until_the_caller_deletes_it(tmp_path):
    """``write_bandwidth(keep=True)`` (index_build.py --probe-first: the probe's blocks held
    while the build writes others) leaves its file of the bytes it wrote; by default none."""
    from lazy_rag.bench.disk import write_bandwidth

    assert write_bandwidth(tmp_path, nbytes=3 << 20, block=1 << 20, start_writeback=True) > 0
    assert not list(tmp_path.iterdir())
    assert write_bandwidth(tmp_path, nbytes=3 << 20, block=1 << 20, keep=True) > 0
    (probe,) = tmp_path.iterdir()
    assert probe.stat().st_size == 3 << 20


def test_a_probe_before_a_build_writes_the_builds_bytes_when_both_fit_else_what_fits():
    """index_build.py --probe-first (and --bracket's two probes): the same bytes as the build when
    the probes and the build fit in the free space with the margin; fewer when they do not; none
    below the minimum."""
    from lazy_rag.bench.disk import probe_first_bytes

    G = 10 ** 9
    assert probe_first_bytes(20 * G, 68 * G) == 20 * G
    fits = probe_first_bytes(39 * G, 68 * G)
    assert 4 << 30 <= fits < 39 * G
    assert fits + 39 * G + (3 << 30) <= 68 * G / 1.05
    assert probe_first_bytes(40 * G, 45 * G) == 0
    assert probe_first_bytes(0, 68 * G) == 0
    # --bracket: two probes kept beside the build
    assert probe_first_bytes(19 * G, 68 * G, probes=2) == 19 * G
    two = probe_first_bytes(25 * G, 68 * G, probes=2)
    assert 4 << 30 <= two < 25 * G and 2 * two + 25 * G + (3 << 30) <= 68 * G / 1.05


def test_the_paper_request_has_the_papers_sizes_and_is_the_same_every_run():
    from lazy_rag.bench.paper_request import PaperRequests
    from lazy_rag.segments import Chunk

    a, b = PaperRequests(seed=3), PaperRequests(seed=3)
    segs = a.prompt()
    chunks = [s for s in segs if isinstance(s, Chunk)]
    assert len(chunks) == 5 and all(len(c.content) == 2048 for c in chunks)
    assert sum(len(s.content) if isinstance(s, Chunk) else len(s) for s in segs) == 10322
    assert [s.content if isinstance(s, Chunk) else s for s in segs] == \
           [s.content if isinstance(s, Chunk) else s for s in b.prompt()]
    assert PaperRequests(seed=4).pool != a.pool


def test_profiled_kernels_split_by_kind_all_reduces_only_where_asked():
    from lazy_rag.bench.roofline import kernel_class

    assert kernel_class("_prefill_runs_kernel") == kernel_class("_merge_kernel") == "attention_ms"
    assert kernel_class("nvjet_sm90_tst_128x96_64x7_4x1_v_bz_TNT") == "matmul_ms"
    nccl = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
    assert kernel_class(nccl) == "other_kernels_ms"   # the single-process profiles' four fields
    assert kernel_class(nccl, all_reduces=True) == "all_reduce_ms"
    assert kernel_class("ncclDevKernel_AllGather_RING_LL", all_reduces=True) == "other_kernels_ms"
