"""The static split of the KV pages: each deployment allocates from a slice of its own.

Separate per-member servers each own a fixed share of the accelerator's KV memory. SplitPool is that page source:
one core PagePool per deployment over its own range of page ids (in the split's order), and the ledger the core's
KV cache manager and scheduler read, answering for a page from the pool that holds it and for a member from its
slice. The key map stays one across the slices, as the arena's: a page cached in one slice is found from any
(cross-member sharing, where the family has it, reaches across the slices; a member's new pages are its own).
Members' floors and ceilings (pool.member_limits) hold within their slice. EngineCore takes `split_pool` as
its pool source for the systems with comparison.static_split (eval/composition.py core_parts).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from functools import partial

from orchestrator.core.config import MemberLimit, MFSConfig
from orchestrator.core.family import FamilySpec
from orchestrator.core.page_pool import PagePool
from orchestrator.core.types import PageId, PageKey


def split_pages(num_pages: int, fractions: Mapping[str, float]) -> dict[str, int]:
    """Static split (baseline): pages per member by largest remainder, summing exactly to num_pages."""
    total = sum(fractions.values())
    exact = {m: num_pages * f / total for m, f in fractions.items()}
    pages = {m: int(x) for m, x in exact.items()}
    leftover = num_pages - sum(pages.values())
    for m in sorted(exact, key=lambda m: exact[m] - pages[m], reverse=True)[:leftover]:
        pages[m] += 1
    return pages


class SplitPool(PagePool):
    """The arena's pages in fixed slices, one per member: a PagePool for each over its own page ids. It is a PagePool
    to the core (its KV cache manager and scheduler take one) whose every query and change goes to those pools; it
    keeps no ledger of its own.

    slices: member -> its pages, assigned as contiguous id ranges in the dict's order; they must sum to num_pages
    (split_pages). A member without a slice (or with an empty one) gets no pages. Evictions are reported in the
    order they happened, whichever slice made them."""

    def __init__(self, num_pages: int, slices: dict[str, int], limits: dict[str, MemberLimit] | None = None,
                 members: Iterable[str] = ()) -> None:
        if any(n < 0 for n in slices.values()) or sum(slices.values()) != num_pages:
            raise ValueError(f"slices must be >= 0 and sum to num_pages={num_pages}, got {slices} (use split_pages)")
        self.num_pages, self.first_page, self.sharing_epoch = num_pages, 0, 0
        limits = dict(limits or {})
        known = list(dict.fromkeys([*members, *slices, *limits]))     # every pool counts them all, in this order
        self._pools: list[PagePool] = []
        self._by_member: dict[str, PagePool] = {}
        self._of_page: list[PagePool] = []                               # page id -> the pool holding it
        self._evictions: list[tuple[PageId, PageKey]] = []
        for member, size in slices.items():
            if size == 0:
                continue
            own = {member: limits[member]} if member in limits else None
            pool = PagePool(size, own, known, first_page=len(self._of_page))
            self._pools.append(pool)
            self._by_member[member] = pool
            self._of_page.extend([pool] * size)

    def members_sharing(self, member: str) -> frozenset[str] | None:
        return frozenset((member,))

    def _epoch(self) -> None:
        self.sharing_epoch = sum(pool.sharing_epoch for pool in self._pools)

    # ------------------------------------------------------------------------- capacity
    def num_available_pages(self, member: str) -> int:
        pool = self._by_member.get(member)
        return 0 if pool is None else pool.num_available_pages(member)

    def num_available_pages_total(self, member: str) -> int:
        pool = self._by_member.get(member)
        return 0 if pool is None else pool.num_available_pages_total(member)

    def can_allocate(self, member: str, num_pages: int) -> bool:
        return num_pages <= self.num_available_pages(member)

    def allocate(self, member: str, num_pages: int) -> list[PageId] | None:
        pool = self._by_member.get(member)
        if pool is None:
            if num_pages < 0:
                raise ValueError(f"num_pages must be >= 0, got {num_pages}")
            return [] if num_pages == 0 else None
        pages = pool.allocate(member, num_pages)
        self._evictions.extend(pool.take_evictions())
        return pages

    def take_evictions(self) -> list[tuple[PageId, PageKey]]:
        evictions, self._evictions = self._evictions, []
        return evictions

    # ------------------------------------------------------------------------- references
    def lookup(self, key: PageKey) -> PageId | None:
        for pool in self._pools:
            page = pool.lookup(key)
            if page is not None:
                return page
        return None

    def acquire(self, page: PageId, member: str) -> None:
        self._of_page[page].acquire(page, member)
        self._epoch()

    def release(self, page: PageId) -> None:
        self.release_pages((page,))

    def release_pages(self, pages: Iterable[PageId]) -> None:
        """Each slice's pages released in the order given (the order sets each slice's LRU order)."""
        pages = list(pages)
        of_page = self._of_page
        for pool in self._pools:
            own = [page for page in pages if of_page[page] is pool]
            if own:
                pool.release_pages(own)
        self._epoch()

    def demote(self, page: PageId) -> None:
        self._of_page[page].demote(page)

    def register(self, page: PageId, key: PageKey) -> PageId:
        holder = self.lookup(key)
        if holder is None or self._of_page[page].refcount(page) <= 0:
            return self._of_page[page].register(page, key)
        return holder

    def register_pages(self, pages: Iterable[PageId], keys: Iterable[PageKey]) -> None:
        for page, key in zip(pages, keys):
            self.register(page, key)

    def acquire_keys(self, keys: Iterable[PageKey | None], member: str) -> list[PageId | None]:
        pages: list[PageId | None] = []
        for key in keys:
            page = self.lookup(key) if key is not None else None
            if page is not None:
                self._of_page[page].acquire(page, member)
            pages.append(page)
        self._epoch()
        return pages

    def drop_key(self, page: PageId) -> None:
        self._of_page[page].drop_key(page)

    # ------------------------------------------------------------------------- queries
    def key_of(self, page: PageId) -> PageKey | None:
        return self._of_page[page].key_of(page)

    def refcount(self, page: PageId) -> int:
        return self._of_page[page].refcount(page)

    def owner(self, page: PageId) -> str | None:
        return self._of_page[page].owner(page)

    def num_private(self, pages: list[PageId]) -> int:
        of_page = self._of_page
        return sum(1 for page in pages if of_page[page].refcount(page) == 1)

    def is_cached(self, page: PageId) -> bool:
        return self._of_page[page].is_cached(page)

    def num_used_pages(self, member: str | None = None) -> int:
        return sum(pool.num_used_pages(member) for pool in self._pools)

    def counts(self) -> dict[str, int]:
        total = {"free": 0, "used": 0, "cached": 0}
        for pool in self._pools:
            for state, count in pool.counts().items():
                total[state] += count
        return total

    def counts_by_member(self) -> dict[str, dict[str, int]]:
        total: dict[str, dict[str, int]] = {}
        for pool in self._pools:
            for member, counts in pool.counts_by_member().items():
                into = total.setdefault(member, {"used": 0, "cached": 0})
                into["used"] += counts["used"]
                into["cached"] += counts["cached"]
        return total

    def check_invariants(self) -> None:
        """Each slice's invariants, and every key held by one page only across the slices."""
        seen: set[PageKey] = set()
        for pool in self._pools:
            pool.check_invariants()
            for page in range(pool.first_page, pool.first_page + pool.num_pages):
                key = pool.key_of(PageId(page))
                assert key is None or key not in seen, f"key {key} held in two slices"
                if key is not None:
                    seen.add(key)


def split_pool(fractions: dict[str, float], config: MFSConfig, family: FamilySpec) -> SplitPool:
    """The arena's pages (config.num_arena_pages) split by `fractions` (member -> share): EngineCore's pool
    source, bound to the fractions with `split_pool_source`."""
    num_pages = config.num_arena_pages()
    return SplitPool(num_pages, split_pages(num_pages, fractions), limits=config.pool.member_limits,
                     members=family.member_names)


def split_pool_source(fractions: dict[str, float]) -> partial[SplitPool]:
    """The pool source of a static split (a module-level partial: it pickles into an engine process)."""
    return partial(split_pool, dict(fractions))
