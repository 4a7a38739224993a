"""A soak of the engine: many random requests over a tight page pool, some aborted by their
client, some hit by an injected fault, every finished answer checked against the request's
uninterrupted greedy answer, the host tier's byte bound checked after every wave.

Shared by the CI-sized test (tests/engine/test_engine_faults.py) and the bounded script with
figures (benchmarks/reliability_soak.py), so both exercise the same faults the same way; so is
the workload of requests over shared chunks (``chunk_workload``, the engine tests' too).

Faults, each injected for chosen requests only (the others must not notice):
- ``prepare``: an exception while the planner materialises the request's KV;
- ``oom``: ``torch.OutOfMemoryError`` at the same place (an allocation that failed);
- ``forward``: an exception in a forward that holds the request, once it has its first token
  (the engine re-runs the batch request by request, so only this one fails);
- ``store``: the request reads a chunk from a disk store that raises (``RaisingStore``);
- ``too_large``: a prompt larger than the whole page pool.
"""
from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

import torch

from ..engine import Engine
from ..errors import RequestFailedError
from ..requests import ChunkSource
from ..segments import Chunk

FAULTS = ("prepare", "oom", "forward", "store", "too_large")
MODES = ("lazy", "block", "prefix", "full")
BEYOND_POOL = 50  # tokens a too_large prompt has beyond the whole pool
# what each fault's RequestFailedError must name
FAULT_MESSAGES = {"prepare": "injected fault", "oom": "out of memory", "forward": "injected forward fault",
                  "store": "Input/output error", "too_large": "does not fit"}


class RaisingStore:
    """A chunk store whose disk is gone."""
    precomputed = True
    shared_prefix_ids = ()

    def read(self, chunk_id, token_ids):
        raise OSError(5, "Input/output error", f"kv/{chunk_id}.safetensors")

    def write_back(self, chunk_id, token_ids, kv):
        raise AssertionError("never reached: the read raised")


def page_leaks(eng: Engine) -> dict:
    """Pages still held once every request is over: private pages (a request's own), pages in
    use that no cache entry accounts for, and pages in use after the caches are cleared. All
    zero when nothing leaked. Clears the engine's caches."""
    eng.pm.check()  # the page manager's own invariants (ref counts, free list)
    st = eng.stats()
    leaks = {"pages_private": st["pages_private"], "pages_unaccounted": st["pages_in_use"] - st["pages_cached"]}
    eng.clear_cache()
    leaks["pages_in_use_after_clear"] = eng.stats()["pages_in_use"]
    return leaks


def host_tier_ok(eng: Engine) -> bool:
    """The host tier within its byte bound, and its byte count equal to what it holds."""
    host = eng.tiers.host
    return host.bytes <= host.max_bytes and host.bytes == sum(host.size_of(v) for v in host._items.values())


class FaultInjector:
    """Wraps the engine's planner and runner so that the requests registered with ``fail`` fail
    the way named; every other request goes through untouched."""

    def __init__(self, eng: Engine):
        self.eng = eng
        self.kinds: dict[int, str] = {}  # engine sequence id -> fault
        self._materialize, self._run = eng.planner.materialize, eng.runner.run
        eng.planner.materialize = self.materialize
        eng.runner.run = self.run

    def fail(self, seq_id: int, kind: str) -> None:
        self.kinds[seq_id] = kind

    def materialize(self, seq):
        kind = self.kinds.get(seq.id)
        if kind == "prepare":
            raise RuntimeError("injected fault")
        if kind == "oom":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        return self._materialize(seq)

    def run(self, seqs):
        if any(self.kinds.get(s.id) == "forward" and len(s.output) >= 1 for s in seqs):
            raise RuntimeError("CUDA error: an illegal memory access (injected forward fault)")
        return self._run(seqs)

    def remove(self) -> None:
        self.eng.planner.materialize, self.eng.runner.run = self._materialize, self._run


def faulty_request(kind: str, segments, mode: str, pool_tokens: int, serial: int):
    """(segments, source, mode) of a request that ``kind`` makes fail (source None: the host's;
    the other kinds are injected inside the engine by ``FaultInjector``)."""
    if kind == "store":
        # a chunk no other request holds (chunks are shared by content): only the store has it,
        # and only the chunk-reuse modes read stored chunks
        own = Chunk([7000 + (serial * 11 + j) % 40000 for j in range(11)], chunk_id=f"on-disk-{serial}")
        return segments[:1] + [own] + segments[1:], ChunkSource((), RaisingStore()), \
            (mode if mode in ("lazy", "block") else "lazy")
    if kind == "too_large":
        return [list(range(300, 300 + pool_tokens + BEYOND_POOL))], None, mode
    return segments, None, mode


@dataclass
class SoakCounts:
    submitted: int = 0
    finished: int = 0              # answered; each compared with its uninterrupted answer
    mismatched: int = 0            # finished with tokens that differ from the uninterrupted ones
    aborted: int = 0               # closed by the client before it finished
    failed_injected: int = 0       # failed, as its injected fault demands, with the fault's message
    failed_unexpected: int = 0     # failed without a fault, or with the wrong message
    faults_not_raised: int = 0     # a request given a fault that finished anyway
    host_bound_violations: int = 0
    waves: int = 0
    faults: Counter = field(default_factory=Counter)
    modes: Counter = field(default_factory=Counter)
    examples: list = field(default_factory=list)  # the first few problems, for the report

    def problem(self, what: str) -> None:
        if len(self.examples) < 5:
            self.examples.append(what)


