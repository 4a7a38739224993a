"""``PageManager``: who owns each page of the ``PagePool``, reference counts, and eviction.

Two kinds of owners:

- **cached entries** (``CachedEntry``), shared and found by key: a chunk's pages (key
  ``("chunk", id)``, position-free, placed once, read by every request that retrieved the chunk
  at any offset) or a prefix-cache page (key ``("prefix", hash chain)``, one page, valid only
  behind exactly the same token prefix, like vLLM's APC). An entry with ``refs > 0`` is in use
  and never evicted; at ``refs == 0`` it stays cached until its pages are needed.
- **private pages**: a request's own tokens (template, question, generated tokens, Block-
  Attention's materialised copies). Allocated with ``allocate``, returned with ``free``; a full
  prompt page of a prefix-mode request is handed over to the cache with ``adopt``.

``allocate`` evicts unreferenced entries, lowest policy priority first, until enough pages are
free; if even that is not enough it raises ``OutOfPages`` (the scheduler then preempts). Policies:
``lru`` (priority = last use), ``lfu`` (use count, then recency) and ``gdsf`` (Greedy-Dual-Size-
Frequency: L + uses * recompute_cost / pages, L inflating to each victim's priority, so large
cheap entries go first and popular ones stay).
"""
from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Hashable

import numpy as np

from .page_pool import OutOfPages, PagePool


