"""Chunk-affinity routing, as plain functions of a request's chunks, the replicas' queue lengths
and what their pools hold (no Ray here: the Serve router in ``router.py`` and the simulation in
``benchmarks/scaleout_sim.py`` both call ``rank_replicas``).

A request goes where most of its chunk tokens are already resident. Each replica reports the
chunks its KV pool holds (``ResidencyView``: the replica's last report plus what was sent to it
since); a chunk held by some replicas but not all votes for those that hold it (one held
everywhere, a hot chunk, tells nothing apart). A chunk no replica holds votes for its home: the
replica that scores highest for it under rendezvous (highest-random-weight) hashing of (chunk
key, replica id). Homes are stable and every router computes the same ones: a cold chunk is
placed on one replica, not on whichever had the shortest queue, and a replica that joins or
leaves moves only the chunks whose home it becomes or was. Votes are counted in tokens (a longer
chunk costs more to place); ties go to the shorter queue.

A load cap keeps a hot chunk from melting its home (bounded loads, as in consistent hashing with
bounded loads): a replica whose queue has reached ``load_factor`` times the mean (plus one) gets
no votes this time, and a homeless chunk's next replica in its rendezvous order takes its vote.
So a chunk hot enough to fill its home gains a second home, then a third: hot chunks are
replicated on a few replicas, cold ones live on one. Past ``imbalance_threshold`` requests
between the longest and the shortest queue, routing is plain load balancing until the queues
even out (as SGLang's router falls back past its imbalance threshold).

``benchmarks/scaleout_sim.py`` measured these choices on the paper's request stream
(docs/scale-out.md): votes from residency lift the pool hit ratio well above votes from homes
alone, most of all under uniform popularity.
"""
from __future__ import annotations

import hashlib
import math
import time
from dataclasses import dataclass
from typing import Sequence

from ...errors import LazyRagError

POLICIES = ("affinity", "round_robin", "least_loaded")
# the routing-stats fields an engine replica reports (Serve's ``record_routing_stats``)
RESIDENT_KEY = "resident_chunks"
VERSION_KEY = "resident_version"
TAKEN_AT_KEY = "resident_at"


@dataclass(frozen=True)
class ChunkRoute:
    """What the router reads of a request (the first argument of the engine deployment's
    ``generate``): its chunks' keys (an index chunk's id, else a hash of its token ids) and their
    lengths in tokens. ``policy`` overrides the deployment's routing for this request (None:
    the deployment's), so that one deployment can measure affinity against round robin."""

    keys: tuple[str, ...] = ()
    tokens: tuple[int, ...] = ()
    policy: str | None = None

    def __post_init__(self):
        if self.tokens and len(self.tokens) != len(self.keys):
            raise LazyRagError(f"ChunkRoute has {len(self.keys)} keys but {len(self.tokens)} token counts.")
        if self.policy is not None and self.policy not in POLICIES:
            raise LazyRagError(f"Unknown routing policy {self.policy!r}; choose one of {', '.join(POLICIES)}.")

    def weights(self) -> tuple[int, ...]:
        return self.tokens or (1,) * len(self.keys)


@dataclass(frozen=True)
class AffinitySettings:
    """``load_factor``: a replica stops being a chunk's home once its queue reaches this times
    the mean queue (plus one request): 1.25 keeps every queue within a quarter of the mean.
    ``imbalance_threshold``: past this many requests between the longest and the shortest
    queue, route by load alone. ``home_weight``: what a chunk held nowhere adds to its home,
    against 1 for a replica that holds a chunk (a resident chunk is a hit now; a home only says
    where the chunk should go)."""

    load_factor: float = 1.25
    imbalance_threshold: int = 32
    home_weight: float = 0.5

    def __post_init__(self):
        if not self.load_factor >= 1.0:
            raise LazyRagError(f"load_factor must be at least 1.0 (1.0: no replica above the mean), got "
                               f"{self.load_factor}.")
        if not 0.0 <= self.home_weight <= 1.0:
            raise LazyRagError(f"home_weight must be between 0 and 1, got {self.home_weight}.")
        if self.imbalance_threshold < 1:
            raise LazyRagError(f"imbalance_threshold must be at least 1 request, got {self.imbalance_threshold}.")


def hrw_score(key: str, replica: str) -> int:
    """The rendezvous weight of ``replica`` for ``key``: 64 bits of a keyed hash, the same in
    every process (Python's ``hash`` of a string is salted per process)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8, key=replica.encode()[:64]).digest(), "little")


class RendezvousTable:
    """Each chunk key's replicas in rendezvous order, remembered for one set of replicas (a
    request's 5 chunks over 64 replicas are 320 hashes; the popular chunks recur)."""

    def __init__(self, max_keys: int = 1 << 16):
        self.max_keys = max_keys
        self._replicas: tuple[str, ...] = ()
        self._orders: dict[str, tuple[int, ...]] = {}

    def order(self, key: str, replicas: tuple[str, ...]) -> tuple[int, ...]:
        """Indices into ``replicas``, the chunk's home first."""
        if replicas != self._replicas:
            self._replicas, self._orders = replicas, {}
        found = self._orders.get(key)
        if found is None:
            scores = [hrw_score(key, r) for r in replicas]
            found = tuple(sorted(range(len(replicas)), key=scores.__getitem__, reverse=True))
            if len(self._orders) >= self.max_keys:  # a bounded memo, not a cache of every chunk ever seen
                self._orders.pop(next(iter(self._orders)))
            self._orders[key] = found
        return found


