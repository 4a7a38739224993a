"""The serving sweep: for each KV budget, for each arrival rate (offline included), for each
system, run the same requests and record one flat record.

One ``ChunkTiers`` host tier is shared by every engine of the run and filled before any timing
(every document encoded once), so chunk encoding on first sight does not land on whichever
system runs first; each measured point gets a fresh engine (an empty GPU pool of the budget's
size), so GPU-pool hit ratios are those of a cold pool filling under the workload. Warm-up
requests per system before timing compile the kernels. Plain transformers does not depend on
the KV budget: it is measured once per rate (``budget_*`` null in its records).

``shared_chunks`` sweeps the engine's shared-chunk attention (``EngineConfig.shared_chunks``) like
the budgets: lazy mode, whose running sequences read the same chunk pages, is measured once per
value, side by side at each (budget, rate); block, prefix and full run once with the first value
(no chunk page is shared between their sequences, so the setting changes nothing there).
"""
from __future__ import annotations

import gc
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..engine import Engine
from ..engine import EngineConfig
from ..engine.config import SHARED_CHUNKS
from ..engine.chunk_tiers import ChunkTiers
from ..engine.tp_engine import engine_for
from ..errors import LazyRagError
from ..requests import CHUNK_MODES
from .defaults import SYSTEMS
from .driver import run_engine, run_transformers, summarize_timings
from .metrics import cache_metrics, gib, latency_summary, throughput
from .progress import make_progress
from .records import environment, format_table, write_records
from .workload import Workload, WorkloadSpec, allowed_token_ids, arrival_times, make_workload

# engine modes whose sequences hold the same chunk pages in the pool, so that decode attention can
# read a shared chunk once for several of them: block copies each request's chunks into its own
# pages, prefix shares at most a cached prompt prefix, full shares nothing
GROUPING_MODES = ("lazy",)

SUMMARY_COLUMNS = ["mode", "shared_chunks", "budget_fraction", "rate_rps", "requests", "ttft_ms_p50", "ttft_ms_p99",
                   "e2e_ms_p50", "e2e_ms_p99", "throughput_rps", "output_tokens_per_s", "gpu_hit_ratio",
                   "host_hit_ratio", "preemptions", "peak_gpu_mem_gib"]


@dataclass(frozen=True)
class BenchConfig:
    spec: WorkloadSpec = field(default_factory=WorkloadSpec)
    rates: tuple = (None, 0.5, 1.0, 2.0, 4.0)   # requests/s; None = offline (all at once)
    budgets: tuple = (1.0, 0.5, 0.25, 0.1)      # fraction of the documents whose KV fits the pool
    systems: tuple = SYSTEMS
    shared_chunks: tuple = ("auto",)            # EngineConfig.shared_chunks values (GROUPING_MODES run each)
    hf_requests: int = 20                       # transformers runs the first N requests only (slow)
    page_size: int = 64
    max_num_seqs: int = 32
    max_batched_tokens: int = 16384
    host_bytes: int | None = None               # host tier; None: every document's KV + 10%
    tensor_parallel: int = 1                    # ranks the engine's model is split over (EngineConfig's)
    warmup: bool = True

    def validate(self) -> "BenchConfig":
        self.spec.validate()
        if not self.rates:
            raise LazyRagError("--rates is empty; give e.g. offline,0.5,1,2,4.")
        if not self.budgets:
            raise LazyRagError("--budgets is empty; give fractions of the documents, e.g. 1.0,0.5,0.25,0.1.")
        if not self.systems:
            raise LazyRagError(f"--systems is empty; choose from {','.join(SYSTEMS)}.")
        for s in self.systems:
            if s not in SYSTEMS:
                raise LazyRagError(f"Unknown system {s!r} in --systems; choose from {','.join(SYSTEMS)}.")
        if not self.shared_chunks:
            raise LazyRagError(f"--shared-chunks is empty; give some of {','.join(SHARED_CHUNKS)}, e.g. auto,off.")
        for v in self.shared_chunks:
            if v not in SHARED_CHUNKS:
                raise LazyRagError(f"Unknown --shared-chunks value {v!r}; choose from {','.join(SHARED_CHUNKS)} "
                                   "(comma-separated to compare them, e.g. auto,off).")
        for r in self.rates:
            if r is not None and not r > 0:
                raise LazyRagError(f"--rates: {r} is not a positive rate; use requests/s > 0 or 'offline'.")
        for b in self.budgets:
            if not 0 < b <= 1:
                raise LazyRagError(f"--budgets: {b} is outside (0, 1]; a budget is the fraction of the "
                                   "documents whose KV fits the GPU pool (1.0 = all).")
        if "block" in self.systems and min(self.budget_chunks(b) for b in self.budgets) < self.spec.k:
            small = min(self.budgets)
            raise LazyRagError(
                f"--budgets {small} leaves {self.budget_chunks(small)} documents of KV for k={self.spec.k}: block mode "
                f"holds a request's {self.spec.k} chunks while copying them; use budgets >= "
                f"{self.spec.k / self.spec.docs:g} (k/docs) or drop block from --systems.")
        if self.hf_requests < 1 and "transformers" in self.systems:
            raise LazyRagError("--hf-requests must be at least 1 (or drop transformers from --systems).")
        if self.tensor_parallel > 1 and "transformers" in self.systems:
            raise LazyRagError(f"--tensor-parallel {self.tensor_parallel} splits the engine's model over processes; "
                               "plain transformers cannot run a rank's share of it: drop transformers from --systems.")
        for name in ("page_size", "max_num_seqs", "max_batched_tokens", "tensor_parallel"):
            if getattr(self, name) < 1:
                raise LazyRagError(f"--{name.replace('_', '-')} must be at least 1.")
        return self

    def budget_chunks(self, fraction: float) -> int:
        return max(1, round(fraction * self.spec.docs))

    def shared_chunks_for(self, system: str) -> tuple:
        """The shared_chunks values ``system`` is measured with: each for the grouping modes, the
        first for the other engine modes, None (no engine) for transformers."""
        if system == "transformers":
            return (None,)
        return self.shared_chunks if system in GROUPING_MODES else self.shared_chunks[:1]


