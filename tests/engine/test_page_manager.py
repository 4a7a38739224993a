"""Page pool and page manager: plain Python over a small CPU pool."""
import random

import pytest
import torch

from lazy_rag.engine.page_manager import PageManager
from lazy_rag.engine.page_pool import OutOfPages, PagePool


def small_pool(num_pages=16, page_size=4):
    return PagePool(num_layers=2, num_pages=num_pages, num_kv_heads=2, page_size=page_size, head_dim=8)


def test_write_and_read_run_roundtrip_across_pages():
    pool = small_pool()
    pages = pool.alloc(3)
    k, v = torch.randn(2, 9, 2, 8), torch.randn(2, 9, 2, 8)
    pool.write_run(pages, k, v, first_slot=2)
    rk, rv = pool.read_run(pages, 11)
    assert torch.equal(rk[:, 2:], k) and torch.equal(rv[:, 2:], v)
    assert pool.pages_for(9) == 3 and pool.bytes_per_page == 2 * 2 * 2 * 4 * 8 * 4


def test_double_free_and_over_allocation_raise():
    pool = small_pool(num_pages=2)
    p = pool.alloc(2)
    with pytest.raises(OutOfPages):
        pool.alloc(1)
    pool.free(p[:1])
    with pytest.raises(RuntimeError):
        pool.free(p[:1])


def test_a_double_free_inside_one_call_changes_nothing():
    pool = small_pool(num_pages=4)
    p = pool.alloc(2)
    with pytest.raises(RuntimeError, match=f"page {p[0]} freed twice"):
        pool.free([p[0], p[1], p[0]])
    assert pool.num_free == 2 and pool.is_used(p[0]) and pool.is_used(p[1])


def test_cpu_pool_hands_freed_pages_out_first():
    """A long run that allocates and frees (an index build, batch after batch) touches only as
    many pages as it ever holds at once: CPU pool memory is committed as pages are written."""
    pool = small_pool(num_pages=64)
    touched = set()
    for _ in range(50):
        pages = pool.alloc(5)
        touched.update(pages)
        pool.free(pages)
    assert len(touched) == 5
    held = pool.alloc(3)
    pool.free(held[1:])
    assert pool.alloc(2) == held[1:]  # the first freed is handed out first


@pytest.mark.parametrize("policy", ["lru", "lfu", "gdsf"])
def test_referenced_entries_are_never_evicted(policy):
    bm = PageManager(small_pool(num_pages=6), policy)
    a = bm.insert(("chunk", "a"), 8)          # 2 pages, held
    b = bm.insert(("chunk", "b"), 8)          # 2 pages
    bm.release(b)                              # b unreferenced: evictable
    priv = bm.allocate(4)                      # needs b's pages, never a's
    assert bm.lookup(("chunk", "a")) is a and bm.lookup(("chunk", "b")) is None
    assert bm.counters["evictions"] == 1
    with pytest.raises(OutOfPages):
        bm.allocate(1)                         # a is referenced: nothing left to evict
    bm.release(a)
    bm.allocate(1)                             # now a goes
    assert bm.lookup(("chunk", "a")) is None
    bm.free(priv)
    bm.check()


def test_lru_evicts_least_recent_and_gdsf_keeps_popular():
    for policy, survivor in (("lru", "new"), ("gdsf", "hot")):
        bm = PageManager(small_pool(num_pages=4), policy)
        hot = bm.insert(("chunk", "hot"), 4)
        bm.release(hot)
        for _ in range(5):
            bm.release(bm.get(("chunk", "hot")))
        new = bm.insert(("chunk", "new"), 4)
        bm.release(new)
        bm.insert(("chunk", "x"), 12)          # room for only one of hot/new
        assert bm.lookup(("chunk", survivor)) is not None, policy
        bm.check()


def test_prefix_pages_match_only_the_same_prefix():
    bm = PageManager(small_pool(num_pages=16, page_size=4))
    ids = list(range(100, 111))                # 2 full pages + 3 tokens
    pages = bm.allocate(3)
    held = [bm.adopt(key, [p], 4) for key, p in zip(bm.prefix_keys(ids), pages)]
    assert len(held) == 2
    bm.release_all(held)
    assert len(bm.match_prefix(ids, len(ids) - 1)) == 2
    assert len(bm.match_prefix(ids[:4] + [1] + ids[5:], 11)) == 1   # differs in page 2
    assert len(bm.match_prefix([7] + ids[1:], 11)) == 0             # differs in page 1
    assert len(bm.match_prefix(ids, 7)) == 1                        # capped by max_tokens
    bm.free(pages[2:])
    with pytest.raises(KeyError):
        bm.free(pages[2:])


def test_a_prefix_chain_loses_its_tail_pages_before_its_head():
    """An evicted head would make the rest of its chain unreachable (as vLLM, tails go first)."""
    bm = PageManager(small_pool(num_pages=6, page_size=4), "lru")
    ids = list(range(100, 124))                # 6 full pages
    held = [bm.adopt(key, [p], 4) for key, p in zip(bm.prefix_keys(ids), bm.allocate(6))]
    bm.release_all(held)
    assert len(bm.match_prefix(ids, len(ids))) == 6
    bm.release_all([bm.lookup(k) for k in bm.prefix_keys(ids)])
    bm.allocate(2)                             # room for a newcomer: two pages evicted
    found = bm.match_prefix(ids, len(ids))
    assert len(found) == 4 and [e.key for e in found] == bm.prefix_keys(ids)[:4]


def test_random_requests_never_free_a_referenced_page_and_never_leak():
    """Thousands of random requests (chunks shared at random, private pages, prefix pages)."""
    rng = random.Random(0)
    for policy in ("lru", "lfu", "gdsf"):
        pool = small_pool(num_pages=48, page_size=4)
        bm = PageManager(pool, policy)
        live = []  # (entries held, private pages)
        for step in range(1500):
            if live and (rng.random() < 0.45 or len(live) > 6):
                held, priv = live.pop(rng.randrange(len(live)))
                # contents of held pages must be intact right up to release
                for e in held:
                    assert all(pool.is_used(p) for p in e.pages)
                    assert int(pool.k[0, e.pages[0], 0, 0, 0]) == hash(e.key) % 1000
                bm.release_all(held)
                bm.free(priv)
            else:
                held, priv = [], []
                try:
                    for c in rng.sample(range(30), rng.randint(0, 3)):
                        key = ("chunk", c)
                        e = bm.get(key)
                        if e is None:
                            e = bm.insert(key, rng.choice([3, 4, 9]))
                            pool.k[:, e.pages] = hash(key) % 1000
                        held.append(e)
                    if rng.random() < 0.3:
                        ids = [rng.randrange(3) for _ in range(9)]
                        found = bm.match_prefix(ids, 8)
                        held.extend(found)
                        keys = bm.prefix_keys(ids)
                        for key in keys[len(found):]:
                            if bm.lookup(key) is None:
                                e = bm.adopt(key, bm.allocate(1), 4)
                                pool.k[:, e.pages] = hash(key) % 1000
                                held.append(e)
                    priv = bm.allocate(rng.randint(1, 5))
                    live.append((held, priv))
                except OutOfPages:
                    bm.release_all(held)
                bm.check()
        for held, priv in live:
            bm.release_all(held)
            bm.free(priv)
        bm.check()
        assert bm.private_pages == 0 and all(e.refs == 0 for e in bm.entries.values())
        assert pool.num_used == bm.cached_pages
        assert bm.counters["evictions"] > 0
