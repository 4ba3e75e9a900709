"""Random operation sequences against the page ledger, checked step by step against a simple model."""
from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from orchestrator.core.config import MemberLimit
from eval.baseline.split_pool import SplitPool
from orchestrator.core.page_pool import PagePool
from orchestrator.core.types import PageId, PageKey

MEMBERS = ("s", "m", "l")
KEYS = [PageKey(lineage, bytes([n]) * 16) for lineage in ("A", "B") for n in range(6)]


class PagePoolMachine(RuleBasedStateMachine):
    """The model: the references each page holds (a multiset of holders) and the keys the test gave out."""

    def __init__(self) -> None:
        super().__init__()
        self.pool: PagePool
        self.refs: dict[int, int] = {}          # page -> references this test holds
        self.num_pages = 0

    @initialize(num_pages=st.integers(1, 12), mode=st.sampled_from(["elastic", "limits", "split"]))
    def setup(self, num_pages: int, mode: str) -> None:
        self.num_pages = num_pages
        if mode == "split":
            first = num_pages // 3
            second = num_pages // 3
            parts = {"s": first, "m": second, "l": num_pages - first - second}
            self.pool = SplitPool(num_pages, parts)
        elif mode == "limits":
            limits = {"l": MemberLimit(floor_pages=num_pages // 3), "s": MemberLimit(ceiling_pages=num_pages // 2)}
            self.pool = PagePool(num_pages, limits=limits)
        else:
            self.pool = PagePool(num_pages)
        self.refs = {}

    def held_pages(self) -> list[int]:
        return sorted(p for p, n in self.refs.items() if n > 0)

    @rule(member=st.sampled_from(MEMBERS), n=st.integers(0, 5))
    def allocate(self, member: str, n: int) -> None:
        before_cached = {p for p in range(self.num_pages) if self.pool.is_cached(PageId(p))}
        before_keys = {p: self.pool.key_of(PageId(p)) for p in before_cached}
        can = self.pool.can_allocate(member, n)
        pages = self.pool.allocate(member, n)
        assert (pages is not None) == can
        evictions = self.pool.take_evictions()
        if pages is None:
            assert evictions == []
            return
        assert len(pages) == n and len(set(pages)) == n
        for p in pages:
            assert self.refs.get(p, 0) == 0, f"page {p} handed out while held"
            assert self.pool.refcount(p) == 1 and self.pool.owner(p) == member and self.pool.key_of(p) is None
            self.refs[p] = 1
        # Every eviction was a cached page of this allocation; its key is gone from the map.
        for page, key in evictions:
            assert page in pages and page in before_cached and before_keys[page] == key
            assert self.pool.lookup(key) is None

    @precondition(lambda self: any(self.refs.values()))
    @rule(data=st.data(), member=st.sampled_from(MEMBERS))
    def acquire_used(self, data: st.DataObject, member: str) -> None:
        page = data.draw(st.sampled_from(self.held_pages()))
        before = self.pool.refcount(PageId(page))
        self.pool.acquire(PageId(page), member)
        assert self.pool.refcount(PageId(page)) == before + 1
        self.refs[page] += 1

    @rule(key=st.sampled_from(KEYS), member=st.sampled_from(MEMBERS))
    def hit(self, key: PageKey, member: str) -> None:
        page = self.pool.lookup(key)
        if page is None:
            return
        assert self.pool.key_of(page) == key
        self.pool.acquire(page, member)
        self.refs[page] = self.refs.get(page, 0) + 1
        assert not self.pool.is_cached(page)

    @precondition(lambda self: any(self.refs.values()))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        page = data.draw(st.sampled_from(self.held_pages()))
        self.pool.release(PageId(page))
        self.refs[page] -= 1
        assert self.pool.refcount(PageId(page)) == self.refs[page]

    @rule(page=st.integers(0, 11))
    def release_unheld_raises(self, page: int) -> None:
        if page >= self.num_pages or self.refs.get(page, 0) > 0:
            return
        try:
            self.pool.release(PageId(page))
        except ValueError:
            pass
        else:
            raise AssertionError("release at refcount 0 did not raise")
        assert self.pool.refcount(PageId(page)) == 0

    @precondition(lambda self: any(self.refs.values()))
    @rule(data=st.data(), key=st.sampled_from(KEYS))
    def register(self, data: st.DataObject, key: PageKey) -> None:
        page = PageId(data.draw(st.sampled_from(self.held_pages())))
        current = self.pool.key_of(page)
        if current is not None and current != key:
            return   # one page, one key: tested in the unit tests
        holder = self.pool.lookup(key)
        canonical = self.pool.register(page, key)
        assert canonical == (holder if holder is not None else page)
        assert self.pool.lookup(key) == canonical

    @rule(page=st.integers(0, 11))
    def drop_key(self, page: int) -> None:
        if page >= self.num_pages:
            return
        key = self.pool.key_of(PageId(page))
        self.pool.drop_key(PageId(page))
        assert self.pool.key_of(PageId(page)) is None
        if key is not None:
            assert self.pool.lookup(key) is None

    @invariant()
    def ledger_is_consistent(self) -> None:
        if not self.num_pages:
            return
        self.pool.check_invariants()
        counts = self.pool.counts()
        assert counts["free"] + counts["used"] + counts["cached"] == self.num_pages
        # The pool's refcounts are exactly the references this test holds: none lost, none invented.
        for p in range(self.num_pages):
            assert self.pool.refcount(PageId(p)) == self.refs.get(p, 0) >= 0
        assert counts["used"] == len(self.held_pages())
        by_member = self.pool.counts_by_member()
        assert sum(v["used"] for v in by_member.values()) == counts["used"]
        assert sum(v["cached"] for v in by_member.values()) == counts["cached"]


PagePoolMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestPagePoolStateful = PagePoolMachine.TestCase
