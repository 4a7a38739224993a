"""An index build's chunk KV: encoded many chunks per forward, written by a background thread.

The engine encodes a batch of chunks (up to ``batch_tokens`` tokens, packed into one forward by
``Engine.encode_chunks``) while a writer thread appends the previous batches' KV to the store, so
the accelerator never waits on the disk and the disk never waits on the accelerator, unless one
is the bottleneck; then the other waits on a bounded queue (``max_pending_bytes`` of KV held on
the host), which keeps the build's memory flat however large the corpus is. On CUDA each batch's
KV lands in one of a few pinned buffers the build reuses (``pinned_staging``), given back when
the writer has written the batch.

On a CPU device each batch is written on the encoding thread after its encode instead, with no
writer thread and no prepare pool: torch's intra-op threads keep every core busy in the forward,
so there is nothing to overlap but the disk, whose writeback the kernel runs by itself (the store
starts it with ``sync_file_range``); the writes' CPU work (copies, CRCs, the copy into the page
cache) can only take turns with the forward. Measured on 2 cores (SmolLM2-135M, 33k tokens, 1.6
GB of fp32 KV), the thread bought nothing over writing inline (KV stage 53.9/55.3 s against
52.5/55.8 s); inline is simpler and holds one batch's KV, not two. What did cost a CPU build
time was the batch size (``CPU_BATCH_TOKENS``).

Order and failure: the writer writes in submission order and the first error it meets (a full
disk) stops the build at the next batch (inline: at once), re-raised in the caller's thread, so
the caller's clean-up (``LazyIndex._build_docs``) sees it as if the write had been its own. ``written`` lists
what was written so far, for that clean-up. Stage times (encode, write, the waits on each other)
are measured, so a build can say which stage bounds it (``PipelineStats``).
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from . import build_estimate
from .kernels import FP8
from .kv_record import INT4
from .pinned_staging import ALIGN, PinnedStaging

log = logging.getLogger(__name__)
_STOP = object()
# tokens per batch on a CPU device: a few chunks per forward. On 2 cores (SmolLM2-135M, chunks of
# ~230 tokens with the wrapper's slots) the KV stage of a 33k-token build took 53-56 s at 512-1024,
# 57-58 s at one chunk per forward or 2048-4096, and 64-66 s at the engine's max_batched_tokens
# (16384, right for a GPU), presumably as the activations of a long forward fall out of the caches
CPU_BATCH_TOKENS = 1024
# pinned staging buffers of a GPU build: the batch being encoded and the two the writer may hold
STAGING_SLOTS = 3


@dataclass
class PipelineStats:
    chunks: int = 0
    tokens: int = 0
    kv_bytes: int = 0
    encode_s: float = 0.0        # the engine's encode calls (forward + copy to the host)
    first_encode_s: float = 0.0  # ... of which the first batch's (kernel compiles on a fresh machine)
    second_encode_s: float = 0.0  # ... and the second's
    staging_wait_s: float = 0.0  # ... of all, waiting for a pinned staging buffer (pinned_staging)
    first_write_s: float = 0.0   # the writer's first batch (its prepare waits included)
    first_written_s: float = 0.0  # from the pipeline's start until the first batch is on its way to disk
    write_s: float = 0.0         # the writer thread's store writes (the two below included)
    prepare_wait_s: float = 0.0  # ... of which waiting for the prepare pool's records
    checkpoint_s: float = 0.0    # ... of which checkpoint commits (fsync + transaction)
    encoder_wait_s: float = 0.0  # the encoder waiting for room in the queue: the disk is the bound
    writer_fill_s: float = 0.0   # the writer waiting for the first batch (the pipeline filling)
    writer_idle_s: float = 0.0   # the writer waiting for KV to write after that: the encoder is the bound
    own_pins: int = 0            # host tensors that did not fit a staging buffer and were pinned anew
    beside_s: float = 0.0        # ``beside_writes``' work on the encoding thread (see encode_and_write)
    beside_at_batch: int = -1    # ... its first task run after this many batches (all: once the last was queued)
    seconds: float = 0.0
    batches: int = 0
    bound: str = field(default="")
    first_batch_tokens: int = 0  # the first batch's tokens (for the encode rate past it)

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["tokens_per_s"] = self.tokens / self.seconds if self.seconds else 0.0
        d["write_gbps"] = self.kv_bytes / self.write_s / 1e9 if self.write_s else 0.0
        # the encode's own rate past the first batch (whose compiles and first buffers are the
        # pipeline's fill): what the accelerator sustains while the writer runs beside it
        rest = self.encode_s - self.first_encode_s
        d["encode_tokens_per_s"] = (self.tokens - self.first_batch_tokens) / rest if rest > 0 else 0.0
        return d


class KVWriter:
    """Writes (record, KV) pairs to ``store`` from one background thread, in order; or
    (``background=False``: a CPU build, see above) in ``put`` itself, on the caller's thread."""

    def __init__(self, store, written: list, stats: PipelineStats, max_pending_bytes: int, threads: int | None = None,
                 background: bool = True):
        self.store, self.written, self.stats = store, written, stats
        self.background = background
        self.error: BaseException | None = None
        self.pool = self.thread = None
        if not background:
            return
        # records are prepared (copied into their layout, checksummed) on a pool: those copies and
        # CRCs release the GIL, and one thread of them was the 8B build's bottleneck; the appends
        # stay in order on the writer thread
        if hasattr(store, "prepare"):
            from concurrent.futures import ThreadPoolExecutor

            n = threads or max(1, min(8, (os.cpu_count() or 2) - 1))
            self.pool = ThreadPoolExecutor(n, thread_name_prefix="lazy-rag-kv-prepare")
        self.max_pending = max(int(max_pending_bytes), 1)
        self.pending = 0
        self.cond = threading.Condition()
        self.items: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="lazy-rag-kv-writer", daemon=True)
        self.thread.start()

    def put(self, records, kvs, on_written=None, lease=None) -> None:
        """Queue one batch; blocks while more than ``max_pending_bytes`` wait to be written
        (a batch larger than that alone is still taken). Raises the writer's error, if any.
        Inline (not ``background``): writes the batch now; its error, if any, is raised here.
        ``lease``: the batch's staging buffer (pinned_staging), released once it is written."""
        if not self.background:
            try:
                self._raise()
                self._write(records, kvs, on_written)
            except BaseException as e:  # _raise's own error set again: the same one
                self.error = e
                raise
            finally:
                if lease is not None:
                    lease.release()
            return
        nbytes = sum(kv.nbytes for kv in kvs)
        t0 = time.perf_counter()
        try:
            with self.cond:
                while self.error is None and self.pending and self.pending + nbytes > self.max_pending:
                    self.cond.wait()
                self._raise()
                self.pending += nbytes
        except BaseException:
            if lease is not None:
                lease.release()
            raise
        self.stats.encoder_wait_s += time.perf_counter() - t0
        if self.pool is not None:
            kvs = [self.pool.submit(self.store.pack, r.id, r.token_ids, kv) for r, kv in zip(records, kvs)]
        self.items.put((records, kvs, nbytes, on_written, lease))

    def would_wait(self, nbytes: int) -> bool:
        """Whether ``put`` of ``nbytes`` would wait for the writer now (the disk is the bound)."""
        if not self.background:
            return False
        with self.cond:
            return self.error is None and bool(self.pending) and self.pending + nbytes > self.max_pending

    def close(self) -> None:
        """Wait until everything queued is written; raises the writer's error, if any."""
        if not self.background:
            return self._raise()
        self.items.put(_STOP)
        self.thread.join()
        self._shutdown()
        self._raise()

    def _shutdown(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)

    def abort(self) -> None:
        """Stop after the batch being written (the caller failed); never raises."""
        if not self.background:
            return
        with self.cond:
            self.error = self.error or _Aborted()
            self.cond.notify_all()
        self.items.put(_STOP)
        self.thread.join()
        self._shutdown()

    def _raise(self) -> None:
        if self.error is not None and not isinstance(self.error, _Aborted):
            raise self.error

    def _run(self) -> None:
        first = True
        while True:
            t0 = time.perf_counter()
            item = self.items.get()
            waited = time.perf_counter() - t0
            if first:  # the pipeline filling (the first batch's encode), not the encoder's pace
                self.stats.writer_fill_s += waited
                first = False
            else:
                self.stats.writer_idle_s += waited
            if item is _STOP:
                return
            records, kvs, nbytes, on_written, lease = item
            try:
                if self.error is None:
                    try:
                        self._write(records, kvs, on_written)
                    except BaseException as e:  # noqa: BLE001 - re-raised in the encoding thread
                        self.error = e
            finally:
                item = kvs = None   # nothing reads this batch's host buffer past here
                if lease is not None:
                    lease.release()
                with self.cond:
                    self.pending -= nbytes
                    self.cond.notify_all()

    def _write(self, records, kvs, on_written) -> None:
        t0 = time.perf_counter()
        try:
            # a store of one file per chunk names the files (removed again if the build fails); a
            # segment store keeps its own account of what it appended
            path_of = getattr(self.store, "path", None)
            for r, kv in zip(records, kvs):
                if self.pool is not None:  # a future of store.pack: write takes its record
                    t1 = time.perf_counter()
                    kv = kv.result()
                    self.stats.prepare_wait_s += time.perf_counter() - t1
                self.stats.kv_bytes += self.store.write(r.id, r.token_ids, kv)
                if path_of is not None:
                    self.written.append(path_of(r.id))
            if on_written is not None:
                on_written(records)
        finally:
            seconds = time.perf_counter() - t0
            if not self.stats.first_write_s:
                self.stats.first_write_s = seconds
            self.stats.write_s += seconds


