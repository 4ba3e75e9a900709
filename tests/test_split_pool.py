"""The static split's page source (eval/baseline/split_pool.py): one core PagePool per member over its own page ids,
one key map across them, evictions in the order they happened."""
from __future__ import annotations

import pytest

from eval.baseline.split_pool import SplitPool, split_pages, split_pool_source
from eval.composition import load_system_config
from orchestrator.core.config import MemberLimit
from orchestrator.core.family import load_family
from orchestrator.core.page_pool import PagePool
from orchestrator.core.types import PageId, PageKey


def key(n: int, lineage: str = "L0") -> PageKey:
    return PageKey(lineage, bytes([n]) * 16)


def test_slices_isolate_members() -> None:
    pool = SplitPool(5, {"s": 2, "l": 3})
    assert pool.num_available_pages("s") == 2 and pool.num_available_pages("l") == 3
    assert pool.num_available_pages("other") == 0 and pool.allocate("other", 1) is None
    assert pool.allocate("s", 2) == [0, 1]
    assert pool.allocate("s", 1) is None      # l's pages are free but not s's
    assert pool.allocate("l", 3) == [2, 3, 4]
    pool.register(PageId(0), key(0))
    pool.release(PageId(0))
    pool.release(PageId(1))
    assert pool.allocate("l", 1) is None      # s's cached and free pages stay s's
    assert pool.allocate("s", 2) == [1, 0]
    assert pool.take_evictions() == [(0, key(0))]
    assert [pool.num_available_pages_total(m) for m in ("s", "l", "x")] == [2, 3, 0]
    pool.check_invariants()


def test_slices_must_cover_the_pool() -> None:
    with pytest.raises(ValueError):
        SplitPool(5, {"s": 2, "l": 2})
    assert split_pages(10, {"s": 0.25, "m": 0.25, "l": 0.5}) == {"s": 3, "m": 2, "l": 5}
    assert split_pages(7, {"a": 1 / 3, "b": 1 / 3, "c": 1 / 3}) == {"a": 3, "b": 2, "c": 2}
    empty = SplitPool(3, {"s": 0, "l": 3})
    assert empty.allocate("s", 0) == [] and empty.allocate("s", 1) is None and empty.allocate("l", 3) == [0, 1, 2]


def test_one_pool_answers_everyone_a_split_each_member_itself() -> None:
    assert PagePool(4).members_sharing("s") is None
    assert SplitPool(4, {"s": 2, "l": 2}).members_sharing("s") == frozenset({"s"})


def test_one_key_map_across_the_slices() -> None:
    """A key cached in one slice is found from any; a second page given the same key keeps the first holder."""
    pool = SplitPool(4, {"s": 2, "l": 2})
    a = pool.allocate("s", 1)[0]
    assert pool.register(a, key(1)) == a
    b = pool.allocate("l", 1)[0]
    assert pool.register(b, key(1)) == a and pool.key_of(b) is None
    pool.release_pages([a, b])
    assert pool.lookup(key(1)) == a and pool.is_cached(a)
    assert pool.acquire_keys([key(1), key(2), None], "l") == [a, None, None]
    assert pool.owner(a) == "l" and pool.refcount(a) == 1
    assert pool.num_used_pages("l") == 1 and pool.num_available_pages("s") == 1   # l holds a page of s's slice
    assert pool.counts() == {"free": 3, "used": 1, "cached": 0}
    pool.check_invariants()


def test_evictions_keep_their_order_across_slices_and_counts_add_up() -> None:
    pool = SplitPool(4, {"s": 2, "l": 2}, members=["s", "m", "l"])
    pages = pool.allocate("s", 2) + pool.allocate("l", 2)
    for n, page in enumerate(pages):
        pool.register(page, key(n))
    pool.release_pages(pages)
    assert pool.counts_by_member() == {"s": {"used": 0, "cached": 2}, "m": {"used": 0, "cached": 0},
                                       "l": {"used": 0, "cached": 2}}
    assert pool.allocate("l", 1) == [2] and pool.allocate("s", 1) == [0]
    assert pool.take_evictions() == [(2, key(2)), (0, key(0))] and pool.take_evictions() == []


def test_sharing_epoch_moves_with_any_slice() -> None:
    pool = SplitPool(4, {"s": 2, "l": 2})
    page = pool.allocate("l", 1)[0]
    epoch = pool.sharing_epoch
    pool.acquire(page, "s")
    assert pool.sharing_epoch > epoch and pool.num_private([page]) == 0
    epoch = pool.sharing_epoch
    pool.release(page)
    assert pool.sharing_epoch > epoch and pool.num_private([page]) == 1


def test_limits_hold_within_a_slice() -> None:
    pool = SplitPool(6, {"s": 3, "l": 3}, limits={"s": MemberLimit(ceiling_pages=2)})
    assert pool.num_available_pages("s") == 2 and pool.num_available_pages("l") == 3
    assert pool.allocate("s", 3) is None


def test_the_pool_source_splits_the_arena_by_the_fractions() -> None:
    config = load_system_config({"pool.num_pages": 10, "comparison.static_split": {"tiny-s": 0.3, "tiny-m": 0.3,
                                                                                    "tiny-l": 0.4}})
    pool = split_pool_source(config.comparison.static_split)(config, load_family(config.family))
    assert isinstance(pool, SplitPool) and pool.num_pages == 10
    assert [pool.num_available_pages_total(m) for m in ("tiny-s", "tiny-m", "tiny-l")] == [3, 3, 4]
