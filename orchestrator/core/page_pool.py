"""The ledger of the KV arena: page states, refcounts, the key->page map, the free queue and the LRU queue."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from operator import itemgetter
from typing import cast

from orchestrator.core.config import MemberLimit
from orchestrator.core.types import PageId, PageKey

# Page states (derived, never stored): FREE = refcount 0 and no key; CACHED = refcount 0 with a key
# (reusable, evictable, LRU); USED = refcount > 0, with or without a key.


class _FreeQueue:
    """The free pages in the order they are taken: the never-used pages in id order (kept as a range, so a
    GPU-sized arena costs nothing to build), then the pages freed since, in the order they were freed."""

    __slots__ = ("next_fresh", "end", "freed")

    def __init__(self, start: int, end: int) -> None:
        self.next_fresh = start                                  # never-used pages: [next_fresh, end)
        self.end = end
        self.freed: OrderedDict[PageId, None] = OrderedDict()    # freed since (values unused)

    def __len__(self) -> int:
        return self.end - self.next_fresh + len(self.freed)

    def __contains__(self, page: int) -> bool:
        return self.next_fresh <= page < self.end or page in self.freed

    def take(self, num_pages: int) -> list[PageId]:
        """The first num_pages free pages (at most len(self)), removed from the queue."""
        fresh = min(num_pages, self.end - self.next_fresh)
        pages = cast(list[PageId], list(range(self.next_fresh, self.next_fresh + fresh)))
        self.next_fresh += fresh
        freed = self.freed
        for _ in range(min(num_pages - fresh, len(freed))):
            pages.append(freed.popitem(last=False)[0])
        return pages

    def push(self, page: PageId) -> None:
        self.freed[page] = None


class PagePool:
    """THE ledger of the arena, in pages: one pool every member allocates from; it never touches page contents.
    Its pages are the ids first_page .. first_page + num_pages - 1 (eval's static split gives each part its own
    range). limits: per member, floor_pages kept available to it and ceiling_pages, the most USED pages it may own.
    A page's owner is the member that allocated it or took it back from the cache; sharing never changes it."""

    def __init__(self, num_pages: int, limits: dict[str, MemberLimit] | None = None, members: Iterable[str] = (),
                 first_page: int = 0) -> None:
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        self.num_pages = num_pages
        self.first_page = first_page
        end = first_page + num_pages
        self._refcount: list[int] = [0] * end
        # Bumped whenever a page's refcount crosses between 1 and 2: until it moves, a holder's count of its
        # private pages changes only by the pages it allocates itself (KVCacheManager.num_private_pages).
        self.sharing_epoch = 0
        self._key: list[PageKey | None] = [None] * end
        self._owner: list[str | None] = [None] * end
        self._page_of_key: dict[PageKey, PageId] = {}
        self._evictions: list[tuple[PageId, PageKey]] = []
        self._limits: dict[str, MemberLimit] = dict(limits or {})
        self._free = _FreeQueue(first_page, end)                    # no key; taken first
        # An ordered set (values unused): O(1) append, pop head, delete anywhere.
        self._cached: OrderedDict[PageId, None] = OrderedDict()     # head = least recently released
        self._floor_members = [m for m, limit in self._limits.items() if limit.floor_pages > 0]
        # Per-owner counters, kept in step with every state change so accounting is O(1).
        self._used_by: dict[str, int] = {}
        self._cached_by: dict[str, int] = {}
        self._num_used_pages = 0
        for member in [*members, *self._limits]:
            self._used_by.setdefault(member, 0)
            self._cached_by.setdefault(member, 0)

    def members_sharing(self, member: str) -> frozenset[str] | None:
        """`member`'s memory scope: the members whose requests draw on the pages its requests draw on (None: every
        member). eval's static split answers {member}."""
        return None

    # ------------------------------------------------------------------------- capacity
    def num_available_pages(self, member: str) -> int:
        """Free + cached pages `member` could get now: the pool's, minus others' unmet floors, up to its ceiling."""
        available = len(self._free) + len(self._cached)
        for other in self._floor_members:
            if other != member:
                available -= max(0, self._limits[other].floor_pages - self._used_by[other])
        limit = self._limits.get(member)
        if limit is not None and limit.ceiling_pages is not None:
            available = min(available, limit.ceiling_pages - self._used_by.get(member, 0))
        return max(0, available)

    def num_available_pages_total(self, member: str) -> int:
        """The most pages `member` could ever hold (everyone else idle): the pool's, minus others' whole floors,
        up to its ceiling."""
        total = self.num_pages - sum(self._limits[m].floor_pages for m in self._floor_members if m != member)
        limit = self._limits.get(member)
        if limit is not None and limit.ceiling_pages is not None:
            total = min(total, limit.ceiling_pages)
        return max(0, total)

    def can_allocate(self, member: str, num_pages: int) -> bool:
        return num_pages <= self.num_available_pages(member)

    def allocate(self, member: str, num_pages: int) -> list[PageId] | None:
        """All or nothing: keyless free pages first, then the least recently released cached pages."""
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        if not self.can_allocate(member, num_pages):
            return None
        pages = self._free.take(num_pages)
        if len(pages) < num_pages:
            keys, cached, cached_by, owners = self._key, self._cached, self._cached_by, self._owner
            for _ in range(num_pages - len(pages)):
                page, _ = cached.popitem(last=False)
                key = keys[page]
                assert key is not None
                # The arena copy is about to be overwritten: record it so the caller can save it to a tier.
                del self._page_of_key[key]
                keys[page] = None
                cached_by[owners[page]] -= 1  # type: ignore[index]
                self._evictions.append((page, key))
                pages.append(page)
        refcount, owners = self._refcount, self._owner
        for page in pages:
            refcount[page] = 1
            owners[page] = member
        self._used_by[member] = self._used_by.get(member, 0) + num_pages
        self._cached_by.setdefault(member, 0)
        self._num_used_pages += num_pages
        return pages

    def take_evictions(self) -> list[tuple[PageId, PageKey]]:
        """(page, key) evicted since the last call; copy them out BEFORE the next step overwrites them."""
        evictions, self._evictions = self._evictions, []
        return evictions

    # ------------------------------------------------------------------------- references
    def lookup(self, key: PageKey) -> PageId | None:
        return self._page_of_key.get(key)

    def acquire(self, page: PageId, member: str) -> None:
        """One more reference; a cached page becomes USED and owned by `member`. Never fails on capacity, but a
        hit leaves the cache: check can_allocate for new pages AFTER acquiring hits."""
        count = self._refcount[page]
        if count == 1:
            self.sharing_epoch += 1        # a private page becomes shared
        elif count == 0:
            if self._key[page] is None:
                raise ValueError(f"page {page} is free (no key, refcount 0): allocate it instead")
            del self._cached[page]
            self._cached_by[self._owner[page]] -= 1  # type: ignore[index]
            self._set_used_owner(page, member)
        self._refcount[page] = count + 1

    def release(self, page: PageId) -> None:
        """One reference less; at 0 a keyed page becomes CACHED at the LRU tail, a keyless one FREE."""
        self.release_pages((page,))

    def release_pages(self, pages: Iterable[PageId]) -> None:
        """release() of each page in turn (the order sets the LRU order); one call for a request's pages."""
        refcount, owners, keys, used_by, cached_by = (self._refcount, self._owner, self._key, self._used_by,
                                                      self._cached_by)
        cached, free = self._cached, self._free
        for page in pages:
            count = refcount[page]
            if count <= 0:
                raise ValueError(f"page {page} released at refcount {count}")
            refcount[page] = count - 1
            if count > 1:
                if count == 2:
                    self.sharing_epoch += 1    # a shared page becomes private to its last holder
                continue
            owner = owners[page]
            assert owner is not None
            used_by[owner] -= 1
            self._num_used_pages -= 1
            if keys[page] is not None:
                cached[page] = None
                cached_by[owner] += 1
            else:
                free.push(page)
                owners[page] = None

    def demote(self, page: PageId) -> None:
        """Moves a CACHED page to the LRU head: evicted first (e.g. its session's TTL expired)."""
        cached = self._cached
        if page not in cached:
            raise ValueError(f"page {page} is not cached")
        cached.move_to_end(page, last=False)

    def register(self, page: PageId, key: PageKey) -> PageId:
        """Gives a USED page its key (its block is full). Returns the canonical page for the key: `page`, or the
        page that already held it (the mapping never moves; `page` stays keyless)."""
        if self._refcount[page] <= 0:
            raise ValueError(f"page {page} is not in use (refcount {self._refcount[page]})")
        holder = self._page_of_key.get(key)
        if holder is not None:
            return holder
        if self._key[page] is not None:
            raise ValueError(f"page {page} already holds key {self._key[page]}, cannot take {key}")
        self._key[page] = key
        self._page_of_key[key] = page
        return page

    def register_pages(self, pages: Iterable[PageId], keys: Iterable[PageKey]) -> None:
        """register() of each (page, key) pair in turn (a full block's pages, one per layer)."""
        for page, key in zip(pages, keys):
            self.register(page, key)

    def acquire_keys(self, keys: Iterable[PageKey | None], member: str) -> list[PageId | None]:
        """lookup() then acquire() of each key in turn (None for a key not in the arena, or a None key)."""
        page_of_key = self._page_of_key
        pages: list[PageId | None] = []
        for key in keys:
            page = page_of_key.get(key) if key is not None else None
            if page is not None:
                self.acquire(page, member)
            pages.append(page)
        return pages

    def drop_key(self, page: PageId) -> None:
        """Forgets a page's key (its contents are not what the key says); a cached page becomes FREE."""
        key = self._key[page]
        if key is None:
            return
        del self._page_of_key[key]
        self._key[page] = None
        if self._refcount[page] == 0:
            del self._cached[page]
            self._cached_by[self._owner[page]] -= 1  # type: ignore[index]
            self._owner[page] = None
            self._free.push(page)

    def _set_used_owner(self, page: PageId, member: str) -> None:
        self._owner[page] = member
        self._used_by[member] = self._used_by.get(member, 0) + 1
        self._cached_by.setdefault(member, 0)
        self._num_used_pages += 1

    # ------------------------------------------------------------------------- queries
    def key_of(self, page: PageId) -> PageKey | None:
        return self._key[page]

    def refcount(self, page: PageId) -> int:
        return self._refcount[page]

    def owner(self, page: PageId) -> str | None:
        return self._owner[page]

    def num_private(self, pages: list[PageId]) -> int:
        """How many of `pages` have refcount 1, counted in C (the peak reservation asks it on every admission)."""
        if len(pages) < 2:
            return sum(1 for page in pages if self._refcount[page] == 1)
        return itemgetter(*pages)(self._refcount).count(1)

    def is_cached(self, page: PageId) -> bool:
        return self._refcount[page] == 0 and self._key[page] is not None

    def num_used_pages(self, member: str | None = None) -> int:
        """USED pages owned by `member` (all USED pages when None)."""
        return self._num_used_pages if member is None else self._used_by.get(member, 0)

    def counts(self) -> dict[str, int]:
        return {"free": len(self._free), "used": self._num_used_pages, "cached": len(self._cached)}

    def counts_by_member(self) -> dict[str, dict[str, int]]:
        """{"used", "cached"} pages by owner, for every member ever known (zeros included)."""
        return {m: {"used": self._used_by[m], "cached": self._cached_by[m]} for m in self._used_by}

    def check_invariants(self) -> None:
        """Every page in exactly one state and queue, the key map a bijection, counters exact."""
        used_by: dict[str, int] = {}
        cached_by: dict[str, int] = {}
        num_free = num_cached = num_used = 0
        for page in range(self.first_page, self.first_page + self.num_pages):
            count, key, owner = self._refcount[page], self._key[page], self._owner[page]
            in_free, in_cached = page in self._free, page in self._cached
            assert count >= 0, f"page {page}: refcount {count} < 0"
            assert key is None or self._page_of_key.get(key) == page, f"page {page}: key {key} not mapped to it"
            if count > 0:
                assert not in_free and not in_cached, f"page {page}: USED but queued"
                assert owner is not None, f"page {page}: USED without owner"
                used_by[owner] = used_by.get(owner, 0) + 1
                num_used += 1
            elif key is not None:
                assert in_cached and not in_free, f"page {page}: CACHED but not (only) in the LRU queue"
                assert owner is not None, f"page {page}: CACHED without owner"
                cached_by[owner] = cached_by.get(owner, 0) + 1
                num_cached += 1
            else:
                assert in_free and not in_cached, f"page {page}: FREE but not (only) in the free queue"
                assert owner is None, f"page {page}: FREE with owner {owner}"
                num_free += 1
        for key, page in self._page_of_key.items():
            assert self._key[page] == key, f"key map: {key} -> page {page} which holds {self._key[page]}"
        queued = len(self._free) + len(self._cached)
        assert queued == num_free + num_cached, f"queues hold {queued} pages, expected {num_free + num_cached}"
        assert num_free + num_cached + num_used == self.num_pages, "pages lost"
        assert num_used == self._num_used_pages, f"used counter {self._num_used_pages} != {num_used}"
        for member in self._used_by:
            assert self._used_by[member] == used_by.get(member, 0), f"{member}: used counter off"
            assert self._cached_by[member] == cached_by.get(member, 0), f"{member}: cached counter off"
        assert set(used_by) <= set(self._used_by) and set(cached_by) <= set(self._cached_by), "unknown owner"
