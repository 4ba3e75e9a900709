"""Exact-state tests of the page ledger: page ids, queue order, dedupe, floors and ceilings."""
from __future__ import annotations

import pytest

from orchestrator.core.config import MemberLimit
from orchestrator.core.page_pool import PagePool
from orchestrator.core.types import PageId, PageKey


def key(n: int, lineage: str = "L0") -> PageKey:
    return PageKey(lineage, bytes([n]) * 16)


def test_fresh_pool_allocates_in_id_order() -> None:
    pool = PagePool(4)
    assert pool.counts() == {"free": 4, "used": 0, "cached": 0}
    assert pool.allocate("s", 3) == [0, 1, 2]
    assert [pool.refcount(PageId(p)) for p in range(4)] == [1, 1, 1, 0]
    assert pool.owner(PageId(0)) == "s" and pool.owner(PageId(3)) is None
    assert pool.counts() == {"free": 1, "used": 3, "cached": 0}
    assert pool.num_used_pages("s") == 3
    pool.check_invariants()


def test_keyless_free_first_then_lru_eviction_in_release_order() -> None:
    pool = PagePool(4)
    pages = pool.allocate("s", 3)
    assert pages is not None
    pool.register(pages[0], key(0))
    pool.register(pages[1], key(1))
    for p in pages:           # release 0, 1, 2 in order: 0 and 1 cached (0 least recent), 2 free
        pool.release(p)
    assert pool.counts() == {"free": 2, "used": 0, "cached": 2}
    assert pool.take_evictions() == []
    # Keyless pages first (3 from the start, then 2 released keyless), then evict the LRU head: 0.
    assert pool.allocate("m", 3) == [3, 2, 0]
    assert pool.take_evictions() == [(0, key(0))]
    assert pool.take_evictions() == []
    assert pool.lookup(key(0)) is None and pool.lookup(key(1)) == 1
    assert pool.key_of(PageId(0)) is None and pool.owner(PageId(0)) == "m"
    assert pool.allocate("m", 1) == [1]
    assert pool.take_evictions() == [(1, key(1))]
    assert pool.allocate("m", 1) is None
    pool.check_invariants()


def test_allocate_is_all_or_nothing() -> None:
    pool = PagePool(3)
    assert pool.allocate("s", 2) == [0, 1]
    assert not pool.can_allocate("s", 2)
    assert pool.allocate("s", 2) is None
    assert pool.counts() == {"free": 1, "used": 2, "cached": 0}
    assert pool.allocate("s", 0) == []
    with pytest.raises(ValueError):
        pool.allocate("s", -1)


def test_hit_on_cached_page_leaves_lru_and_changes_eviction_order() -> None:
    pool = PagePool(3)
    pages = pool.allocate("s", 3)
    assert pages == [0, 1, 2]
    for p in pages:
        pool.register(p, key(p))
        pool.release(p)
    assert pool.counts() == {"free": 0, "used": 0, "cached": 3}
    assert pool.lookup(key(0)) == 0
    pool.acquire(PageId(0), "m")          # hit: page 0 leaves the LRU, owned by m now
    assert pool.refcount(PageId(0)) == 1 and pool.owner(PageId(0)) == "m"
    assert pool.counts_by_member() == {"s": {"used": 0, "cached": 2}, "m": {"used": 1, "cached": 0}}
    assert pool.allocate("s", 1) == [1]   # LRU head is now 1, not 0
    pool.release(PageId(0))               # back at the tail: order is 2, 0
    assert pool.allocate("s", 2) == [2, 0]
    assert pool.take_evictions() == [(1, key(1)), (2, key(2)), (0, key(0))]
    pool.check_invariants()


def test_shared_used_page_keeps_owner_and_refcounts() -> None:
    pool = PagePool(2)
    (p,) = pool.allocate("s", 1) or []
    pool.register(p, key(7))
    pool.acquire(p, "m")
    assert pool.refcount(p) == 2 and pool.owner(p) == "s"
    pool.release(p)
    assert pool.refcount(p) == 1 and pool.counts()["used"] == 1
    pool.release(p)
    assert pool.counts() == {"free": 1, "used": 0, "cached": 1}
    with pytest.raises(ValueError):
        pool.release(p)
    assert pool.refcount(p) == 0
    pool.check_invariants()


def test_acquire_free_page_raises() -> None:
    pool = PagePool(2)
    with pytest.raises(ValueError):
        pool.acquire(PageId(0), "s")