class ResidencyView:
    """What a router believes each replica's pool holds: the chunk keys the replica last reported
    (``report``), plus the keys of requests sent to it since (``sent``: a request's chunks are
    resident once it runs, and the next report would say so). A report says when it was taken;
    the keys sent before that are in it (or were evicted since), those sent after are kept. The
    router reads the same report on every request until the replica sends a new one: only a new
    version changes anything."""

    def __init__(self, max_sent: int = 1 << 16, clock=time.time):
        self.max_sent = max_sent
        self.clock = clock
        self._reported: dict[str, frozenset] = {}
        self._versions: dict[str, object] = {}
        self._sent: dict[str, dict[str, float]] = {}

    def report(self, replica: str, keys, version, taken_at: float | None = None) -> None:
        if self._versions.get(replica) == version:
            return
        self._versions[replica] = version
        self._reported[replica] = frozenset(keys)
        sent = self._sent.get(replica)
        if sent:
            if taken_at is None:
                sent.clear()
            else:
                for key in [k for k, t in sent.items() if t <= taken_at]:
                    del sent[key]

    def sent(self, replica: str, keys) -> None:
        sent = self._sent.setdefault(replica, {})
        if len(sent) >= self.max_sent:  # no report for a long time: the oldest guesses are the worst
            sent.clear()
        now = self.clock()
        for k in keys:
            sent[k] = now

    def holds(self, replica: str, key: str) -> bool:
        return key in self._sent.get(replica, ()) or key in self._reported.get(replica, ())

    def forget(self, replica: str) -> None:
        for d in (self._reported, self._versions, self._sent):
            d.pop(replica, None)

    def keep_only(self, replicas) -> None:
        """Forget replicas that are gone (a replaced replica comes back under a new id)."""
        live = set(replicas)
        for r in set(self._versions) | set(self._sent):
            if r not in live:
                self.forget(r)


def load_cap(queue_lens: Sequence[int], load_factor: float) -> int:
    """A replica with this many requests in flight gets no votes (bounded loads)."""
    return max(1, math.ceil(load_factor * (sum(queue_lens) + 1) / len(queue_lens)))


def rank_replicas(route: ChunkRoute, replicas: Sequence[str], queue_lens: Sequence[int],
                  residency: ResidencyView | None = None, settings: AffinitySettings = AffinitySettings(),
                  table: RendezvousTable | None = None) -> list[int]:
    """Indices into ``replicas`` (ids that stay the same for a replica's life), the preferred
    first, for a request with ``route``'s chunks, given each replica's ``queue_lens`` (requests
    sent and not finished) and what their pools hold (``residency``; None: homes alone)."""
    n = len(replicas)
    if n != len(queue_lens):
        raise LazyRagError(f"{n} replicas but {len(queue_lens)} queue lengths.")
    if n <= 1:
        return list(range(n))
    by_load = sorted(range(n), key=lambda i: (queue_lens[i], i))
    if not route.keys or max(queue_lens) - min(queue_lens) > settings.imbalance_threshold:
        return by_load
    table = table or RendezvousTable()
    replicas = tuple(replicas)
    cap = load_cap(queue_lens, settings.load_factor)
    open_ = [i for i in range(n) if queue_lens[i] < cap]
    votes = [0.0] * n
    for key, weight in zip(route.keys, route.weights()):
        holders = [i for i in open_ if residency.holds(replicas[i], key)] if residency is not None else []
        if holders:
            if len(holders) < len(open_):  # held everywhere: a hot chunk, no preference
                for i in holders:
                    votes[i] += weight
            continue
        for i in table.order(key, replicas):  # held nowhere open: its home (the first open one)
            if queue_lens[i] < cap:
                votes[i] += weight * settings.home_weight
                break
    # the most votes first; then the shorter queue; then the request's own rendezvous order, so
    # that equal candidates are not always settled in favour of the same replica
    joined = "|".join(route.keys)
    tie = [hrw_score(joined, r) for r in replicas]
    return sorted(range(n), key=lambda i: (-votes[i], queue_lens[i], -tie[i]))


class RoundRobin:
    """The baseline: replicas in turn, whatever the request holds."""

    def __init__(self):
        self._next = 0

    def rank(self, n: int) -> list[int]:
        first = self._next % n if n else 0
        self._next += 1
        return [(first + j) % n for j in range(n)]
