"""Soak of the engine, with figures: thousands of random requests over a tight page pool, with
client aborts and injected faults, every finished answer checked against its uninterrupted
greedy answer; page leaks, the host tier's byte bound and the process's memory checked.

The soak is the one the tests run (lazy_rag/bench/soak.py, imported, not copied): requests are
drawn from a set of distinct random RAG-shaped requests (a head, 3 of the shared chunks, a
tail) in a random mode (lazy, block, prefix, full); a share get a fault (an exception or out of
memory while preparing, an exception in a forward after the first token, a disk store that
raises, a prompt larger than the pool), a share of the rest are closed by their client after
their first piece or while queued. Each distinct request's uninterrupted answer comes from a
roomy engine serving it alone. Memory: the resident set size sampled every ``--sample-s``
seconds by a thread (psutil, else /proc/self/status), and the kernel's high-water mark
(VmHWM). "RSS growth" compares the end of the run with the end of its first tenth, when the
pool, the host tier and the allocator have reached their working size.

Default: the tiny llama-shaped model of the tests (``random_models``' "tiny-smollm2": random
weights, hidden 128, 2 layers, SmolLM2's tokenizer), 5,000 requests, a 40-page pool of 4-token
pages: about a minute on 2 CPU cores.
``--model smollm2``: the real bundled model, with its bundled chunk wrapper (~15x slower per
request; its wrapped chunks need a larger pool: --pages 80).

``--device cuda``: the same soak through the engine's CUDA path (Triton kernels, CUDA-graph
decode); GPU memory is checked too (allocated bytes at the end against the end of the first
tenth, and the peak). A machine without the bundled model wheels takes the tokenizer from a
folder (``--tokenizer``, or $LAZY_RAG_TEST_TOKENIZER as for tests/gpu_parity.sh).

    python benchmarks/reliability_soak.py          # adds a record to benchmarks/results/reliability_soak.json
    python benchmarks/reliability_soak.py --model smollm2 --requests 1000 --distinct 60 --pages 80
    python benchmarks/reliability_soak.py --device cuda --tokenizer .gpu/tokenizer
"""
import argparse
import json
import os
import platform
import random
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

from lazy_rag import LazyLLM  # noqa: E402
from lazy_rag.engine import Engine, EngineConfig  # noqa: E402
from lazy_rag.segments import Chunk  # noqa: E402
from lazy_rag.bench.soak import (chunk_workload, page_leaks, run_soak, uninterrupted_tokens,  # noqa: E402
                                 with_random_modes)
from lazy_rag.random_models import random_model  # noqa: E402


def rss_bytes() -> int:
    """The process's resident set size now."""
    try:
        import psutil

        return psutil.Process().memory_info().rss
    except ImportError:
        return _proc_status_kib("VmRSS") * 1024


def peak_rss_bytes() -> int:
    """The kernel's high-water mark of the resident set (the whole process life)."""
    return _proc_status_kib("VmHWM") * 1024


def _proc_status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field} line (not Linux?)")


class RssSampler(threading.Thread):
    """The largest RSS seen, sampled every ``period`` seconds until ``stop()``."""

    def __init__(self, period: float):
        super().__init__(daemon=True)
        self.period, self.peak, self._done = period, rss_bytes(), threading.Event()

    def run(self):
        while not self._done.wait(self.period):
            self.peak = max(self.peak, rss_bytes())

    def stop(self) -> int:
        self._done.set()
        self.join()
        return max(self.peak, rss_bytes())


def load(model: str, device: str, tokenizer: str | None) -> LazyLLM:
    if model == "tiny":
        # the tests' engine model (head_dim 32), with SmolLM2's tokenizer; no EOS: every request
        # generates exactly its max_new_tokens, so every decode path is exercised
        if tokenizer:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(tokenizer)
        else:
            tok = LazyLLM.from_pretrained("smollm2", device="cpu", wrapper="none").tokenizer
        # the tests' small engine: a 256 MiB pool and host tier, 16-token pages (tests/helpers.small_llm)
        model = random_model("tiny-smollm2", "cpu", torch.float32, seed=3).to(device)
        llm = LazyLLM(model, tok, kv_bytes=256 << 20, host_bytes=256 << 20, page_size=16)
        llm.eos_ids = set()
        return llm
    return LazyLLM.from_pretrained(model, device=device)


