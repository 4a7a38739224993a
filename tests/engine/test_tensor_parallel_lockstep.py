"""The ranks' lockstep check (``RankGroup.check_lockstep``) over 2 processes with gloo on the CPU.

Deferred, as on CUDA (``defer_lockstep``, set here by hand): a check returns before the other
rank has even started its own, the forward's collectives run meanwhile, and ``settle`` compares
every check since the last one, in order: equal values pass, different ones fail the group on
both ranks naming each rank's values and the forward, and a rank that never answers fails it at
the timeout. Waited for, as on the CPU: a difference fails the check itself.
"""
import datetime
import multiprocessing
import traceback

import pytest
import torch
import torch.distributed as dist

from lazy_rag.engine.rank_group import RankFailedError, RankGroup

FORWARD, OTHER_FORWARD = [5, 2, 40, 10], [5, 2, 41, 10]
REPLAY, OTHER_REPLAY = [9, -1, 77, 0], [9, -1, 78, 0]
SILENT_TIMEOUT_S = 3.0

# each case: the checks (what, rank 0's values, rank 1's values) of one step, in order
CASES = {
    "equal": [("a forward", FORWARD, FORWARD), ("a CUDA graph's replay", REPLAY, REPLAY)],
    "the second differs": [("a forward", FORWARD, FORWARD), ("a CUDA graph's replay", REPLAY, OTHER_REPLAY)],
    "both differ": [("a forward", FORWARD, OTHER_FORWARD), ("a CUDA graph's replay", REPLAY, OTHER_REPLAY)],
}


def _group(store, rank: int, case: str, timeout_s: float = 60.0, deferred: bool = True) -> RankGroup:
    group = RankGroup(rank, 2, dist.PrefixStore(case, store), timeout_s)
    group.defer_lockstep = deferred
    return group


def _step(group: RankGroup, checks, returned=None) -> str | None:
    """One rank's step: each check, then its forward's collective; then ``settle``. What
    ``settle`` raised, or None. ``returned``: set once the first check has returned."""
    for what, *values in checks:
        group.check_lockstep(values[group.rank], what)
        if returned is not None:
            returned.set()
            returned = None
        group.all_reduce(torch.ones(3))   # the forward's collective, before the check is compared
    try:
        group.settle()
    except RankFailedError as e:
        return str(e)
    assert not group.pending_lockstep
    return None


def _waited_check(group: RankGroup) -> str | None:
    try:
        group.check_lockstep(FORWARD if group.rank == 0 else OTHER_FORWARD, "a forward")
    except RankFailedError as e:
        return str(e)
    return None


def _rank1(port: int, returned, finished, results) -> None:
    try:
        store = dist.TCPStore("127.0.0.1", port, 2, False, datetime.timedelta(seconds=60))
        out = {}
        for case, checks in CASES.items():
            group = _group(store, 1, case)
            if case == "equal":   # rank 0's check must not wait for this one's
                assert returned.wait(60), "rank 0's lockstep check waited for rank 1's"
            out[case] = _step(group, checks)
        out["waited"] = _waited_check(_group(store, 1, "waited", deferred=False))
        silent = _group(store, 1, "silent", SILENT_TIMEOUT_S)   # joins, then never gathers
        results.put(out)
        finished.wait(60)
        del silent   # (only now: its closed connection would fail rank 0's gather before the timeout)
    except BaseException:
        results.put(traceback.format_exc())


@pytest.fixture(scope="module")
def ranks():
    """Rank 0 (this process) and rank 1 (a spawned one) through every case: each one's results."""
    ctx = multiprocessing.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, 2, True, datetime.timedelta(seconds=60), wait_for_workers=False)
    returned, finished, results = ctx.Event(), ctx.Event(), ctx.Queue()
    proc = ctx.Process(target=_rank1, args=(store.port, returned, finished, results), daemon=True)
    proc.start()
    try:
        out = {}
        for case, checks in CASES.items():
            out[case] = _step(_group(store, 0, case), checks, returned if case == "equal" else None)
        out["waited"] = _waited_check(_group(store, 0, "waited", deferred=False))
        silent = _group(store, 0, "silent", SILENT_TIMEOUT_S)
        silent.check_lockstep(FORWARD, "a forward")
        with pytest.raises(RankFailedError) as silent_error:
            silent.settle()
        out["silent"] = str(silent_error.value)
        theirs = results.get(timeout=120)
        assert isinstance(theirs, dict), theirs   # (else rank 1's traceback)
        yield out, theirs
    finally:
        finished.set()
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def test_equal_checks_pass_without_either_rank_waiting_at_the_check(ranks):
    ours, theirs = ranks
    assert ours["equal"] is None and theirs["equal"] is None


@pytest.mark.parametrize("case, what, got", [
    ("the second differs", "a CUDA graph's replay", (REPLAY, OTHER_REPLAY)),
    ("both differ", "a forward", (FORWARD, OTHER_FORWARD)),   # the first, in order
])
def test_a_difference_fails_the_step_at_settle_on_every_rank_naming_each_ranks_values(ranks, case, what, got):
    want = f"Tensor-parallel ranks left lockstep before {what} (rank 0: {got[0]}; rank 1: {got[1]})."
    for results in ranks:
        assert results[case] == want


def test_without_deferring_the_check_itself_fails(ranks):
    want = f"Tensor-parallel ranks left lockstep before a forward (rank 0: {FORWARD}; rank 1: {OTHER_FORWARD})."
    for results in ranks:
        assert results["waited"] == want


def test_a_rank_that_never_answers_a_deferred_check_fails_the_group_at_the_timeout(ranks):
    ours, _ = ranks
    assert "lost the other ranks during the lockstep check before a forward" in ours["silent"]
    assert "Connection closed" not in ours["silent"]   # (rank 1 still there)