def run_soak(eng: Engine, requests, want, n: int, rng: random.Random, *, wave: int = 20,
             abort_rate: float = 0.3, fault_rate: float = 0.05, on_wave=None) -> SoakCounts:
    """Submit ``n`` requests drawn from ``requests`` ((segments, max_new_tokens, mode) each;
    ``want[i]`` its uninterrupted greedy tokens) in waves of ``wave``; a ``fault_rate`` share get
    a fault of a random kind, an ``abort_rate`` share of the others are closed by their client
    (half after their first piece, half while still queued). ``on_wave(counts)`` runs after each
    wave (the script samples memory there)."""
    counts = SoakCounts()
    injector = FaultInjector(eng)
    pool_tokens = eng.pool.num_pages * eng.pool.page_size
    # a pool larger than the model's context cannot be overflowed by one prompt (submit refuses it)
    kinds = [k for k in FAULTS if k != "too_large" or pool_tokens + BEYOND_POOL < eng.host.context_window
             - max(m for _, m, _ in requests)]
    try:
        while counts.submitted < n:
            batch = []
            for _ in range(min(wave, n - counts.submitted)):
                i = rng.randrange(len(requests))
                segments, max_new, mode = requests[i]
                kind = rng.choice(kinds) if rng.random() < fault_rate else None
                source = None
                if kind is not None:
                    segments, source, mode = faulty_request(kind, segments, mode, pool_tokens, counts.submitted)
                h = eng.submit(segments, mode=mode, max_new_tokens=max_new, source=source)
                if kind is not None:
                    injector.fail(h.seq.id, kind)
                    counts.faults[kind] += 1
                counts.submitted += 1
                counts.modes[mode] += 1
                batch.append((i, kind, h))
            for i, kind, h in batch:
                if kind is None and rng.random() < abort_rate:
                    if rng.random() < 0.5:
                        it = eng.pieces(h)
                        try:
                            next(it, None)
                        except RequestFailedError:
                            pass  # it failed before its first piece: counted with the failures below
                        it.close()  # a client that went away after its first piece
                    else:
                        eng.abort(h)  # ... or before the engine got to it
            eng.run_until_done()
            counts.waves += 1
            if not host_tier_ok(eng):
                counts.host_bound_violations += 1
                counts.problem(f"wave {counts.waves}: host tier {eng.tiers.host.bytes} B over its bound")
            for i, kind, h in batch:
                if h.error is not None:
                    if kind is not None and FAULT_MESSAGES[kind] in str(h.error):
                        counts.failed_injected += 1
                    else:
                        counts.failed_unexpected += 1
                        counts.problem(f"request {i} ({kind or 'no fault'}) failed: {h.error}")
                elif h.result is not None:
                    if kind == "forward" and len(h.result.token_ids) <= 1:
                        kind = None  # it ended at its first token (EOS): no later forward to fail
                    if kind is not None:
                        counts.faults_not_raised += 1
                        counts.problem(f"request {i} finished despite its {kind} fault")
                        continue
                    counts.finished += 1
                    if h.result.token_ids != want[i]:
                        counts.mismatched += 1
                        counts.problem(f"request {i} ({requests[i][2]}): {h.result.token_ids} != {want[i]}")
                else:
                    counts.aborted += 1
            if on_wave is not None:
                on_wave(counts)
    finally:
        injector.remove()
    return counts


def chunk_workload(n: int, seed: int, num_chunks: int, max_chunk_len: int, max_new: int):
    """``n`` random requests over ``num_chunks`` shared chunks (5..``max_chunk_len`` tokens each):
    a head, three of the chunks, a question; each with 2..``max_new`` new tokens."""
    rng = random.Random(seed)
    chunks = [[rng.randrange(200, 5000) for _ in range(rng.randint(5, max_chunk_len))] for _ in range(num_chunks)]
    head = [rng.randrange(200, 5000) for _ in range(6)]
    reqs = []
    for _ in range(n):
        picked = rng.sample(range(num_chunks), 3)
        segs = [head] + [Chunk(chunks[c], chunk_id=f"c{c}") for c in picked]
        segs.append([rng.randrange(200, 5000) for _ in range(rng.randint(2, 5))])
        reqs.append((segs, rng.randint(2, max_new)))
    return reqs


def with_random_modes(pairs, seed: int):
    """(segments, max_new_tokens) pairs -> (segments, max_new_tokens, mode), the mode drawn at random."""
    rng = random.Random(seed)
    return [(s, m, rng.choice(MODES)) for s, m in pairs]


def uninterrupted_tokens(eng: Engine, requests) -> list[list[int]]:
    """Each request's greedy tokens served alone by a roomy engine (no faults, no aborts)."""
    return [eng.generate([dict(segments=s, mode=md, max_new_tokens=m)])[0].token_ids for s, m, md in requests]
