"""Per-tenant limits at admission: requests in flight, tokens per minute, document bytes per
request. A refusal is an ``APIError``: 429 with ``Retry-After`` (seconds until the tenant may
send again) for the first two, 413 for documents over the limit.

A tenant's requests in flight are its engine tickets not finished yet (whichever way they end:
done, failed, dropped on a disconnect, or the engine died), plus those still being prepared, so
the count cannot drift from what the engine runs.
"""
from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field

from .protocol import APIError
from .tenants import Tenant, TenantLimits


class TokenBucket:
    """``per_minute`` tokens, refilled continuously up to one minute's worth. A request takes
    what it may use; one larger than a minute's worth is let through when the bucket is full
    (the balance goes negative and later requests wait it out) instead of never."""

    def __init__(self, per_minute: int, clock=time.monotonic):
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self.clock = clock
        self.level = self.capacity
        self._at = clock()

    def _refill(self) -> None:
        now = self.clock()
        self.level = min(self.capacity, self.level + (now - self._at) * self.rate)
        self._at = now

    def take(self, n: int) -> float:
        """Take ``n`` tokens and return 0, or take none and return the seconds until they are there."""
        self._refill()
        need = min(float(n), self.capacity)
        if self.level + 1e-9 < need:
            return (need - self.level) / self.rate
        self.level -= n
        return 0.0

    def give_back(self, n: int) -> None:
        self._refill()
        self.level = min(self.capacity, self.level + n)


@dataclass
class _Usage:
    limits: TenantLimits
    bucket: TokenBucket | None
    preparing: int = 0
    tickets: list = field(default_factory=list)  # (ticket, tokens reserved)


@dataclass
class Lease:
    """One admitted request's hold on its tenant's limits: ``started`` once its ticket exists,
    ``cancel`` if it never got one."""

    quotas: "Quotas"
    usage: _Usage
    tokens: int = 0
    done: bool = False

    def reserve_tokens(self, n: int) -> None:
        self.quotas._reserve_tokens(self, n)

    def started(self, ticket) -> None:
        self.quotas._started(self, ticket)

    def cancel(self) -> None:
        self.quotas._cancel(self)


class Quotas:
    def __init__(self, defaults: TenantLimits, clock=time.monotonic):
        self.defaults = defaults
        self.clock = clock
        self._usage: dict[str, _Usage] = {}
        self._lock = threading.Lock()  # admissions run on the event loop; metrics may read from a thread

    def limits(self, tenant: Tenant) -> TenantLimits:
        return tenant.limits.over(self.defaults)

    def _of(self, tenant: Tenant) -> _Usage:
        u = self._usage.get(tenant.name)
        if u is None:
            limits = self.limits(tenant)
            bucket = TokenBucket(limits.tokens_per_minute, self.clock) if limits.tokens_per_minute else None
            u = self._usage[tenant.name] = _Usage(limits, bucket)
        return u

    def in_flight(self, tenant: Tenant) -> int:
        with self._lock:
            u = self._of(tenant)
            self._settle(u)
            return u.preparing + len(u.tickets)

    def admit(self, tenant: Tenant, document_bytes: int) -> Lease:
        """Before any work on a request: its documents' size and its tenant's requests in flight."""
        with self._lock:
            u = self._of(tenant)
            cap = u.limits.max_document_bytes
            if cap is not None and document_bytes > cap:
                raise APIError(413, f"The request's documents hold {document_bytes} bytes; this key may send at most "
                                    f"{cap} per request (--tenant-max-document-bytes, or max_document_bytes in the "
                                    "API keys file). Send fewer or shorter documents.", param="documents",
                               code="documents_too_large")
            self._settle(u)
            cap = u.limits.max_in_flight
            if cap is not None and u.preparing + len(u.tickets) >= cap:
                raise APIError(429, f"This key has {cap} requests in flight, its limit (--tenant-max-in-flight, or "
                                    "max_in_flight in the API keys file). Retry when one has finished.",
                               type="rate_limit_error", code="tenant_requests_in_flight",
                               headers={"Retry-After": "1"})
            u.preparing += 1
            return Lease(self, u)

    def _reserve_tokens(self, lease: Lease, n: int) -> None:
        """The prompt's tokens plus the most it may generate, from its tenant's minute budget."""
        with self._lock:
            bucket = lease.usage.bucket
            if bucket is None:
                return
            wait = bucket.take(n)
            if wait:
                per_minute = int(bucket.capacity)
                raise APIError(429, f"This key's token budget is spent: the request needs up to {n} tokens (prompt "
                                    f"and max_tokens), the limit is {per_minute} per minute (--tenant-tokens-per-"
                                    "minute, or tokens_per_minute in the API keys file). Retry after the seconds "
                                    "in Retry-After, or ask for fewer max_tokens.", type="rate_limit_error",
                               code="tenant_tokens_per_minute", headers={"Retry-After": str(math.ceil(wait))})
            lease.tokens = n

    def _started(self, lease: Lease, ticket) -> None:
        with self._lock:
            if lease.done:
                return
            lease.done = True
            lease.usage.preparing -= 1
            lease.usage.tickets.append((ticket, lease.tokens))

    def _cancel(self, lease: Lease) -> None:
        """The request never reached the engine: its place and its tokens come back."""
        with self._lock:
            if lease.done:
                return
            lease.done = True
            lease.usage.preparing -= 1
            if lease.tokens and lease.usage.bucket is not None:
                lease.usage.bucket.give_back(lease.tokens)

    @staticmethod
    def _settle(u: _Usage) -> None:
        """Forget finished tickets, giving back the tokens they reserved and did not use."""
        if not any(t.finished for t, _ in u.tickets):
            return
        live = []
        for ticket, reserved in u.tickets:
            if not ticket.finished:
                live.append((ticket, reserved))
                continue
            stats = getattr(ticket.result, "stats", None)
            if u.bucket is not None and stats is not None:  # failed or dropped: charged what it reserved
                u.bucket.give_back(max(0, reserved - stats.prompt_tokens - stats.new_tokens))
        u.tickets = live