def cuda_allocated() -> int:
    return torch.cuda.memory_allocated() if torch.cuda.is_available() else 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", help="tiny (the tests' random model) or a bundled name, e.g. smollm2")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--tokenizer", default=os.environ.get("LAZY_RAG_TEST_TOKENIZER"),
                   help="a tokenizer folder for the tiny model (default: the bundled SmolLM2's; "
                        "$LAZY_RAG_TEST_TOKENIZER)")
    p.add_argument("--requests", type=int, default=5000, help="requests submitted in all")
    p.add_argument("--distinct", type=int, default=300, help="distinct requests they are drawn from")
    p.add_argument("--chunks", type=int, default=12, help="distinct chunks the requests share")
    p.add_argument("--pages", type=int, default=40, help="pages in the engine's pool (tight: ~3 requests)")
    p.add_argument("--page-size", type=int, default=4)
    p.add_argument("--host-chunks", type=float, default=4, help="host tier bound, in chunks of the longest size")
    p.add_argument("--max-num-seqs", type=int, default=6)
    p.add_argument("--wave", type=int, default=20, help="requests submitted at once")
    p.add_argument("--abort-rate", type=float, default=0.3)
    p.add_argument("--fault-rate", type=float, default=0.05)
    p.add_argument("--sample-s", type=float, default=0.05, help="RSS sampling period")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "reliability_soak.json")
    a = p.parse_args()
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {a.device}: torch {torch.__version__} sees no CUDA device here")
    torch.set_num_threads(a.threads)
    t_start = time.perf_counter()
    llm = load(a.model, a.device, a.tokenizer)
    requests = with_random_modes(chunk_workload(a.distinct, a.seed, a.chunks, max_chunk_len=13, max_new=6),
                                 seed=a.seed)
    t0 = time.perf_counter()
    roomy = Engine(llm.host, EngineConfig(num_pages=600, page_size=a.page_size, max_num_seqs=8,
                                          max_batched_tokens=96))
    want = uninterrupted_tokens(roomy, requests)
    reference_s = time.perf_counter() - t0
    del roomy
    wrapper = llm.default_source.wrapper  # its slots are stored with every chunk
    longest_chunk = max(len(seg.content) for segs, _, _ in requests for seg in segs if isinstance(seg, Chunk)) \
        + (wrapper.slots if wrapper else 0)
    host_bytes = int(a.host_chunks * longest_chunk * llm.shape.kv_bytes_per_token * llm.dtype.itemsize)
    eng = Engine(llm.host, EngineConfig(num_pages=a.pages, page_size=a.page_size, max_num_seqs=a.max_num_seqs,
                                        max_batched_tokens=96, host_bytes=host_bytes))
    sampler = RssSampler(a.sample_s)
    sampler.start()
    rss_start = rss_bytes()
    rss_after_warmup, cuda_after_warmup, graphs_after_warmup = [], [], []

    def graphs_captured() -> int:  # CUDA-graph decode: one graph (and its buffers) per batch shape
        return len(eng.runner.graphs.graphs) if eng.runner.graphs is not None else 0


    tenth = max(1, a.requests // a.wave // 10)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()

    def on_wave(counts):
        if counts.waves == tenth:
            rss_after_warmup.append(rss_bytes())
            cuda_after_warmup.append(cuda_allocated())
            graphs_after_warmup.append(graphs_captured())
        if counts.waves % 50 == 0:
            print(f"[soak] {counts.submitted}/{a.requests} requests: {counts.finished} finished, "
                  f"{counts.aborted} aborted, {counts.failed_injected} failed as injected, "
                  f"{counts.mismatched} mismatched, RSS {rss_bytes() / 2**20:.0f} MiB", flush=True)

    t0 = time.perf_counter()
    counts = run_soak(eng, requests, want, a.requests, random.Random(a.seed + 1), wave=a.wave,
                      abort_rate=a.abort_rate, fault_rate=a.fault_rate, on_wave=on_wave)
    soak_s = time.perf_counter() - t0
    rss_end = rss_bytes()
    rss_peak_sampled = sampler.stop()
    cuda_end = cuda_allocated()
    host = eng.tiers.host
    host_evictions, host_bytes_end = host.evictions, host.bytes
    leaks = page_leaks(eng)
    warm = rss_after_warmup[0] if rss_after_warmup else rss_start
    mib = 2 ** 20
    on_cuda = llm.device.type == "cuda"
    cuda = {"cuda_allocated_after_first_tenth_mib": round((cuda_after_warmup or [0])[0] / mib, 1),
            "cuda_allocated_end_mib": round(cuda_end / mib, 1),
            "cuda_allocated_growth_after_first_tenth_mib": round((cuda_end - (cuda_after_warmup or [0])[0]) / mib, 1),
            "cuda_peak_allocated_mib": round(torch.cuda.max_memory_allocated() / mib, 1),
            "cuda_graphs_after_first_tenth": (graphs_after_warmup or [0])[0], "cuda_graphs_end": graphs_captured()} \
        if on_cuda else {}
    record = {
        "benchmark": "reliability_soak", "mode": "random requests, aborts, injected faults, tight pool",
        "device": torch.cuda.get_device_name(llm.device) if on_cuda else "cpu", "model": a.model,
        "python": platform.python_version(), "torch": torch.__version__,
        "threads": a.threads, "seed": a.seed, "requests": a.requests, "distinct_requests": a.distinct,
        "chunks": a.chunks, "pool_pages": a.pages, "page_size_tokens": a.page_size, "max_num_seqs": a.max_num_seqs,
        "wave": a.wave, "abort_rate": a.abort_rate, "fault_rate": a.fault_rate,
        "host_tier_bound_bytes": host_bytes,
        "finished": counts.finished, "mismatched": counts.mismatched, "aborted": counts.aborted,
        "failed_injected": counts.failed_injected, "failed_unexpected": counts.failed_unexpected,
        "faults_not_raised": counts.faults_not_raised, "host_bound_violations": counts.host_bound_violations,
        **{f"faults_{k}": v for k, v in sorted(counts.faults.items())},
        **{f"requests_{k}": v for k, v in sorted(counts.modes.items())},
        "host_tier_evictions": host_evictions, "host_tier_bytes_end": host_bytes_end,
        **leaks,
        "rss_start_mib": round(rss_start / mib, 1), "rss_after_first_tenth_mib": round(warm / mib, 1),
        "rss_end_mib": round(rss_end / mib, 1), "rss_peak_sampled_mib": round(rss_peak_sampled / mib, 1),
        "rss_growth_after_first_tenth_mib": round((rss_end - warm) / mib, 1),
        "vm_hwm_mib": round(peak_rss_bytes() / mib, 1), **cuda,
        "reference_s": round(reference_s, 1), "soak_s": round(soak_s, 1),
        "requests_per_s": round(counts.submitted / soak_s, 1),
        "wall_s": round(time.perf_counter() - t_start, 1), "problems": json.dumps(counts.examples),
        "date": time.strftime("%Y-%m-%d"),
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    old = json.loads(a.out.read_text()) if a.out.exists() else []
    a.out.write_text(json.dumps(old + [record], indent=1) + "\n")  # runs accumulate (tiny model, SmolLM2)
    ok = (counts.mismatched == counts.failed_unexpected == counts.faults_not_raised == counts.host_bound_violations
          == 0 and not any(leaks.values()))
    print(f"{record['device']}, model {a.model}, record appended to {a.out}")
    print("| requests | finished (= uninterrupted) | aborted | failed as injected | unexpected failures | "
          "page leaks | host tier over bound | RSS peak MiB | RSS growth after 1st tenth MiB | s |"
          + (" GPU allocated growth after 1st tenth MiB | GPU peak MiB |" if on_cuda else ""))
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if on_cuda else ""))
    print(f"| {counts.submitted} | {counts.finished} ({counts.finished - counts.mismatched}) | {counts.aborted} | "
          f"{counts.failed_injected} | {counts.failed_unexpected + counts.faults_not_raised} | "
          f"{sum(leaks.values())} | {counts.host_bound_violations} | {rss_peak_sampled / mib:.0f} | "
          f"{(rss_end - warm) / mib:+.1f} | {soak_s:.0f} |"
          + (f" {cuda['cuda_allocated_growth_after_first_tenth_mib']:+.1f} | {cuda['cuda_peak_allocated_mib']:.0f} |"
             if on_cuda else ""))
    if counts.examples:
        print("problems:", *counts.examples, sep="\n  ")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
