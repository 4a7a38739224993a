"""The chunk-affinity routing policy as plain functions (``scaleout.affinity``, no Ray): rendezvous
homes, residency votes, the load cap that replicates a hot chunk, the fallback to load balancing,
and the view of what each replica's pool holds."""
import hashlib

import pytest

from lazy_rag.errors import LazyRagError
from lazy_rag.server.scaleout.affinity import (AffinitySettings, ChunkRoute, RendezvousTable, ResidencyView,
                                               RoundRobin, hrw_score, load_cap, rank_replicas)

REPLICAS = tuple(f"replica-{i}" for i in range(8))
KEYS = [f"chunk-{i}" for i in range(2000)]


def home(key, replicas=REPLICAS):
    return replicas[rank_replicas(ChunkRoute((key,)), replicas, [0] * len(replicas))[0]]


def test_rendezvous_scores_are_the_same_in_every_process():
    """Every router must find the same homes: a keyed blake2b of the bytes, not Python's hash()
    (salted per process)."""
    want = int.from_bytes(hashlib.blake2b(b"chunk-1", digest_size=8, key=b"replica-0").digest(), "little")
    assert hrw_score("chunk-1", "replica-0") == want != hrw_score("chunk-1", "replica-1")


def test_homes_spread_evenly_and_a_lost_replica_moves_only_its_own_chunks():
    homes = {k: home(k) for k in KEYS}
    counts = [sum(h == r for h in homes.values()) for r in REPLICAS]
    assert min(counts) > 0.7 * len(KEYS) / len(REPLICAS) and max(counts) < 1.3 * len(KEYS) / len(REPLICAS)
    fewer = REPLICAS[:3] + REPLICAS[4:]  # replica-3 died
    moved = [k for k in KEYS if home(k, fewer) != homes[k]]
    assert moved and all(homes[k] == "replica-3" for k in moved)
    assert len(moved) == counts[3]


def test_a_request_goes_where_its_chunks_are_resident():
    view = ResidencyView()
    view.report("replica-5", ["warm-a", "warm-b"], version=1)
    view.report("replica-2", ["warm-c"], version=1)
    route = ChunkRoute(("warm-a", "cold-x", "warm-b"), (100, 100, 100))
    order = rank_replicas(route, REPLICAS, [0] * 8, view)
    assert REPLICAS[order[0]] == "replica-5"
    # a longer resident chunk outweighs two short ones elsewhere
    route = ChunkRoute(("warm-a", "warm-c"), (10, 500))
    assert REPLICAS[rank_replicas(route, REPLICAS, [0] * 8, view)[0]] == "replica-2"


def test_a_chunk_resident_everywhere_tells_nothing_apart():
    view = ResidencyView()
    for r in REPLICAS:
        view.report(r, ["hot"], version=1)
    view.report("replica-6", ["hot", "warm"], version=2)
    route = ChunkRoute(("hot", "warm"), (2048, 64))  # the hot chunk is longer: it must not decide
    assert REPLICAS[rank_replicas(route, REPLICAS, [0] * 8, view)[0]] == "replica-6"


def test_a_full_home_hands_a_hot_chunk_to_its_next_replica():
    table = RendezvousTable()
    order = table.order("hot", REPLICAS)
    first, second = order[0], order[1]
    queue = [2] * 8
    assert rank_replicas(ChunkRoute(("hot",)), REPLICAS, queue, table=table)[0] == first
    queue[first] = load_cap(queue, AffinitySettings.load_factor)  # its home is at the cap
    assert rank_replicas(ChunkRoute(("hot",)), REPLICAS, queue, table=table)[0] == second
    # a resident copy on a full replica gets no vote either
    view = ResidencyView()
    view.report(REPLICAS[first], ["hot"], version=1)
    assert rank_replicas(ChunkRoute(("hot",)), REPLICAS, queue, view, table=table)[0] == second


def test_past_the_imbalance_threshold_routing_is_by_load():
    view = ResidencyView()
    view.report("replica-0", ["warm"], version=1)
    settings = AffinitySettings(imbalance_threshold=4)
    queue = [9, 1, 0, 2, 3, 3, 3, 3]
    assert rank_replicas(ChunkRoute(("warm",)), REPLICAS, queue, view, settings)[:2] == [2, 1]
    assert rank_replicas(ChunkRoute(()), REPLICAS, [1, 0, 5, 5, 5, 5, 5, 5])[0] == 1  # no chunks: by load


def test_the_view_keeps_what_was_sent_after_a_report_was_taken():
    now = [100.0]
    view = ResidencyView(clock=lambda: now[0])
    view.sent("r", ["a"])
    now[0] = 101.0
    view.sent("r", ["b"])
    view.report("r", ["x"], version=1, taken_at=100.5)  # taken after "a" was sent, before "b"
    assert not view.holds("r", "a") and view.holds("r", "b") and view.holds("r", "x")
    view.report("r", ["y"], version=1, taken_at=200.0)  # the same version again: nothing changes
    assert view.holds("r", "x") and not view.holds("r", "y")
    view.keep_only({"s"})
    assert not view.holds("r", "b") and not view.holds("r", "x")


def test_round_robin_takes_replicas_in_turn():
    rr = RoundRobin()
    assert [rr.rank(3)[0] for _ in range(5)] == [0, 1, 2, 0, 1]


@pytest.mark.parametrize("bad, words", [
    (lambda: ChunkRoute(("a", "b"), (1,)), "2 keys but 1 token counts"),
    (lambda: ChunkRoute(policy="fastest"), "Unknown routing policy 'fastest'"),
    (lambda: AffinitySettings(load_factor=0.5), "load_factor must be at least 1.0"),
    (lambda: AffinitySettings(home_weight=2), "home_weight must be between 0 and 1"),
    (lambda: rank_replicas(ChunkRoute(("a",)), REPLICAS, [0]), "8 replicas but 1 queue lengths"),
])
def test_bad_settings_are_named(bad, words):
    with pytest.raises(LazyRagError, match=words):
        bad()
