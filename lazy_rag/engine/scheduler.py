"""``Scheduler``: continuous batching over a waiting queue and a running list.

Each ``schedule()`` builds one step: every running sequence that is decoding gets a slot for its
next token (one token of budget each); sequences whose prefill is pending and whose chunk
transfers have landed are prefilled, oldest first, within what is left of the token budget; then
waiting sequences are admitted (KV reserved by the planner) while memory and ``max_num_seqs``
allow, in arrival order within a tenant and tenant by tenant across them (``Sequence.tenant``:
the tenant with the fewest running sequences goes next), so that a tenant who floods the queue
is served alongside the others instead of ahead of them. A prefill larger than the whole budget
runs alone.

Memory pressure: the planner evicts unreferenced cached pages first (block manager); if a
running sequence still cannot get a page for its next token, the youngest running sequence is
preempted: its KV is released and it goes back to the front of the waiting queue, to be
recomputed (prompt + tokens generated so far) when it is admitted again. A request fails for
memory only if it does not fit in an otherwise empty pool.

The planner (``KVPlanner`` or a test double) answers: ``admit(seq) -> bool``,
``append_slot(seq) -> bool``, ``ready(seq) -> bool``, ``release(seq)``, ``idle() -> bool``.
"""
from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from .sequence import Sequence, Status


class RequestTooLarge(RuntimeError):
    """A request needs more KV pages than the whole pool holds."""


@dataclass
class Step:
    prefill: list[Sequence] = field(default_factory=list)
    decode: list[Sequence] = field(default_factory=list)

    # requests that failed in this step's admission (their own fault: a store that raised, an
    # encode out of memory, too large for the pool), each with its exception
    failed: list = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.prefill or self.decode)


class Scheduler:
    def __init__(self, planner, max_num_seqs: int = 256, max_batched_tokens: int = 16384):
        self.planner = planner
        self.max_num_seqs = max_num_seqs
        self.max_batched_tokens = max_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []     # admission order
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _requeue(self, seq: Sequence) -> None:
        """Its KV released, it waits at the front of the queue to be admitted (and computed) again."""
        self.planner.release(seq)
        self.running.remove(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    def preempt(self, seq: Sequence) -> None:
        self._requeue(seq)
        seq.preemptions += 1
        self.num_preemptions += 1

    def serve_again(self, seq: Sequence) -> None:
        """Its prefill's answer is not taken (recovery ``auto`` found it risky): its KV is released
        and it is admitted again first, with the recovery the engine has set on it."""
        self._requeue(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        self.planner.release(seq)
        self.running.remove(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason

    def _fail_waiting(self, seq: Sequence, error: Exception, step: Step) -> None:
        self.waiting.remove(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = "error"
        step.failed.append((seq, error))

    def _next_waiting(self) -> Sequence:
        """The oldest waiting sequence of the tenant with the fewest running sequences (a
        preempted one is at the front of the queue, so first of its tenant's). Without tenants
        (all None) that is the queue's head."""
        running = Counter(s.tenant for s in self.running)
        best = self.waiting[0]
        fewest = running[best.tenant]
        if fewest:
            for seq in self.waiting:
                if running[seq.tenant] < fewest:
                    best, fewest = seq, running[seq.tenant]
                    if not fewest:
                        break
        return best

    def schedule(self) -> Step:
        step = Step()
        budget = self.max_batched_tokens
        preempted = self.num_preemptions
        # 1. decode slots for running sequences, oldest first (so a victim, the youngest, has not
        # been given a slot yet); preempt the youngest under pressure
        for seq in sorted(self.running, key=lambda s: s.id):
            if seq.status is not Status.RUNNING or seq.needs_prefill:
                continue
            while not self.planner.append_slot(seq):
                victim = max(self.running, key=lambda s: s.id)
                self.preempt(victim)
                if victim is seq:
                    break
            else:
                step.decode.append(seq)
                budget -= 1
        # 2. admitted sequences whose chunks have landed: prefill within the budget
        for seq in self.running:
            if seq.needs_prefill and self.planner.ready(seq):
                if step and seq.num_prefill_tokens > budget:
                    break
                step.prefill.append(seq)
                budget -= seq.num_prefill_tokens
        # 3. admit waiting sequences, tenant by tenant
        # (not in a step that had to preempt: the freed pages are for the running ones)
        while (self.waiting and len(self.running) < self.max_num_seqs and budget > 0
               and self.num_preemptions == preempted):
            seq = self._next_waiting()
            try:
                admitted = self.planner.admit(seq)  # releases what it took if it raises
            except Exception as e:  # this request's fault only: fail it, serve the others
                self._fail_waiting(seq, e, step)
                continue
            if not admitted:
                if self.running:
                    break  # pages come back as running requests finish
                self._fail_waiting(seq, RequestTooLarge(f"request {seq.id} does not fit in the empty KV pool"), step)
                continue
            self.waiting.remove(seq)
            seq.status = Status.RUNNING
            self.running.append(seq)
            if self.planner.ready(seq) and not (step and seq.num_prefill_tokens > budget):
                step.prefill.append(seq)
                budget -= seq.num_prefill_tokens
        return step
