"""The host KV store for pages evicted from the arena: page contents in host memory, bounded bytes, LRU (in one
part, or in parts that each hold their own lineages, as separate servers' host memory)."""
from __future__ import annotations

from collections import Counter, OrderedDict

from orchestrator.core.types import PageKey


def count_by_lineage(counts: Counter[str], lineage: str, delta: int) -> None:
    """A tier's entries per lineage, kept as entries come and go: the stats read them every half second, and a
    pass over a paper-scale host tier's 10^6 keys was a third of a simulation's CPU."""
    n = counts[lineage] + delta
    if n:
        counts[lineage] = n
    else:
        del counts[lineage]


class _LRU:
    """Entries LRU by bytes within one capacity: the whole host tier, or one part of it."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.bytes_used = 0
        self.entries: OrderedDict[PageKey, bytes] = OrderedDict()   # head = least recently used


class HostTier:
    """Page contents in host memory, LRU by bytes. Capacity counts data bytes.

    In parts (HostTier.in_parts): each part holds the lineages assigned to it and is an LRU of its own size, as
    separate servers each have their own host memory: one part's saves never evict another part's pages."""

    def __init__(self, capacity_bytes: int) -> None:
        self._whole: _LRU | None = _LRU(capacity_bytes)
        self._parts: dict[str, _LRU] = {}
        self._part_of: dict[str, str] = {}                           # lineage -> its part (parts only)
        self.capacity_bytes = capacity_bytes
        self.bytes_used = 0
        self.lineage_counts: Counter[str] = Counter()                # entries per lineage

    @classmethod
    def in_parts(cls, part_bytes: dict[str, int], part_of_lineage: dict[str, str]) -> HostTier:
        """part name -> its bytes, and each lineage's part (one of them); a key of a lineage with no part is never
        stored."""
        tier = cls(sum(part_bytes.values()))
        tier._whole = None
        tier._parts = {name: _LRU(n) for name, n in part_bytes.items()}
        tier._part_of = dict(part_of_lineage)
        return tier

    def _lru(self, key: PageKey) -> _LRU | None:
        if self._whole is not None:
            return self._whole
        part = self._part_of.get(key.lineage)
        return self._parts[part] if part is not None else None

    def _lrus(self) -> list[_LRU]:
        return [self._whole] if self._whole is not None else list(self._parts.values())

    @property
    def num_entries(self) -> int:
        return sum(len(lru.entries) for lru in self._lrus())

    def part_bytes(self) -> dict[str, int]:
        """Each part's capacity ({} when the tier is one LRU)."""
        return {name: lru.capacity_bytes for name, lru in self._parts.items()}

    def contains(self, key: PageKey) -> bool:
        lru = self._lru(key)
        return lru is not None and key in lru.entries

    def keys(self) -> list[PageKey]:
        return [k for lru in self._lrus() for k in lru.entries]

    def room_bytes(self, key: PageKey) -> int:
        """Free bytes where `key` would be stored (its part's, in parts)."""
        lru = self._lru(key)
        return lru.capacity_bytes - lru.bytes_used if lru is not None else 0

    def put(self, key: PageKey, data: bytes) -> list[tuple[PageKey, bytes]]:
        """Stores (replacing any old copy); returns the LRU entries evicted to make room (of the key's part)."""
        self.discard(key)
        lru = self._lru(key)
        if lru is None or len(data) > lru.capacity_bytes:
            return []
        evicted: list[tuple[PageKey, bytes]] = []
        while lru.bytes_used + len(data) > lru.capacity_bytes:
            old_key, old_data = lru.entries.popitem(last=False)
            self._forget(lru, old_key, old_data)
            evicted.append((old_key, old_data))
        lru.entries[key] = bytes(data)
        lru.bytes_used += len(data)
        self.bytes_used += len(data)
        count_by_lineage(self.lineage_counts, key.lineage, 1)
        return evicted

    def get(self, key: PageKey) -> bytes | None:
        lru = self._lru(key)
        if lru is None:
            return None
        data = lru.entries.get(key)
        if data is not None:
            lru.entries.move_to_end(key)
        return data

    def discard(self, key: PageKey) -> None:
        lru = self._lru(key)
        if lru is not None and (data := lru.entries.pop(key, None)) is not None:
            self._forget(lru, key, data)

    def _forget(self, lru: _LRU, key: PageKey, data: bytes) -> None:
        lru.bytes_used -= len(data)
        self.bytes_used -= len(data)
        count_by_lineage(self.lineage_counts, key.lineage, -1)
