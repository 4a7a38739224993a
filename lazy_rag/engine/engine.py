"""``Engine``: the serving loop, the one runtime of every request on every device. ``submit``
a request, get a handle; ``step`` runs one batch; ``pieces``/``stream`` drive the engine until a
request is done while yielding its text; ``generate`` runs many to completion; ``encode_chunks``
computes chunks' position-free KV (index builds).

One pool, one scheduler, one model runner and one sampling rule for all four modes; the mode
only changes where the KV of a request comes from (``KVPlanner``). One lock (``Engine.lock``)
guards all of it: any thread may call ``step``, and a step advances every request in flight, so
threads that generate at the same time are batched together.
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterator, Sequence as Seq

import torch

from ..architecture import ModelParts
from ..model_host import ModelHost
from ..errors import LazyRagError, RequestFailedError
from ..requests import CHUNK_MODES, ChunkSource, GenerationResult, GenerationStats, SamplingParams
from ..sampling import TextAssembler, apply_penalties, sample_next
from ..structured import GrammarMatcher, OutputFormat
from ..chunk_kv import ChunkKV
from .chunk_tiers import ChunkTiers, chunk_key
from .config import EngineConfig
from .kv_planner import KVPlanner
from .model_runner import ModelRunner
from .page_manager import PageManager
from .page_pool import PagePool
from ..reuse_risk import RiskCalibration, find_calibration, first_token_entropies
from .recovery import Recovery, auto_escalation, choose_recomputed, resolve_recovery
from .scheduler import Scheduler
from .sequence import EncodeJob, Run, Sequence, Status


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
    score: object = None
    grammar: GrammarMatcher | None = None  # the output format's state (structured outputs)
    # logprobs=k: per generated token (id, its logprob, [(id, logprob)] of the k most likely)
    top_logprobs: int | None = None
    logprobs: list | None = None
    result: GenerationResult | None = None
    error: RequestFailedError | None = None  # set when this request failed (the others go on)

    @property
    def done(self) -> bool:
        return self.result is not None or self.error is not None


class Engine:
    def __init__(self, host: ModelHost, config: EngineConfig | None = None, tiers: ChunkTiers | None = None,
                 parts: ModelParts | None = None):
        """``tiers``: share one host tier between engines (benchmarks). ``parts``: the model this
        engine runs and sizes its pool by, when not the host's whole model (a tensor-parallel
        rank's share, ``tensor_parallel.ShardedParts``)."""
        self.host = host
        self.config = config = config or EngineConfig()
        parts = parts or host.parts
        shp, dev = parts.shape, host.device
        dt = config.resolved_kv_dtype(host.dtype)   # storage: the model's dtype, or fp8
        page_size = config.resolved_page_size(dev)
        self.pool = PagePool(shp.num_layers, pool_pages(config, shp, host.dtype, dev), shp.num_kv_heads, page_size,
                             shp.head_dim, dt, dev)
        self.pm = PageManager(self.pool, config.policy)
        self.tiers = tiers or ChunkTiers(config.host_bytes)
        self.runner = ModelRunner(parts, self.pool, config.cuda_graphs, config.max_num_seqs,
                                  config.append_graph_tokens, config.shared_chunks)
        self.planner = KVPlanner(self.pm, self.tiers, host.pool_rope, self.runner)
        self.scheduler = Scheduler(self.planner, config.max_num_seqs, config.max_batched_tokens)
        self.handles: dict[int, RequestHandle] = {}
        self.lock = threading.RLock()
        self.num_steps = 0
        self.num_failed = 0
        # where the wall time goes: admission (incl. chunk fetch/encode), steps with a prefill,
        # decode-only steps, idle waits on chunk transfers
        self.timers: Counter = Counter()
        self._calibrations: dict[str | None, RiskCalibration | None] = {}  # wrapper digest -> reuse-risk fit
        self.num_served_again = 0

    # -- requests -------------------------------------------------------------------------------
    def submit(self, segments, mode: str = "lazy", max_new_tokens: int | None = None, temperature: float | None = None,
               top_p: float | None = None, stop: Seq[str] | str | None = None, seed: int | None = None,
               source: ChunkSource | None = None, boundary_recompute: int = 0,
               recovery: Recovery | str | None = None, output_first_logits: bool = False,
               score_rows: int = 0, score_fn=None, cache_salt: str = "",
               tenant: str | None = None, output_format: OutputFormat | None = None,
               presence_penalty: float | None = None, frequency_penalty: float | None = None,
               sampling: SamplingParams | None = None, logprobs: int | None = None) -> RequestHandle:
        """Queue one request. ``sampling``: how it samples (``SamplingParams``; ``max_new_tokens``,
        ``temperature``, ``top_p``, ``stop``, ``seed`` and the penalties are shorthand for its
        fields). ``source``: where its chunks were encoded and stored (an index's
        ``chunk_source``); default: chunks encoded on first use after the host's shared prefix.
        ``recovery``: training-free quality recovery for the reused chunks (``Recovery`` or its
        short name, e.g. "prophet20"); ``boundary_recompute=N`` is short for ``recovery="epicN"``.
        ``score_rows`` / ``score_fn``: teacher-forced scoring. The fp32 logits [score_rows, vocab]
        of the prompt's last ``score_rows`` positions (the last one predicts the first new token)
        are passed, on the engine's device, to ``score_fn`` once, and what it returns is the
        result's ``score``: e.g. a KL per position against a reference answer appended to the
        prompt as uncached tokens. The rows must be computed at query time (uncached text).
        ``cache_salt``: the KV of this request's chunks without a ``chunk_id`` (text the caller
        sent, not an index's) and of its prompt pages in prefix mode is cached under this salt,
        found only by requests with the same salt (a server gives each tenant its own).
        ``tenant``: waiting requests are admitted tenant by tenant (the tenant with the fewest
        running requests first), so that one tenant's flood cannot hold the others back.
        ``output_format``: every token must keep the output inside it (``OutputFormat``: a JSON
        schema, any JSON object, a regex or a Lark grammar), enforced while sampling.
        ``logprobs=k`` (0..20): the handle's ``logprobs`` gets, per generated token, (token id, its
        log-probability, the k most likely tokens' (id, log-probability)), of the model's
        distribution (before penalties, the output format's mask and temperature)."""
        params = SamplingParams.of(sampling, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                   stop=stop, seed=seed, presence_penalty=presence_penalty,
                                   frequency_penalty=frequency_penalty)
        source = source or self.host.default_source
        recovery = resolve_recovery(recovery, boundary_recompute)
        if recovery.any and mode not in CHUNK_MODES:
            raise LazyRagError(f"Recovery ({recovery.name()}) applies to reused chunks: use mode lazy or block, "
                               f"not {mode!r}.")
        t0 = time.perf_counter()
        with self.lock:  # the tokenizer is not safe to share between threads
            layout = self.host.prepare(segments, source, recovery.boundary, mode)
            self.host.check_request(layout, mode, params.max_new_tokens)
            if score_rows:
                self._check_score_rows(layout, score_rows, score_fn)
            seq = Sequence(layout, mode, params, source, keep_first_logits=output_first_logits, recovery=recovery,
                           score_rows=score_rows, score_fn=score_fn, cache_salt=cache_salt, tenant=tenant)
            gen = None
            if params.temperature > 0:
                gen = torch.Generator(device="cpu")
                gen.manual_seed(params.seed if params.seed is not None else torch.seed())
            handle = RequestHandle(seq, TextAssembler(self.host.tokenizer, list(params.stop)), gen, t0)
            if logprobs is not None:
                handle.top_logprobs, handle.logprobs = int(logprobs), []
            if output_format is not None:
                handle.grammar = GrammarMatcher(output_format, self.host.tokenizer, self.host.parts.vocab_rows,
                                                self.host.eos_ids)
            self.handles[seq.id] = handle
            self.scheduler.add(seq)
        return handle

    def step(self) -> bool:
        """Run one batch; False when there was nothing runnable (idle, or waiting on transfers)."""
        with self.lock:
            t0 = time.perf_counter()
            step = self.scheduler.schedule()   # admission: chunk lookups, tier fetches, encodes
            t1 = time.perf_counter()
            self.timers["schedule_s"] += t1 - t0
            for seq, e in step.failed:
                self._fail(seq, e)
            for seq in list(step.prefill):
                try:
                    self.planner.materialize(seq)
                    if seq.needs_selection:
                        self._select(seq)
                except Exception as e:
                    step.prefill.remove(seq)
                    self._fail(seq, e)
            seqs = step.prefill + step.decode
            if not seqs:
                return bool(step.failed)
            seqs, out = self._run(seqs)
            if not seqs:
                return True
            again = self._assess_reuse([s for s in step.prefill if s in seqs], seqs, out)
            if again:
                keep = [i for i, s in enumerate(seqs) if s not in again]
                if not keep:
                    return True
                seqs, out = [seqs[i] for i in keep], out[keep]
            step.prefill = [s for s in step.prefill if s in seqs]
            for seq in step.prefill:
                if seq.scored_logits is not None:
                    self.handles[seq.id].score = seq.score_fn(seq.scored_logits)
                    seq.scored_logits, seq.score_rows = None, 0  # its decode steps score nothing
            # greedy rows need only their argmax: move [B] ids to the host, not [B, vocab] logits
            # (16 MB at B=32 with a 128k vocabulary). The host copy waits for the step, so the
            # timers below are exact.
            if all(s.params.temperature == 0 and not (s.keep_first_logits and not s.output)
                   and not s.params.penalised and self.handles[s.id].grammar is None
                   and self.handles[s.id].logprobs is None for s in seqs):
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
            # the chunks a prefill encoded go to the cache once its first token is out (host copies:
            # off the time to first token); a request that finished just now did it as it was released
            t2 = time.perf_counter()
            for seq in step.prefill:
                self.planner.publish_encoded(seq)
            self.timers["publish_encoded_s"] += time.perf_counter() - t2
            self.num_steps += 1
            return True

    def calibration(self, source) -> RiskCalibration | None:
        """The reuse-risk calibration of this model serving chunks encoded inside ``source``'s
        wrapper (None: none bundled or written for them)."""
        digest = source.wrapper.digest if source.wrapper is not None else None
        if digest not in self._calibrations:
            self._calibrations[digest] = find_calibration(self.host.fingerprint["id"], digest)
        return self._calibrations[digest]

    def _assess_reuse(self, prefilled: list[Sequence], seqs: list[Sequence], out: torch.Tensor) -> set:
        """The reuse risk of each request whose first prefill over cached chunks just ran (the
        entropy of its first token's distribution, one softmax over rows the step computed
        anyway); returns those that recovery ``auto`` serves again, recomputing what the
        calibrated policy asks for their risk (``Scheduler.serve_again``)."""
        firsts = [s for s in prefilled if s.mode in CHUNK_MODES and not s.output and s.first_token_entropy is None
                  and any(span.cached_tokens for span in s.layout.spans)]
        if not firsts:
            return set()
        rows = [seqs.index(s) for s in firsts]
        again = set()
        for seq, entropy in zip(firsts, first_token_entropies(out[rows])):
            seq.first_token_entropy = entropy
            cal = self.calibration(seq.source)
            seq.reuse_risk = cal.risk(entropy) if cal is not None else None
            fraction = cal.policy.fraction(seq.reuse_risk) if cal is not None and seq.recovery.auto else 0.0
            if fraction > 0:
                seq.recovery = auto_escalation(seq.recovery, fraction)
                self.scheduler.serve_again(seq)
                self.num_served_again += 1
                again.add(seq)
        return again

    def _run(self, seqs: list[Sequence]) -> tuple[list[Sequence], torch.Tensor | None]:
        """One forward over the batch. If it raises, each request is run alone so that only the
        ones that fail by themselves fail (a step writes each token's KV at a fixed slot, so a
        re-run writes the same values)."""
        try:
            return seqs, self.runner.run(seqs)
        except Exception as e:
            if len(seqs) == 1:
                self._fail(seqs[0], e)
                return [], None
        kept, rows = [], []
        for seq in seqs:
            try:
                # a copy: a CUDA-graph decode returns its graph's output buffer, which the next
                # request's replay of the same graph overwrites
                rows.append(self.runner.run([seq]).clone())
                kept.append(seq)
            except Exception as e:
                self._fail(seq, e)
        return kept, (torch.cat(rows) if rows else None)

    @staticmethod
    def _check_score_rows(layout, score_rows: int, score_fn) -> None:
        """The scored rows must be the prompt's trailing uncached tokens (cached rows have no logits)."""
        T = len(layout.token_ids)
        if score_fn is None or not 0 < score_rows <= T or layout.uncached[-score_rows:] != list(range(T - score_rows, T)):
            raise LazyRagError(f"score_rows={score_rows} needs a score_fn and the prompt's last {score_rows} tokens "
                               "computed at query time (uncached text after the last chunk).")

    def _fail(self, seq: Sequence, e: Exception) -> None:
        """End one request with an error its caller sees; free its KV; the engine serves on."""
        h = self.handles.pop(seq.id, None)
        if seq in self.scheduler.running:
            self.scheduler.finish(seq, "error")
        seq.status, seq.finish_reason = Status.FINISHED, "error"
        self.num_failed += 1
        if h is not None:
            err = RequestFailedError(f"Request {seq.id} ({seq.mode}) failed: {type(e).__name__}: {e}")
            err.__cause__ = e
            h.error = err

    def _select(self, seq: Sequence) -> None:
        """Recompute the chunk tokens this request's recovery chooses (``recovery.choose_recomputed``),
        before its prefill."""
        t = time.perf_counter()
        self.planner.recompute(seq, choose_recomputed(seq, self.runner))
        self.timers["select_s"] += time.perf_counter() - t

    def abort(self, handle: RequestHandle) -> None:
        """Drop an unfinished request (a consumer stopped reading its stream); frees its KV."""
        with self.lock:
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
        failed = [h.error for h in handles if h.error is not None]
        if failed:
            raise RequestFailedError(f"{len(failed)} of {len(handles)} requests failed; the first: {failed[0]}") \
                from failed[0].__cause__
        return [h.result for h in handles]

    def pieces(self, handle: RequestHandle) -> Iterator[str]:
        """Text pieces of one request as they are generated, driving the engine meanwhile (any
        caller's step advances every request in flight). Closing the iterator early aborts the
        request and frees its KV."""
        sent = 0
        try:
            while True:
                while sent < len(handle.pieces):
                    yield handle.pieces[sent]
                    sent += 1
                if handle.error is not None:
                    raise handle.error
                if handle.done:
                    return
                with self.lock:
                    stepped = handle.done or self.step()
                if not stepped:
                    time.sleep(0)  # chunk transfers in flight
        finally:
            if not handle.done:  # the consumer stopped early
                self.abort(handle)

    async def stream(self, handle: RequestHandle):
        """The same as ``pieces``, for an event loop (yields to it between steps)."""
        it = self.pieces(handle)
        try:
            for piece in it:
                yield piece
                await asyncio.sleep(0)
        finally:
            it.close()

    # -- chunk encoding (index builds) ----------------------------------------------------------
    def encode_chunks(self, chunks: Seq[Seq[int]], shared_prefix: Seq[int] = (), wrapper=None,
                      cache: bool = True, quantize: str | None = None, host_alloc=None) -> list[ChunkKV]:
        """Each chunk's position-free KV on the host (keys unrotated), encoded after
        ``shared_prefix`` and inside ``wrapper`` (its slots' KV included), many chunks per forward.
        Encoded chunks stay cached in the pool and the host tier, unless ``cache=False``: an
        index build, which writes the KV to disk and would otherwise hold its whole corpus's KV in
        memory up to the pool's and the host tier's budgets (6 GiB by default on a CPU).
        ``quantize`` (with ``cache=False``): "fp8", the KV comes back fp8 with its per-token
        scales (``kernels.quantize_rows``), or "int4", in ``kv_int4``'s groups, computed on the
        engine's device either way, as a store of that format holds it.
        ``host_alloc`` (with ``cache=False``): where the host copies go (``ModelRunner.encode``)."""
        prefix = tuple(int(t) for t in shared_prefix)
        with self.lock, torch.inference_mode():  # the lock also guards the host's wrapper table
            chunks = [self.host.wrap_chunk(ids, wrapper) for ids in chunks]
            for ids in chunks:
                self.host.check_chunk(ids, prefix)
            out: list[ChunkKV | None] = [None] * len(chunks)
            pre = self.planner.place_chunk(prefix, None, (), None)[0] if prefix else None
            try:
                budget = self.config.max_batched_tokens
                batch: list[int] = []
                for i, ids in enumerate(chunks):
                    if batch and sum(len(chunks[j]) for j in batch) + len(ids) > budget:
                        self._encode_batch(chunks, batch, prefix, pre, out, cache, quantize, host_alloc)
                        batch = []
                    batch.append(i)
                if batch:
                    self._encode_batch(chunks, batch, prefix, pre, out, cache, quantize, host_alloc)
            finally:
                if pre is not None:
                    self.pm.release(pre)
        return out

    def _encode_batch(self, chunks, batch, prefix, pre, out, cache: bool, quantize: str | None = None,
                      host_alloc=None) -> None:
        p = len(prefix)
        cached = [Run(0, p, tuple(pre.pages), 0)] if pre is not None else []
        jobs, owned = [], []
        try:
            for i in batch:
                ids = [int(t) for t in chunks[i]]
                pages = self.pm.allocate(self.pool.pages_for(len(ids)))
                owned.append(pages)
                jobs.append(EncodeJob(list(prefix) + ids, list(cached), [Run(p, len(ids), tuple(pages), p)]))
            kvs = self.runner.encode(jobs, to_host=not cache, quantize=None if cache else quantize,
                                     host_alloc=None if cache else host_alloc)
        except BaseException:
            for pages in owned:
                self.pm.free(pages)
            raise
        for i, pages, kv in zip(batch, owned, kvs):
            key = chunk_key(chunks[i], prefix)
            if cache and self.pm.lookup(key) is None:  # keep it: the next query over this chunk is a pool hit
                self.pm.release(self.pm.adopt(key, pages, len(chunks[i])))
            else:
                self.pm.free(pages)
            out[i] = self.tiers.keep(key, kv, chunks[i], None, None) if cache else kv  # already on the host

    def calibrate_read_or_encode(self) -> str:
        """Measure (or load the kept) encode costs the read-or-encode choice weighs against reads
        (``KVPlanner.calibrate``); returns "measured", "kept" or the fit already in use."""
        with self.lock:
            return self.planner.calibrate()

    def clear_cache(self) -> None:
        """Forget every cached chunk and prefix page not in use, and the host tier: the next
        requests read their chunks from disk or encode them (cold-start measurements, tests)."""
        with self.lock:
            self.pm.evict_unreferenced()
            self.tiers.host.clear()

    def failure(self) -> "Exception | None":
        """Why this engine can serve nothing more, or None. One process's engine fails single
        requests, never itself; a tensor-parallel engine fails when a rank is gone (``TPEngine``),
        and the server's engine process then exits so that its supervisor starts a new one."""
        return None

    # -- stats ----------------------------------------------------------------------------------
    def stats(self) -> dict:
        graphs, append = self.runner.graphs, self.runner.append_graphs
        return {**self.pm.stats(), **{f"tier_{k}": v for k, v in self.tiers.counters.items()},
                "preemptions": self.scheduler.num_preemptions, "steps": self.num_steps,
                "failed_requests": self.num_failed, "served_again": self.num_served_again,
                "requests_waiting": len(self.scheduler.waiting), "requests_running": len(self.scheduler.running),
                "graph_replays": graphs.replays if graphs else 0, "graphs": len(graphs.graphs) if graphs else 0,
                "append_graph_replays": append.replays if append else 0,
                "encode_graph_replays": append.encode_replays if append else 0,
                "append_graphs": len(append.graphs) if append else 0,
                "shared_chunk_steps": self.runner.shared_decode_steps + (graphs.shared_replays if graphs else 0),
                **{k: round(v, 4) for k, v in self.timers.items()},
                "page_size": self.pool.page_size, "bytes_per_page": self.pool.bytes_per_page}

    # -- sampling and stopping ------------------------------------------------------------------
    def _accept(self, seq: Sequence, logits: torch.Tensor | None, tok: int | None = None) -> None:
        """Take the next token: ``tok`` when already chosen (greedy on the device), else sampled
        from ``logits`` (fp32, host)."""
        h = self.handles[seq.id]
        p = seq.params
        if not seq.output and not h.ttft_ms and seq.keep_first_logits:
            h.first_logits = logits.clone()
        raw = logits
        if p.penalised:
            logits = apply_penalties(logits, seq.output, p.presence_penalty, p.frequency_penalty)
        if h.grammar is not None:
            logits = h.grammar.mask(logits)
        if tok is None:
            tok = sample_next(logits, p.temperature, p.top_p, h.generator)
        if not seq.output and not h.ttft_ms:
            h.first_token_time = time.perf_counter()
            h.ttft_ms = (h.first_token_time - h.t0) * 1e3
        if tok in self.host.eos_ids:
            return self._finish(seq, "stop")
        if h.grammar is not None:
            h.grammar.advance(tok)
        seq.output.append(tok)
        if h.logprobs is not None:
            h.logprobs.append(token_logprobs(raw, tok, h.top_logprobs))
        piece = h.text.push(seq.output)
        if piece:
            h.pieces.append(piece)
        if h.text.stopped or (h.grammar is not None and h.grammar.finished):
            return self._finish(seq, "stop")
        if len(seq.output) >= p.max_new_tokens:
            return self._finish(seq, "length")

    def _finish(self, seq: Sequence, reason: str) -> None:
        h = self.handles.pop(seq.id)
        tail = h.text.flush()
        if tail:
            h.pieces.append(tail)
        self.scheduler.finish(seq, reason)
        lay = seq.layout
        T = len(lay.token_ids)
        if seq.mode in CHUNK_MODES:
            cached = lay.cached_tokens - seq.selected  # the layout already counts boundary heads as computed
        elif seq.mode == "prefix":
            cached = seq.prefix_hit_tokens
        else:
            cached = 0
        now = time.perf_counter()
        sources: dict[str, int] = {}
        for src in seq.chunk_sources_seen:
            tier = "pool" if src == "hits" else src.removeprefix("from_")  # pool: resident already
            if tier != "misses":
                sources[tier] = sources.get(tier, 0) + 1
        stats = GenerationStats(mode=seq.mode, prompt_tokens=T, cached_tokens=cached, computed_tokens=T - cached,
                                ttft_ms=h.ttft_ms, total_ms=(now - h.t0) * 1e3, new_tokens=len(seq.output),
                                chunk_sources=sources, recovery=seq.asked_recovery.name(),
                                recomputed_tokens=seq.recomputed,
                                encoded_tokens=seq.encoded_tokens if seq.mode in CHUNK_MODES else 0,
                                first_token_entropy=seq.first_token_entropy, reuse_risk=seq.reuse_risk,
                                served_again=seq.recovery is not seq.asked_recovery,
                                recovery_applied=seq.recovery.name())
        if len(seq.output) > 1 and h.first_token_time:
            stats.decode_tokens_per_s = (len(seq.output) - 1) / max(now - h.first_token_time, 1e-9)
        h.result = GenerationResult(text=h.text.text, token_ids=list(seq.output), stats=stats,
                                    finish_reason=reason, first_logits=h.first_logits, score=h.score)


def pool_pages(config: EngineConfig, shape, model_dtype: torch.dtype, device: torch.device) -> int:
    """The pool's page count for KV of ``shape``: ``config.num_pages``, else what its byte budget
    holds (``EngineConfig.pool_bytes``: on a GPU, possibly a fraction of the memory free now)."""
    return config.num_pages or PagePool.pages_for_budget(
        config.pool_bytes(device), shape.num_layers, shape.num_kv_heads, config.resolved_page_size(device),
        shape.head_dim, config.resolved_kv_dtype(model_dtype))


def token_logprobs(logits: torch.Tensor, tok: int, k: int) -> tuple[int, float, list[tuple[int, float]]]:
    """(``tok``, its log-probability, the ``k`` most likely tokens' (id, log-probability)) under ``logits``."""
    lp = torch.log_softmax(logits.float(), -1)
    top = lp.topk(k) if k else None
    return tok, float(lp[tok]), [] if top is None else list(zip(top.indices.tolist(), top.values.tolist()))