# -- parsing the command line's lists -------------------------------------------------------------
def parse_rates(text: str) -> tuple:
    out = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if part.lower() == "offline":
            out.append(None)
            continue
        try:
            out.append(float(part))
        except ValueError:
            raise LazyRagError(f"--rates: {part!r} is neither a number (requests/s) nor 'offline'.") from None
    return tuple(out)


def parse_budgets(text: str) -> tuple:
    try:
        return tuple(float(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise LazyRagError(f"--budgets: {text!r} must be comma-separated fractions in (0, 1], e.g. 1.0,0.5,0.25,0.1.") from None


def parse_systems(text: str) -> tuple:
    return tuple(p.strip() for p in text.split(",") if p.strip())


def parse_shared_chunks(text: str) -> tuple:
    """'auto,off' -> ('auto', 'off'); a repeated value is measured once. Checked in BenchConfig.validate."""
    return tuple(dict.fromkeys(p.strip().lower() for p in text.split(",") if p.strip()))


# -- the model -------------------------------------------------------------------------------------
def load_llm(model: str | None, random_weights: str | None, device: str = "auto", dtype: str = "auto",
             tensor_parallel: int = 1):
    """A checkpoint by name/path (``LazyLLM.from_pretrained``) or a named architecture with random
    weights, split over ``tensor_parallel`` ranks (each loading its own share); returns (llm, label
    for the records)."""
    from ..llm import LazyLLM
    from ..random_models import random_llm

    if model and random_weights:
        raise LazyRagError("Give either --model or --random-weights, not both.")
    if random_weights:
        llm = random_llm(random_weights, device, None if dtype == "auto" else dtype, tensor_parallel=tensor_parallel)
        return llm, f"random:{random_weights}"
    if not model:
        raise LazyRagError("No model: give --model NAME_OR_PATH or --random-weights ARCH.")
    # plain chunks, as in the paper's workload and the recorded figures (a bundled chunk wrapper
    # would add its slots to every chunk of the chunk-reuse modes only, and the warm-up encodes plain)
    return LazyLLM.from_pretrained(model, device=device, dtype=dtype, wrapper="none",
                                   tensor_parallel=tensor_parallel), model


# -- KV budget ------------------------------------------------------------------------------------
def request_private_pages(llm, workload: Workload, page_size: int) -> int:
    """Pages one whole request holds privately in block/full mode (its prompt and its output), plus
    one page of rounding per run (a run starts on a page boundary)."""
    longest = max(len(llm.prepare(r.segments).token_ids) for r in workload.requests)
    runs = workload.spec.k + 2
    return -(-(longest + workload.spec.output_tokens) // page_size) + runs


def pool_pages(llm, workload: Workload, page_size: int, fit: int) -> int:
    """``fit`` documents of KV + one whole request's private KV, so that block/prefix/full, which hold a
    request's whole prompt privately, can always run one request (the budget of engine_workload.py)."""
    doc_pages = -(-workload.spec.doc_tokens // page_size)
    return fit * doc_pages + request_private_pages(llm, workload, page_size)


# -- the sweep ------------------------------------------------------------------------------------
class Bench:
    def __init__(self, llm, cfg: BenchConfig, model_label: str, out_path: Path | None = None, progress: str = "auto"):
        self.llm, self.cfg, self.model_label, self.out_path = llm, cfg.validate(), model_label, out_path
        self.progress_mode = progress
        spec = cfg.spec
        self.workload = make_workload(spec, allowed_token_ids(llm))
        longest = max(len(llm.prepare(r.segments).token_ids) for r in self.workload.requests)
        if longest + spec.output_tokens > llm.context_window:
            raise LazyRagError(f"A request of {longest} prompt tokens + {spec.output_tokens} output tokens exceeds the "
                               f"model's context window of {llm.context_window}; lower --doc-tokens or --k.")
        doc_bytes = spec.doc_tokens * llm.shape.kv_bytes_per_token * torch.finfo(llm.dtype).bits // 8
        self.doc_kv_bytes = doc_bytes
        host = cfg.host_bytes if cfg.host_bytes is not None else int(spec.docs * doc_bytes * 1.1) + (64 << 20)
        self.tiers = ChunkTiers(host)
        self.env = environment()
        self.records: list[dict] = []

    # points in sweep order: (budget fraction or None, rate, system, shared_chunks or None)
    def points(self) -> list[tuple]:
        c = self.cfg
        pts = []
        for bi, b in enumerate(c.budgets):
            for r in c.rates:
                for s in c.systems:
                    if s == "transformers":
                        if bi == 0:
                            pts.append((None, r, s, None))
                    else:
                        pts.extend((b, r, s, sc) for sc in c.shared_chunks_for(s))
        return pts

    def min_duration_s(self) -> float:
        """A lower bound of the sweep's wall time: the arrival spans of the rate points."""
        c, n = self.cfg, self.cfg.spec.requests
        return sum((min(n, c.hf_requests) if s == "transformers" else n) / r for _b, r, s, _sc in self.points() if r)

    def point_label(self, system: str, shared_chunks: str | None) -> str:
        """The system, with its shared_chunks value when the sweep compares several."""
        if len(self.cfg.shared_chunks) > 1 and system in GROUPING_MODES:
            return f"{system}[{shared_chunks}]"
        return system

    def warm_up(self, log) -> None:
        """Encode every document into the host tier when a chunk-reuse system is measured (full
        and prefix never read it); run one short request per system (kernel compilation,
        allocator growth) on a throwaway engine."""
        w, llm = self.workload, self.llm
        encode = any(s in CHUNK_MODES for s in self.cfg.systems)
        if encode:
            eng = self._engine(self.cfg.spec.docs, self.cfg.shared_chunks[0])
            eng.encode_chunks([list(doc.content) for doc in w.docs], llm.default_source.shared_prefix_ids)
            del eng
        first = w.requests[:1]
        # every (system, shared_chunks) pair measured: grouped decode attention has kernels of its own
        for s, sc in dict.fromkeys((s, sc) for _b, _r, s, sc in self.points()):
            if s == "transformers":
                run_transformers(llm, first, [0.0], 2)
            else:
                # a full batch for the chunk-reuse modes: the attention kernel compiles a separate
                # variant once a batch has enough query tiles to fill the GPU without splitting
                # the context (~1 s, which would otherwise land inside the first timed point)
                n = min(self.cfg.max_num_seqs, len(w.requests)) if s in ("lazy", "block") else 2
                eng = self._engine(self.cfg.spec.docs, sc)
                run_engine(eng, s, w.requests[:n], [0.0] * n, 2)
                del eng
        log(f"warm-up: {len(w.docs)} documents encoded into the host tier ({self.tiers.host.bytes / (1 << 20):.0f} MiB)"
            if encode else "warm-up: no chunk-reuse system measured, no document encoded ahead")

    def _engine(self, fit: int, shared_chunks: str) -> Engine:
        c = self.cfg
        # the engine before this one (its pool sized for a whole budget) must be gone before the
        # next pool is allocated: collect anything of it a reference cycle still holds
        gc.collect()
        if self.llm.device.type == "cuda":
            torch.cuda.empty_cache()
        config = EngineConfig(num_pages=pool_pages(self.llm, self.workload, c.page_size, fit), page_size=c.page_size,
                              max_num_seqs=c.max_num_seqs, max_batched_tokens=c.max_batched_tokens,
                              shared_chunks=shared_chunks, tensor_parallel=c.tensor_parallel)
        return engine_for(self.llm.host, config, self.tiers)

    def run(self) -> list[dict]:
        pts = self.points()
        with make_progress(len(pts) + self.cfg.warmup, self.progress_mode) as prog:
            log = prog.log
            log(f"serving bench: {self.model_label} on {self.env['device']}; {len(pts)} points; arrival spans "
                f"alone take >= {self.min_duration_s() / 60:.1f} min")
            if self.cfg.warmup:
                prog.start("warm-up")
                self.warm_up(log)
                prog.advance()
            for b, r, s, sc in pts:
                rate = "offline" if r is None else f"{r:g} req/s"
                label = self.point_label(s, sc)
                prog.start(f"{label:<12} budget {'-' if b is None else f'{b:g}'}  {rate}")
                rec = self.measure(b, r, s, sc)
                self.records.append(rec)
                if self.out_path is not None:
                    write_records(self.out_path, self.records)  # after every point: a cut-off run keeps it
                log(f"{label:<12} budget {'-' if b is None else f'{b:g}':<5} {rate:<12} TTFT p50 "
                    f"{rec['ttft_ms_p50']:.0f} ms  p99 {rec['ttft_ms_p99']:.0f} ms  "
                    f"{rec['throughput_rps']:.2f} req/s  {rec['output_tokens_per_s']:.1f} output tok/s")
                prog.advance()
        return self.records

    def measure(self, budget: float | None, rate: float | None, system: str, shared_chunks: str | None) -> dict:
        c, spec, llm = self.cfg, self.cfg.spec, self.llm
        n = min(spec.requests, c.hf_requests) if system == "transformers" else spec.requests
        requests = self.workload.requests[:n]
        arrivals = arrival_times(spec.requests, rate, spec.seed)[:n]
        cuda = llm.device.type == "cuda"
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(llm.device)
        fit = None if budget is None else c.budget_chunks(budget)
        tiers_before = dict(self.tiers.counters)
        extra = {}
        if system == "transformers":
            res = run_transformers(llm, requests, arrivals, spec.output_tokens)
        else:
            eng = self._engine(fit, shared_chunks)
            extra["kv_pool_gib"] = gib(eng.pool.num_pages * eng.pool.bytes_per_page)
            # the whole pool in documents: the budget plus the one-request margin, which lazy mode
            # (little private KV per request) can also fill with chunks
            extra["pool_docs_equiv"] = round(eng.pool.num_pages / -(-spec.doc_tokens // c.page_size), 2)
            res = run_engine(eng, system, requests, arrivals, spec.output_tokens)
            del eng
        peak = gib(torch.cuda.max_memory_allocated(llm.device)) if cuda else None
        ttft, e2e, out_tokens, prompt_tokens = summarize_timings(res.timings)
        rec = {"benchmark": "serving", "mode": system, "device": self.env["device"], "model": self.model_label,
               "dtype": str(llm.dtype).removeprefix("torch."),
               "rate_rps": "offline" if rate is None else rate, "budget_chunks": fit,
               "budget_fraction": None if fit is None else round(fit / spec.docs, 4),
               "popularity": spec.popularity, "zipf_a": spec.zipf_a if spec.popularity == "zipf" else None,
               "requests": n, "docs": spec.docs, "doc_tokens": spec.doc_tokens, "k": spec.k,
               "question_tokens": spec.question_tokens, "output_tokens": spec.output_tokens, "seed": spec.seed,
               "page_size": c.page_size if system != "transformers" else None,
               "max_num_seqs": c.max_num_seqs if system != "transformers" else None,
               "tensor_parallel": c.tensor_parallel if system != "transformers" else None,
               "shared_chunks": shared_chunks,
               "prompt_tokens_mean": round(prompt_tokens / n, 1), "output_tokens_total": out_tokens,
               **latency_summary("ttft_ms", ttft), **latency_summary("e2e_ms", e2e),
               "wall_s": round(res.wall_s, 3), **throughput(n, out_tokens, res.wall_s)}
        if system != "transformers":
            rec.update(cache_metrics(res.engine_stats, prompt_tokens))
            rec.update({f"tier_{k}": self.tiers.counters.get(k, 0) - tiers_before.get(k, 0)
                        for k in ("host_hits", "disk_hits", "encoded")})
        rec.update(extra)
        rec["peak_gpu_mem_gib"] = peak
        rec.update({k: v for k, v in self.env.items() if k != "device"})
        return rec


def run_bench(llm, cfg: BenchConfig, model_label: str, out_path: Path | None = None,
              progress: str = "auto") -> list[dict]:
    """Run the sweep; records are also written to ``out_path`` after every point."""
    return Bench(llm, cfg, model_label, out_path, progress).run()


def summary_table(records: list[dict]) -> str:
    return format_table(records, SUMMARY_COLUMNS)