def staging_bytes(shape, batches, wrapper_slots: int, per_token: float, quantize: str | None) -> int:
    """The bytes of a staging buffer that holds any of ``batches``' host KV (each chunk with its
    wrapper slots' tokens): per token as the encode hands it, plus the tensors' aligned starts
    (a batch's few layer-major tensors; int4's six per chunk, each chunk quantised alone) and, for
    int4, each chunk's last key group's scales and zeros in whole (``per_token`` counts whole
    groups)."""
    largest = max(sum(len(r.token_ids) + wrapper_slots for r in b) for b in batches)
    slot = largest * per_token + 8 * ALIGN
    if quantize == "int4":
        tail = 4 * shape.num_layers * shape.num_kv_heads * shape.head_dim
        slot += max(map(len, batches)) * (tail + 6 * ALIGN)
    return int(slot)


def engine_quantizes(kv_dtype, device: torch.device) -> str | None:
    """The format ("fp8", "int4") in which the build's encode hands a quantised store its KV, or
    None: off the CPU the engine quantises on its device (the store's own rules,
    kernels.quantize_rows and kv_int4), which on the host took the writer longer than the disk
    took to write it (the 8B fp8 build waited 9.8 s of its 22.6 s on its prepare threads; the 8B
    int4 build ran at 769 tokens/s); on the CPU the store quantises as it writes."""
    if device.type == "cpu":
        return None
    return "fp8" if kv_dtype == FP8 else "int4" if kv_dtype == INT4 else None