def prefix_hashes(ids: list[int], page_size: int, salt: str = "") -> list[bytes]:
    """One hash per full page of ``ids``, chained over every page before it (vLLM's automatic
    prefix caching): a page is found again only behind exactly the same token prefix, and under
    the same ``salt`` (a tenant's: the chain starts from it, as vLLM's cache_salt)."""
    hashes, prev = [], hashlib.sha256(salt.encode()).digest() if salt else b""
    arr = np.asarray(ids, dtype="<i8")
    for b in range(len(ids) // page_size):
        h = hashlib.sha256(prev)
        h.update(arr[b * page_size:(b + 1) * page_size].tobytes())
        prev = h.digest()
        hashes.append(prev)
    return hashes


@dataclass(eq=False)
class CachedEntry:
    key: Hashable
    pages: list[int]
    num_tokens: int
    cost: float = 1.0  # what recomputing it would cost (tokens encoded); GDSF weighs it
    refs: int = 0
    uses: int = 0
    last_use: int = 0
    priority: float | tuple = 0.0
    meta: dict = field(default_factory=dict)

    @property
    def kind(self) -> str:
        return self.key[0] if isinstance(self.key, tuple) else "chunk"


class LRUPolicy:
    name = "lru"

    def touch(self, e: CachedEntry, clock: int) -> None:
        e.priority = clock

    def evicted(self, e: CachedEntry) -> None:
        pass


class LFUPolicy:
    name = "lfu"

    def touch(self, e: CachedEntry, clock: int) -> None:
        e.priority = (e.uses, clock)

    def evicted(self, e: CachedEntry) -> None:
        pass


class GDSFPolicy:
    name = "gdsf"

    def __init__(self):
        self.L = 0.0

    def touch(self, e: CachedEntry, clock: int) -> None:
        e.priority = self.L + e.uses * e.cost / max(1, len(e.pages))

    def evicted(self, e: CachedEntry) -> None:
        self.L = max(self.L, e.priority)


POLICIES = {"lru": LRUPolicy, "lfu": LFUPolicy, "gdsf": GDSFPolicy}


class PageManager:
    def __init__(self, pool: PagePool, policy: str = "gdsf"):
        if policy not in POLICIES:
            raise ValueError(f"unknown eviction policy {policy!r}; choose one of {', '.join(POLICIES)}")
        self.pool = pool
        self.policy = POLICIES[policy]()
        self.entries: dict[Hashable, CachedEntry] = {}
        self._evictable: dict[Hashable, CachedEntry] = {}  # entries with refs == 0
        self._private: set[int] = set()
        self._clock = 0
        self.counters: Counter = Counter()

    # -- accounting -----------------------------------------------------------------------------
    @property
    def page_size(self) -> int:
        return self.pool.page_size

    @property
    def evictable_pages(self) -> int:
        return sum(len(e.pages) for e in self._evictable.values())

    @property
    def cached_pages(self) -> int:
        return sum(len(e.pages) for e in self.entries.values())

    @property
    def private_pages(self) -> int:
        return len(self._private)

    def can_allocate(self, n: int) -> bool:
        return self.pool.num_free + self.evictable_pages >= n

    def stats(self) -> dict:
        return {**self.counters, "pages_total": self.pool.num_pages, "pages_in_use": self.pool.num_used,
                "pages_cached": self.cached_pages, "pages_cached_unreferenced": self.evictable_pages,
                "pages_private": self.private_pages, "entries": len(self.entries), "policy": self.policy.name}

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    # -- private pages --------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """n private pages, evicting unreferenced cached entries if needed (OutOfPages if impossible)."""
        if n <= 0:
            return []
        self._make_room(n)
        pages = self.pool.alloc(n)
        self._private.update(pages)
        return pages

    def free(self, pages) -> None:
        for p in pages:
            self._private.remove(p)  # KeyError: not a private page (double free or a cached page)
        self.pool.free(pages)

    def _make_room(self, n: int) -> None:
        if self.pool.num_free >= n:
            return
        if not self.can_allocate(n):
            raise OutOfPages(f"need {n} pages: {self.pool.num_free} free, {self.evictable_pages} evictable")
        while self.pool.num_free < n:
            victim = min(self._evictable.values(), key=lambda e: e.priority)
            self._evict(victim)

    def evict_unreferenced(self) -> None:
        for e in list(self._evictable.values()):
            self._evict(e)

    def _evict(self, e: CachedEntry) -> None:
        assert e.refs == 0
        del self._evictable[e.key]
        del self.entries[e.key]
        self.policy.evicted(e)
        self.pool.free(e.pages)
        self.counters["evictions"] += 1
        self.counters["evicted_pages"] += len(e.pages)
        self.counters[f"evictions_{e.kind}"] += 1

    # -- cached entries -------------------------------------------------------------------------
    def lookup(self, key: Hashable) -> CachedEntry | None:
        """The resident entry for key, without taking a reference or counting."""
        return self.entries.get(key)

    def acquire(self, e: CachedEntry) -> CachedEntry:
        self._evictable.pop(e.key, None)
        e.refs += 1
        e.uses += 1
        e.last_use = self._tick()
        self.policy.touch(e, e.last_use)
        return e

    def get(self, key: Hashable) -> CachedEntry | None:
        """Acquire the entry for key if resident (counts a hit), else count a miss and return None."""
        e = self.entries.get(key)
        kind = key[0] if isinstance(key, tuple) else "chunk"
        self.counters[f"{kind}_{'hits' if e is not None else 'misses'}"] += 1
        return self.acquire(e) if e is not None else None

    def release(self, e: CachedEntry) -> None:
        if e.refs <= 0:
            raise RuntimeError(f"entry {e.key!r} released more often than acquired")
        e.refs -= 1
        e.last_use = self._tick()
        self.policy.touch(e, e.last_use)
        if e.refs == 0:
            self._evictable[e.key] = e

    def insert(self, key: Hashable, num_tokens: int, cost: float | None = None, **meta) -> CachedEntry:
        """Allocate pages for a new entry (evicting if needed) and return it acquired once.
        The caller fills the pages (``pool.write_run``)."""
        if key in self.entries:
            raise KeyError(f"{key!r} is already cached")
        n = self.pool.pages_for(num_tokens)
        self._make_room(n)
        e = CachedEntry(key, self.pool.alloc(n), num_tokens, float(num_tokens if cost is None else cost), meta=meta)
        self.entries[key] = e
        self.counters[f"{e.kind}_inserted_pages"] += n
        return self.acquire(e)

    def discard(self, e: CachedEntry) -> None:
        """Drop an entry its only holder never filled (an encode or a copy that failed)."""
        assert e.refs == 1 and self.entries.get(e.key) is e, e.key
        del self.entries[e.key]
        self.pool.free(e.pages)

    def adopt(self, key: Hashable, pages: list[int], num_tokens: int, cost: float | None = None) -> CachedEntry:
        """Turn private pages (already filled) into a cached entry, acquired once by the caller."""
        if key in self.entries:
            raise KeyError(f"{key!r} is already cached")
        for p in pages:
            self._private.remove(p)
        e = CachedEntry(key, list(pages), num_tokens, float(num_tokens if cost is None else cost))
        self.entries[key] = e
        return self.acquire(e)

    # -- prefix caching (vLLM APC) --------------------------------------------------------------
    def prefix_keys(self, token_ids: list[int], salt: str = "") -> list[tuple]:
        """Keys of every full page of token_ids: a hash chain over all pages so far."""
        return [("prefix", h) for h in prefix_hashes(list(token_ids), self.page_size, salt)]

    def match_prefix(self, token_ids: list[int], max_tokens: int, salt: str = "") -> list[CachedEntry]:
        """Acquire the cached pages of the longest page-aligned prefix (at most max_tokens)."""
        found = []
        for key in self.prefix_keys(token_ids[:max_tokens], salt):
            e = self.entries.get(key)
            if e is None:
                break
            found.append(e)
        # acquire tail first, so the chain's head is the most recently used and LRU evicts tails
        # before the head that makes them reachable (as vLLM)
        for e in reversed(found):
            self.acquire(e)
        self.counters["prefix_hit_tokens"] += len(found) * self.page_size
        return found

    def release_all(self, entries: list[CachedEntry]) -> None:
        """Release in reverse order (tails of a prefix chain before its head)."""
        for e in reversed(entries):
            self.release(e)

    # -- invariants (tests) -------------------------------------------------------------------
    def check(self) -> None:
        owned = list(self._private)
        for e in self.entries.values():
            owned.extend(e.pages)
            assert e.refs >= 0
            assert (e.refs == 0) == (e.key in self._evictable), e.key
        assert len(owned) == len(set(owned)), "a page has two owners"
        assert len(owned) == self.pool.num_used, (len(owned), self.pool.num_used)
        assert all(self.pool.is_used(p) for p in owned)