def test_register_dedupe_returns_canonical_page() -> None:
    pool = PagePool(4)
    a, b = pool.allocate("s", 2) or []
    assert pool.register(a, key(1)) == a
    assert pool.register(b, key(1)) == a      # mapping does not move
    assert pool.key_of(b) is None and pool.lookup(key(1)) == a
    assert pool.register(a, key(1)) == a      # idempotent
    with pytest.raises(ValueError):
        pool.register(a, key(2))              # one page, one key
    pool.release(b)                           # keyless duplicate goes back to free
    assert pool.counts() == {"free": 3, "used": 1, "cached": 0}
    pool.release(a)
    assert pool.counts() == {"free": 3, "used": 0, "cached": 1}
    with pytest.raises(ValueError):
        pool.register(a, key(3))              # only USED pages get keys
    pool.check_invariants()


def test_drop_key_on_cached_and_used_pages() -> None:
    pool = PagePool(3)
    a, b = pool.allocate("s", 2) or []
    pool.register(a, key(1))
    pool.register(b, key(2))
    pool.release(a)
    pool.drop_key(a)                          # cached -> free
    assert pool.lookup(key(1)) is None and pool.counts() == {"free": 2, "used": 1, "cached": 0}
    pool.drop_key(b)                          # used: just forgets the key
    assert pool.lookup(key(2)) is None and pool.refcount(b) == 1
    pool.release(b)
    assert pool.counts() == {"free": 3, "used": 0, "cached": 0}
    assert pool.allocate("s", 3) == [2, 0, 1]  # free queue order: initial 2, then 0, then 1
    assert pool.take_evictions() == []
    pool.check_invariants()


def test_demote_makes_page_next_to_evict() -> None:
    pool = PagePool(2)
    pages = pool.allocate("s", 2) or []
    for p in pages:
        pool.register(p, key(p))
        pool.release(p)
    pool.demote(PageId(1))
    assert pool.allocate("s", 1) == [1]
    with pytest.raises(ValueError):
        pool.demote(PageId(1))


def test_floor_reserves_pages_from_other_members() -> None:
    pool = PagePool(6, limits={"l": MemberLimit(floor_pages=2)})
    assert pool.num_available_pages("s") == 4 and pool.num_available_pages("l") == 6
    assert pool.allocate("s", 5) is None
    assert pool.allocate("s", 4) == [0, 1, 2, 3]
    assert pool.num_available_pages("s") == 0
    assert pool.allocate("l", 1) == [4]       # l's own use meets part of its floor
    assert pool.num_available_pages("s") == 0  # the last page is still reserved for l
    assert pool.allocate("l", 1) == [5]
    pool.release(PageId(5))                    # l now uses 1: 1 page of floor unmet
    assert pool.num_available_pages("s") == 0
    pool.release(PageId(4))
    assert pool.num_available_pages("s") == 0 and pool.num_available_pages("l") == 2
    pool.check_invariants()


def test_available_pages_total_ignores_current_use() -> None:
    limits = {"l": MemberLimit(floor_pages=2), "s": MemberLimit(ceiling_pages=3)}
    pool = PagePool(6, limits=limits)
    pool.allocate("l", 5)
    assert pool.num_available_pages_total("s") == 3 and pool.num_available_pages_total("m") == 4
    assert pool.num_available_pages_total("l") == 6


def test_ceiling_caps_used_pages_not_cached() -> None:
    pool = PagePool(6, limits={"s": MemberLimit(ceiling_pages=2)})
    assert pool.num_available_pages("s") == 2
    a, b = pool.allocate("s", 2) or []
    assert pool.allocate("s", 1) is None and pool.num_available_pages("m") == 4
    pool.register(a, key(1))
    pool.release(a)                            # cached pages do not count against the ceiling
    assert pool.num_available_pages("s") == 1 and pool.counts_by_member()["s"] == {"used": 1, "cached": 1}
    assert pool.allocate("s", 1) == [2]
    pool.check_invariants()


def test_counts_by_member_lists_known_members_with_zeros() -> None:
    pool = PagePool(4, limits={"l": MemberLimit()}, members=["s", "m"])
    assert pool.counts_by_member() == {m: {"used": 0, "cached": 0} for m in ("s", "m", "l")}
    pool.allocate("x", 1)
    assert pool.counts_by_member()["x"] == {"used": 1, "cached": 0}
    assert pool.num_used_pages() == 1 and pool.num_used_pages("nobody") == 0