class EncodeWarmup:
    """A machine's first build compiles the encode's attention kernel in its first batch (seconds
    of Triton compile, and CUDA's first use of the forward's other kernels) while the disk waits.
    On a CUDA device this encodes two short chunks on a thread of its own as soon as the build
    knows how it will encode (wrapper, shared prefix, fp8 or not), so that the compile overlaps
    the build's chunking, tokenizing and embedding. An encode batch of any size launches the
    kernel variant of a full batch (kernels.prefill: ``PrefillPlan.full_batch``), so the build's
    batches find it compiled. The engine's lock orders the two: a first batch that comes while
    the warm-up still runs waits for it, which costs no more than compiling in that batch would.
    A warm-up that fails is logged and ignored: the build's own encode meets the same error and
    raises it."""

    # two chunks (one would take SDPA, not the packed kernel launch: model_runner's pack_fresh),
    # each long enough for the tiles of a real chunk (kernels.prefill.runs_rows: more than one
    # 128-row tile with up to 16 query heads per KV head)
    CHUNKS, TOKENS = 2, 131

    def __init__(self, llm, shared_prefix, wrapper, kv_dtype):
        self.seconds = 0.0
        self.started = time.perf_counter()
        self.ended: float | None = None
        self.error: BaseException | None = None
        # quantised as the build's batches will be, so that it compiles their kernels
        args = (llm.engine, tuple(shared_prefix), wrapper, engine_quantizes(kv_dtype, llm.device))
        self.thread = threading.Thread(target=self._run, args=args, name="lazy-rag-encode-warmup", daemon=True)
        self.thread.start()

    def _run(self, engine, prefix, wrapper, quantize) -> None:
        t0 = time.perf_counter()
        try:
            engine.encode_chunks([[1] * self.TOKENS] * self.CHUNKS, prefix, wrapper, cache=False, quantize=quantize)
        except BaseException as e:  # noqa: BLE001 - the build's own encode raises it where it matters
            self.error = e
            log.warning("The encode warm-up failed (%s: %s); the build's first batch compiles instead.",
                        type(e).__name__, e)
        finally:
            self.ended = time.perf_counter()
            self.seconds = self.ended - t0

    def wait(self) -> float:
        """Waits for the warm-up; its seconds."""
        self.thread.join()
        return self.seconds

    @staticmethod
    def wanted(llm) -> bool:
        return llm.device.type == "cuda" and torch.cuda.is_available()


