"""``Engine``: the serving loop. ``submit`` a request, get a handle; ``step`` runs one batch;
``generate`` runs requests to completion; ``stream`` yields a request's text asynchronously.

One pool, one scheduler, one model runner and one sampling rule for all four modes; the mode
only changes where the KV of a request comes from (``KVPlanner``).
"""
from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from ..llm import GenerationResult, GenerationStats
from ..sampling import TextAssembler, sample_next, validate_sampling
from .block_manager import BlockManager
from .kv_planner import MODES, KVPlanner
from .model_runner import ModelRunner
from .page_pool import PagePool
from .scheduler import Scheduler
from .sequence import SamplingParams, Sequence, Status
from .tiers import ChunkTiers


@dataclass
class RequestHandle:
    seq: Sequence
    text: TextAssembler
    generator: torch.Generator | None
    t0: float
    pieces: list[str] = field(default_factory=list)
    ttft_ms: float = 0.0
    first_token_time: float = 0.0
    first_logits: torch.Tensor | None = None
    result: GenerationResult | None = None

    @property
    def done(self) -> bool:
        return self.result is not None


class Engine:
    def __init__(self, llm, *, kv_bytes: int | None = None, gpu_memory_fraction: float | None = None,
                 num_pages: int | None = None, page_size: int = 16, policy: str = "gdsf",
                 host_bytes: int = 4 << 30, store=None, max_num_seqs: int = 64,
                 max_batched_tokens: int = 16384, tiers: ChunkTiers | None = None,
                 cuda_graphs: bool = True):
        """KV budget: ``num_pages``, else ``kv_bytes``, else ``gpu_memory_fraction`` of the
        device's free memory (CUDA), else 1 GiB. ``tiers``: share a ChunkTiers (host tier) between
        engines. ``cuda_graphs``: replay decode steps from captured graphs (CUDA only).
        ``policy``: eviction of unreferenced cached pages, ``gdsf`` by default: in the paper's
        Zipf workload it keeps 0.1-0.4 points more chunk hits than LRU (as LFU does) and ties it
        under uniform popularity (benchmarks/eviction_policy.py, BENCHMARKS.md), and unlike plain
        LFU it ages, so a corpus whose popular chunks change is not stuck with old favourites."""
        self.llm = llm
        shp, dt, dev = llm.shape, llm.dtype, llm.device
        dims = (shp.num_layers, shp.num_kv_heads, page_size, shp.head_dim)
        if num_pages is None:
            if kv_bytes is None and gpu_memory_fraction is not None and dev.type == "cuda":
                kv_bytes = int(torch.cuda.mem_get_info(dev)[0] * gpu_memory_fraction)
            num_pages = PagePool.pages_for_budget(kv_bytes or (1 << 30), *dims, dt)
        self.pool = PagePool(shp.num_layers, num_pages, shp.num_kv_heads, page_size, shp.head_dim, dt, dev)
        self.bm = BlockManager(self.pool, policy)
        self.tiers = tiers or ChunkTiers(llm, host_bytes, store)
        self.planner = KVPlanner(self.bm, self.tiers, llm.rope)
        self.scheduler = Scheduler(self.planner, max_num_seqs, max_batched_tokens)
        self.runner = ModelRunner(llm.handles, self.pool, cuda_graphs=cuda_graphs, max_graph_batch=max_num_seqs)
        self.handles: dict[int, RequestHandle] = {}
        self.num_steps = 0
        # where the wall time goes: admission (incl. chunk fetch/encode), steps with a prefill,
        # decode-only steps, idle waits on chunk transfers
        self.timers: Counter = Counter()

    # -- API ------------------------------------------------------------------------------------
    def submit(self, segments, mode: str = "lazy", max_new_tokens: int = 16, temperature: float = 0.0,
               top_p: float = 1.0, stop: list[str] | str | None = None, seed: int | None = None,
               kv_source=None, output_first_logits: bool = False) -> RequestHandle:
        """Queue one request. ``kv_source``: where its chunks' KV comes from when no tier has it
        (a ``LazyIndex``: its chunk store and shared prefix; default: encode with the model)."""
        if mode not in MODES:
            raise ValueError(f"Unknown mode {mode!r}; choose one of {', '.join(MODES)}.")
        validate_sampling(temperature, top_p, max_new_tokens)
        stop = [stop] if isinstance(stop, str) else stop
        layout = self.llm.prepare(segments, kv_source)
        self.llm.check_fits(layout, max_new_tokens)
        prefix = tuple(getattr(kv_source or self.llm, "shared_prefix_ids", ()))
        seq = Sequence(layout, mode, SamplingParams(max_new_tokens, temperature, top_p, stop, seed), prefix,
                       store=getattr(kv_source, "store", None), keep_first_logits=output_first_logits)
        gen = None
        if temperature > 0:
            gen = torch.Generator(device="cpu")
            gen.manual_seed(seed if seed is not None else torch.seed())
        handle = RequestHandle(seq, TextAssembler(self.llm.tokenizer, stop), gen, time.perf_counter())
        self.handles[seq.id] = handle
        self.scheduler.add(seq)
        return handle

    def step(self) -> bool:
        """Run one batch; False when there was nothing runnable (idle, or waiting on transfers)."""
        t0 = time.perf_counter()
        step = self.scheduler.schedule()   # admission: chunk lookups, tier fetches, encodes
        t1 = time.perf_counter()
        self.timers["schedule_s"] += t1 - t0
        if not step:
            return False
        seqs = step.prefill + step.decode
        for seq in step.prefill:
            self.planner.materialize(seq)
        out = self.runner.run(seqs)
        # greedy rows need only their argmax: move [B] ids to the host, not [B, vocab] logits
        # (16 MB at B=32 with a 128k vocabulary). The host copy waits for the step, so the
        # timers below are exact.
        if all(s.params.temperature == 0 and not (s.keep_first_logits and not s.output) for s in seqs):
            rows, toks = [None] * len(seqs), out.argmax(-1).tolist()
        else:
            rows, toks = out.cpu(), [None] * len(seqs)
        self.timers["prefill_steps_s" if step.prefill else "decode_steps_s"] += time.perf_counter() - t1
        for seq in step.prefill:
            seq.needs_prefill = False
            self.planner.publish(seq)
        for row, tok, seq in zip(rows, toks, seqs):
            seq.kv_len = seq.num_tokens
            self._accept(seq, row, tok)
        self.num_steps += 1
        return True

    def abort(self, handle: RequestHandle) -> None:
        """Drop an unfinished request (a consumer stopped reading its stream); frees its KV."""
        if handle.done or handle.seq.id not in self.handles:
            return
        seq = handle.seq
        if seq in self.scheduler.running:
            self.scheduler.finish(seq, "abort")
        else:
            self.scheduler.waiting.remove(seq)
            seq.status = Status.FINISHED
        self.handles.pop(seq.id)

    def run_until_done(self) -> None:
        while self.scheduler.has_work:
            if not self.step():
                t = time.perf_counter()
                time.sleep(0)  # only chunk transfers in flight
                self.timers["waiting_s"] += time.perf_counter() - t

    def generate(self, requests: list[dict]) -> list[GenerationResult]:
        """Blocking: each request is a dict of ``submit`` keyword arguments (``segments`` required)."""
        handles = [self.submit(**r) for r in requests]
        self.run_until_done()
        return [h.result for h in handles]

    async def stream(self, handle: RequestHandle):
        """Text pieces of one request as they are generated (drives the engine meanwhile)."""
        sent = 0
        while True:
            while sent < len(handle.pieces):
                yield handle.pieces[sent]
                sent += 1
            if handle.done:
                return
            self.step()
            await asyncio.sleep(0)

    def stats(self) -> dict:
        graphs = self.runner.graphs
        return {**self.bm.stats(), **{f"tier_{k}": v for k, v in self.tiers.counters.items()},
                "preemptions": self.scheduler.num_preemptions, "steps": self.num_steps,
                "graph_replays": graphs.replays if graphs else 0, "graphs": len(graphs.graphs) if graphs else 0,
                **{k: round(v, 4) for k, v in self.timers.items()},
                "page_size": self.pool.page_size, "bytes_per_page": self.pool.bytes_per_page}

    # -- sampling and stopping (the same rule as LazyLLM.generate) -------------------------------
    def _accept(self, seq: Sequence, logits: torch.Tensor | None, tok: int | None = None) -> None:
        """Take the next token: ``tok`` when already chosen (greedy on the device), else sampled
        from ``logits`` (fp32, host) by the same rule as ``LazyLLM.generate``."""
        h = self.handles[seq.id]
        p = seq.params
        if not seq.output and not h.ttft_ms and seq.keep_first_logits:
            h.first_logits = logits.clone()
        if tok is None:
            tok = sample_next(logits, p.temperature, p.top_p, h.generator)
        if not seq.output and not h.ttft_ms:
            h.first_token_time = time.perf_counter()
            h.ttft_ms = (h.first_token_time - h.t0) * 1e3
        if tok in self.llm.eos_ids:
            return self._finish(seq, "stop")
        seq.output.append(tok)
        piece = h.text.push(seq.output)
        if piece:
            h.pieces.append(piece)
        if h.text.stopped:
            return self._finish(seq, "stop")
        if len(seq.output) >= p.max_tokens:
            return self._finish(seq, "length")

    def _finish(self, seq: Sequence, reason: str) -> None:
        h = self.handles.pop(seq.id)
        tail = h.text.flush()
        if tail:
            h.pieces.append(tail)
        self.scheduler.finish(seq, reason)
        lay = seq.layout
        T = len(lay.token_ids)
        if seq.mode in ("lazy", "block"):
            cached = lay.cached_tokens
        elif seq.mode == "prefix":
            cached = seq.prefix_hit_tokens
        else:
            cached = 0
        now = time.perf_counter()
        sources = {}
        for src in seq.chunk_sources_seen:
            tier = "pool" if src == "hits" else src.removeprefix("from_")  # pool: resident already
            if tier != "misses":
                sources[tier] = sources.get(tier, 0) + 1
        stats = GenerationStats(mode=seq.mode, prompt_tokens=T, cached_tokens=cached, computed_tokens=T - cached,
                                ttft_ms=h.ttft_ms, total_ms=(now - h.t0) * 1e3, new_tokens=len(seq.output),
                                chunk_sources=sources, backend="engine")
        if len(seq.output) > 1 and h.first_token_time:
            stats.decode_tokens_per_s = (len(seq.output) - 1) / max(now - h.first_token_time, 1e-9)
        h.result = GenerationResult(text=h.text.text, token_ids=list(seq.output), stats=stats,
                                    finish_reason=reason, first_logits=h.first_logits)
        h.seq = seq