def test_check_invariants_detects_corruption() -> None:
    pool = PagePool(2)
    pool.allocate("s", 1)
    pool._refcount[0] = 0   # corrupt: refcount 0 but not queued
    with pytest.raises(AssertionError):
        pool.check_invariants()


def test_free_queue_takes_never_used_pages_then_freed_ones_in_free_order() -> None:
    """The never-used pages are a range, not a queue entry each: the order is still the old queue's."""
    pool = PagePool(4, first_page=2)
    a = pool.allocate("s", 2)
    assert a == [2, 3]
    pool.release(PageId(3))
    pool.release(PageId(2))
    assert pool.counts()["free"] == 4 and PageId(2) in pool._free and PageId(1) not in pool._free
    assert pool.allocate("s", 4) == [4, 5, 3, 2]         # never-used first (id order), then freed (free order)
    pool.release_pages([PageId(5), PageId(4)])
    b = pool.allocate("m", 2)
    assert b == [5, 4]
    pool.check_invariants()


def test_release_pages_is_release_in_turn() -> None:
    one, many = PagePool(8), PagePool(8)
    for pool in (one, many):
        pages = pool.allocate("s", 6)
        for i, page in enumerate(pages[:4]):
            pool.register(page, key(i))
        pool.acquire(pages[0], "m")
    order = [PageId(p) for p in (5, 3, 0, 1, 4, 2, 0)]
    for page in order:
        one.release(page)
    many.release_pages(order)
    for attr in ("_refcount", "_key", "_owner", "_used_by", "_cached_by", "_num_used_pages"):
        assert getattr(one, attr) == getattr(many, attr)
    assert list(one._cached) == list(many._cached) == [3, 1, 2, 0]
    assert one.allocate("s", 4) == many.allocate("s", 4) == [6, 7, 5, 4]
    many.check_invariants()


def test_num_private_counts_pages_referenced_once() -> None:
    pool = PagePool(4)
    pages = pool.allocate("s", 3)
    pool.register(pages[0], key(0))
    pool.acquire(pages[0], "s")
    assert pool.num_private(pages) == 2 and pool.num_private([pages[0]]) == 0
    assert pool.num_private([pages[1]]) == 1 and pool.num_private([]) == 0


def test_register_pages_is_register_in_turn() -> None:
    one, many = PagePool(8), PagePool(8)
    for pool in (one, many):
        pages = pool.allocate("s", 6)
        pool.register(pages[5], key(9))                 # key 9 already held by page 5: page 2 stays keyless
    pairs = [(PageId(0), key(0)), (PageId(1), key(1)), (PageId(2), key(9)), (PageId(3), key(3))]
    for page, k in pairs:
        one.register(page, k)
    many.register_pages([p for p, _ in pairs], [k for _, k in pairs])
    for attr in ("_refcount", "_key", "_owner", "_page_of_key"):
        assert getattr(one, attr) == getattr(many, attr)
    assert many.key_of(PageId(2)) is None and many.lookup(key(9)) == 5
    with pytest.raises(ValueError, match="not in use"):
        many.register_pages([PageId(7)], [key(7)])
    with pytest.raises(ValueError, match="already holds"):
        many.register_pages([PageId(0)], [key(8)])
    many.check_invariants()


def test_acquire_keys_is_lookup_and_acquire_in_turn() -> None:
    one, many = PagePool(8), PagePool(8)
    for pool in (one, many):
        pages = pool.allocate("s", 4)
        for i, page in enumerate(pages[:3]):
            pool.register(page, key(i))
        pool.release_pages([pages[1], pages[2]])        # 1 and 2 cached, 0 still used
    keys = [key(0), None, key(1), key(5), key(2), key(0)]
    expected = []
    for k in keys:
        page = one.lookup(k) if k is not None else None
        if page is not None:
            one.acquire(page, "m")
        expected.append(page)
    assert many.acquire_keys(keys, "m") == expected == [0, None, 1, None, 2, 0]
    for attr in ("_refcount", "_key", "_owner", "_used_by", "_cached_by", "_num_used_pages"):
        assert getattr(one, attr) == getattr(many, attr)
    assert [many.refcount(PageId(p)) for p in range(4)] == [3, 1, 1, 1]
    assert many.owner(PageId(1)) == "m" and many.owner(PageId(0)) == "s"
    many.check_invariants()