class _Aborted(Exception):
    pass


def batches_by_tokens(records, batch_tokens: int):
    """Consecutive slices of ``records`` of at most ``batch_tokens`` tokens (one record larger
    than that is a batch of its own), balanced: as few batches as the budget allows, of about
    equal size, instead of full batches and a small remainder. A small last batch picks other
    attention-kernel settings than the full ones (kernels.prefill.runs_rows), and on a machine's
    first build compiling those took seconds, as long as several batches' encodes."""
    records = list(records)
    sizes = [len(r.token_ids) for r in records]
    n_batches, n = 0, 0   # as many batches as filling each up to the budget makes
    for t in sizes:
        if n and n + t > batch_tokens:
            n_batches, n = n_batches + 1, 0
        n += t
    n_batches += 1 if n else 0
    target = sum(sizes) / max(1, n_batches)
    batch, n, done, k = [], 0, 0, 1
    for r, t in zip(records, sizes):
        # a record whose middle lies past this batch's share starts the next batch
        if batch and (n + t > batch_tokens or done + n + t / 2 > k * target):
            yield batch
            done += n
            k += 1
            batch, n = [], 0
        batch.append(r)
        n += t
    if batch:
        yield batch


def encode_and_write(llm, store, records, wrapper, bar, written: list, *, batch_tokens: int | None = None,
                     max_pending_bytes: int | None = None, background: bool | None = None,
                     beside_writes=None) -> PipelineStats:
    """Encode the KV of ``records`` inside ``wrapper`` and write it to ``store``, the writes
    overlapped with the next batches' encoding (``background``; by default everywhere but on a
    CPU device, where each batch is written after its encode on this thread); ``bar`` advances by
    tokens written, with the rate in its note. Returns the stage times and totals.

    ``beside_writes``: other accelerator work the build has to do (the chunks' embeddings, the
    engine's encode calibration), a callable or a sequence of them, each run once on this thread
    where it costs the build nothing: when a batch finds the writer's queue full (the disk is the
    bound and the accelerator would only wait), one task per such batch, so that the queue's
    bytes cover each task's seconds; what is left once the last batch is queued, beside the
    writer's last writes; never without records. After the build's commit the calibration held a
    machine's first 8B build for its own kernels' compiles while the disk was idle; before the
    first encode the embedding held the first write back."""
    engine = llm.engine
    on_cpu = llm.device.type == "cpu"
    if background is None:
        background = not on_cpu
    batch_tokens = int(batch_tokens or (CPU_BATCH_TOKENS if on_cpu else None) or engine.config.max_batched_tokens)
    quantize = engine_quantizes(store.kv_dtype, llm.device)
    # the KV the encode hands the writer, per token: fp8 or int4 with its scales where the
    # engine quantises, else the model's dtype (the store converts as it writes)
    per_token = build_estimate.kv_bytes_per_token(llm, quantize or "auto")
    if max_pending_bytes is None:  # two batches' KV on the host: one being written, one ready
        max_pending_bytes = int(2 * batch_tokens * per_token)
    stats = PipelineStats()
    # the host copies' pinned buffers, reused batch after batch: one batch encoding, up to two
    # waiting for the disk (max_pending_bytes)
    batches = list(batches_by_tokens(records, batch_tokens))
    staging = None
    if batches and llm.device.type == "cuda" and torch.cuda.is_available():
        # as large as the largest batch (with each chunk's wrapper slots, whose KV comes back
        # with the chunk's) and no more buffers than batches: an update of a few chunks pins a
        # few MB, not three full batches' worth
        slot = staging_bytes(llm.shape, batches, getattr(wrapper, "slots", 0) or 0, per_token, quantize)
        staging = PinnedStaging(min(STAGING_SLOTS, len(batches)), slot)
    try:
        writer = KVWriter(store, written, stats, max_pending_bytes, background=background)
    except BaseException:
        if staging is not None:
            staging.close()
        raise
    t_start = time.perf_counter()

    def progress(done_records):
        n = sum(len(r.token_ids) for r in done_records)
        elapsed = time.perf_counter() - t_start
        if not stats.first_written_s:
            stats.first_written_s = elapsed
        rate = (stats.tokens + n) / elapsed if elapsed > 0 else 0.0
        stats.tokens += n
        stats.chunks += len(done_records)
        bar.advance(n, note=f"{rate:,.0f} tokens/s, {stats.kv_bytes / 2**30:.2f} GiB written")

    beside = list(beside_writes) if isinstance(beside_writes, (list, tuple)) else \
        [beside_writes] if beside_writes is not None else []

    def run_beside() -> None:
        task = beside.pop(0)
        t1 = time.perf_counter()
        if stats.beside_at_batch < 0:
            stats.beside_at_batch = stats.batches
        task()
        stats.beside_s += time.perf_counter() - t1

    try:
        for batch in batches:
            t0 = time.perf_counter()
            lease = staging.lease() if staging is not None else None
            try:
                # not cached in the engine's memory tiers: the KV goes to disk, and a build must
                # not hold a corpus's KV in memory (queries read it from the store)
                kvs = engine.encode_chunks([r.token_ids for r in batch], store.shared_prefix_ids, wrapper,
                                           cache=False, quantize=quantize,
                                           host_alloc=lease.take if lease is not None else None)
            except BaseException:
                if lease is not None:
                    lease.release()
                raise
            stats.encode_s += time.perf_counter() - t0
            if not stats.batches:
                stats.first_encode_s = stats.encode_s
                stats.first_batch_tokens = sum(len(r.token_ids) for r in batch)
            elif stats.batches == 1:
                stats.second_encode_s = stats.encode_s - stats.first_encode_s
            stats.batches += 1
            if lease is not None:
                stats.own_pins += lease.own_pins
                stats.staging_wait_s += lease.waited_s
            if beside and writer.would_wait(sum(kv.nbytes for kv in kvs)):
                try:
                    run_beside()
                except BaseException:  # an interrupt, or the embedding's error (the calibration logs its own)
                    if lease is not None:
                        lease.release()
                    raise
            writer.put(batch, kvs, progress, lease)
            del kvs
        while beside and batches:  # (with nothing to write, nothing to hide them behind)
            run_beside()
        writer.close()
    except BaseException:
        writer.abort()
        raise
    finally:
        if staging is not None:
            staging.close()
    stats.seconds = time.perf_counter() - t_start
    stats.checkpoint_s = getattr(store, "checkpoint_s", 0.0)
    if background:
        stats.bound = "write" if stats.encoder_wait_s > stats.writer_idle_s else "encode"
    else:  # one after the other: the longer stage
        stats.bound = "write" if stats.write_s > stats.encode_s else "encode"
    return stats
