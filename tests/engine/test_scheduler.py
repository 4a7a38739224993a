"""Scheduler with a fake model runner: continuous batching, budgets, preemption + recompute."""
import random
import zlib

import pytest

from lazy_rag.engine.page_manager import PageManager
from lazy_rag.engine.page_pool import OutOfPages, PagePool
from lazy_rag.engine.scheduler import RequestTooLarge, Scheduler
from lazy_rag.engine.sequence import Sequence, Status
from lazy_rag.requests import SamplingParams
from lazy_rag.segments import PromptLayout


class FakePlanner:
    """Private pages only: ceil(kv tokens / page_size) pages per sequence."""

    def __init__(self, num_pages, page_size=4):
        self.pm = PageManager(PagePool(1, num_pages, 1, page_size, 2))

    def admit(self, seq):
        try:
            seq.private = self.pm.allocate(self.pm.pool.pages_for(seq.num_tokens))
        except OutOfPages:
            return False
        seq.compute_pos = list(range(seq.num_tokens))
        seq.needs_prefill = True
        return True

    def ready(self, seq):
        return True

    def append_slot(self, seq):
        if len(seq.private) * self.pm.page_size >= seq.kv_len + 1:
            return True
        try:
            seq.private += self.pm.allocate(1)
            return True
        except OutOfPages:
            return False

    def release(self, seq):
        self.pm.free(seq.private)
        seq.clear_kv()


def fake_token(tokens):
    """A deterministic 'model': the next token is a hash of everything before it."""
    return zlib.crc32(bytes(str(tokens), "ascii")) % 1000


def run_all(seqs, num_pages, max_num_seqs=8, budget=64, arrivals=None):
    planner = FakePlanner(num_pages)
    sched = Scheduler(planner, max_num_seqs=max_num_seqs, max_batched_tokens=budget)
    pending = list(seqs)
    steps = 0
    while pending or sched.has_work:
        for _ in range(arrivals or len(pending)):
            if pending:
                sched.add(pending.pop(0))
        step = sched.schedule()
        assert step or pending, "no progress"
        assert sum(s.num_prefill_tokens for s in step.prefill) + len(step.decode) <= budget or len(step.prefill) == 1
        assert not set(map(id, step.prefill)) & set(map(id, step.decode))
        for seq in step.prefill:        # recompute: prompt + output so far
            seq.kv_len = seq.num_tokens
            seq.needs_prefill = False
            seq.compute_pos = []
        for seq in step.decode:
            seq.kv_len += 1
        for seq in step.prefill + step.decode:
            assert seq.kv_len == seq.num_tokens
            seq.output.append(fake_token(seq.tokens))
            if len(seq.output) >= seq.params.max_new_tokens:
                sched.finish(seq, "length")
        planner.pm.check()
        steps += 1
    assert planner.pm.private_pages == 0 and planner.pm.pool.num_used == 0
    return sched, steps


def make_seqs(n, seed=0):
    rng = random.Random(seed)
    return [Sequence(PromptLayout(token_ids=[rng.randrange(100) for _ in range(rng.randint(1, 20))]),
                     params=SamplingParams(max_new_tokens=rng.randint(1, 12))) for _ in range(n)]


def test_preemption_and_resumption_give_the_same_tokens():
    roomy, _ = run_all(seqs := make_seqs(40), num_pages=1000)
    tight, _ = run_all(tight_seqs := make_seqs(40), num_pages=12, arrivals=3)
    assert roomy.num_preemptions == 0 and tight.num_preemptions > 0
    assert [s.output for s in seqs] == [s.output for s in tight_seqs]
    assert all(s.status is Status.FINISHED and len(s.output) == s.params.max_new_tokens for s in tight_seqs)


def test_budget_and_max_num_seqs_bound_each_step():
    sched, steps = run_all(make_seqs(30, seed=1), num_pages=1000, max_num_seqs=4, budget=24)
    assert steps > 30 / 4


def test_a_request_larger_than_the_pool_fails_alone():
    planner = FakePlanner(4)
    sched = Scheduler(planner, max_num_seqs=8, max_batched_tokens=64)
    big, small = Sequence(PromptLayout(token_ids=list(range(50)))), Sequence(PromptLayout(token_ids=[1, 2, 3]))
    sched.add(big)
    sched.add(small)
    step = sched.schedule()
    assert [(s, type(e)) for s, e in step.failed] == [(big, RequestTooLarge)] and big.finish_reason == "error"
    assert step.prefill == [small] and list(sched.waiting) == []  # the next one is admitted in the same step


@pytest.mark.parametrize("tenants", [True, False], ids=["tenants", "no_tenants"])
def test_a_flooding_tenant_does_not_hold_another_back(tenants):
    """Two running slots; tenant "flood" queues 12 requests before tenant "b" queues 2. Tenant by
    tenant, b's requests are admitted 2nd and 4th (the first free slots);
    without tenants (arrival order) they wait behind the whole flood."""
    def seq(tenant):
        return Sequence(PromptLayout(token_ids=[1, 2, 3]), params=SamplingParams(max_new_tokens=3),
                        tenant=tenant if tenants else None)

    planner = FakePlanner(1000)
    sched = Scheduler(planner, max_num_seqs=2, max_batched_tokens=64)
    for s in [seq("flood") for _ in range(12)] + (b := [seq("b") for _ in range(2)]):
        sched.add(s)
    admitted = []
    while sched.has_work:
        step = sched.schedule()
        admitted += [s for s in step.prefill if s not in admitted]
        for s in step.prefill + step.decode:
            s.needs_prefill, s.compute_pos = False, []
            s.kv_len = s.num_tokens
            s.output.append(0)
            if len(s.output) >= s.params.max_new_tokens:
                sched.finish(s, "length")
    where = sorted(admitted.index(s) for s in b)
    if tenants:
        assert where == [1, 3], where  # the second slot at once, then the next slot that frees
    else:
        assert where == [12, 13], where
