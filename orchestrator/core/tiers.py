"""The disk KV store (bounded bytes, LRU, checksummed files keyed by page layout) and TieredStore, the host and
disk tiers together for pages evicted from the arena (the host store is host_tier.py)."""
from __future__ import annotations

import hashlib
import hmac
import os
import struct
import tempfile
from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import Path

from orchestrator.core.host_tier import HostTier, count_by_lineage
from orchestrator.core.types import PageKey, Tier

_MAGIC = b"MFSKV2"
# magic | layout length (u16) | lineage length (u16) | block hash length (u16) | data length (u64)
# | blake2b-16 checksum | keyed blake2b-16 (zeros without a key); then layout, lineage, block hash, data.
# The layout names the page geometry and KV dtype the bytes were written with ("16384B-float32").
_HEADER = struct.Struct("<6sHHHQ16s16s")
_NO_MAC = bytes(16)
_SUFFIX = ".kv"
_TMP_PREFIX = ".tmp-"


def _checksum(layout: bytes, lineage: bytes, block_hash: bytes, data: bytes, key: bytes | None = None) -> bytes:
    # Covers the layout and the key too: a file renamed, half-written under another key, or written with another
    # page geometry or dtype is never served. With `key`: the keyed checksum (a MAC), which a writer without the
    # key cannot forge.
    h = hashlib.blake2b(digest_size=16, key=key or b"")
    for part in (layout, lineage, block_hash, data):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.digest()


@dataclass(slots=True)
class _DiskEntry:
    path: Path
    data_bytes: int


class DiskTier:
    """One checksummed file per page under `directory`; survives restarts. Capacity counts data bytes (each file
    adds a header of ~52 bytes + the layout and the key). A file of another page size or dtype (page_bytes, dtype)
    is dropped by the start-up scan and a miss on get; so is, on get, one whose keyed checksum (mac_key) does not
    verify (docs/CONFIG.md, Tiers)."""

    def __init__(self, directory: str | Path, capacity_bytes: int, *, page_bytes: int | None = None,
                 dtype: str | None = None, mac_key: bytes | None = None) -> None:
        self.page_bytes = page_bytes
        # the layout tag of its files ("16384B-float32"): pages of another size or dtype are a miss
        self.layout = (f"{page_bytes}B-{dtype or ''}" if page_bytes is not None else (dtype or "")).encode()
        # any length of key: blake2b takes at most 64 bytes, so the tier keys with a digest of it
        self.mac_key = hashlib.blake2b(mac_key, digest_size=32).digest() if mac_key else None
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.capacity_bytes = capacity_bytes
        self.bytes_used = 0
        self._entries: OrderedDict[PageKey, _DiskEntry] = OrderedDict()   # head = least recently used
        self.lineage_counts: Counter[str] = Counter()                     # entries per lineage
        self._scan()

    @property
    def num_entries(self) -> int:
        return len(self._entries)

    def contains(self, key: PageKey) -> bool:
        return key in self._entries

    def keys(self) -> list[PageKey]:
        return list(self._entries)

    def path_for(self, key: PageKey) -> Path:
        # The lineage is an arbitrary string: hash it for a safe, fixed-length file name.
        lineage_hex = hashlib.blake2b(key.lineage.encode("utf-8"), digest_size=8).hexdigest()
        return self.directory / f"{lineage_hex}-{key.block_hash.hex()}{_SUFFIX}"

    def put(self, key: PageKey, data: bytes) -> None:
        """Stores atomically, evicting the least recently used files to make room (a page over capacity: not at
        all)."""
        self.discard(key)
        if len(data) > self.capacity_bytes:
            return
        self._evict_to(self.capacity_bytes - len(data))
        path = self.path_for(key)
        lineage, layout = key.lineage.encode("utf-8"), self.layout
        mac = _checksum(layout, lineage, key.block_hash, data, self.mac_key) if self.mac_key else _NO_MAC
        header = _HEADER.pack(_MAGIC, len(layout), len(lineage), len(key.block_hash), len(data),
                              _checksum(layout, lineage, key.block_hash, data), mac)
        # Temp file + os.replace: readers see the whole old file, the whole new one, or none. No fsync:
        # a power loss may leave garbage under the final name, which the checksum then rejects.
        fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, dir=self.directory)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(header + layout + lineage + key.block_hash)
                f.write(data)
            os.replace(tmp, path)
        except OSError:
            _unlink(Path(tmp))
            return
        self._add(key, path, len(data))

    def get(self, key: PageKey) -> bytes | None:
        """The stored bytes, or None if missing or corrupt (a corrupt file is deleted)."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        data = self._read(key, entry.path)
        if data is None:
            self.discard(key)
            return None
        self._entries.move_to_end(key)
        try:
            os.utime(entry.path)   # keeps the LRU order across restarts (scan sorts by mtime)
        except OSError:
            pass
        return data

    def discard(self, key: PageKey) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._forget(key, entry)

    def _add(self, key: PageKey, path: Path, data_bytes: int) -> None:
        self._entries[key] = _DiskEntry(path, data_bytes)
        self.bytes_used += data_bytes
        count_by_lineage(self.lineage_counts, key.lineage, 1)

    def _forget(self, key: PageKey, entry: _DiskEntry) -> None:
        self.bytes_used -= entry.data_bytes
        count_by_lineage(self.lineage_counts, key.lineage, -1)
        _unlink(entry.path)

    def _evict_to(self, bytes_used: int) -> None:
        """Drops the least recently used files until at most `bytes_used` bytes remain."""
        while self.bytes_used > bytes_used:
            self._forget(*self._entries.popitem(last=False))

    def _read(self, key: PageKey, path: Path) -> bytes | None:
        try:
            raw = path.read_bytes()
        except OSError:
            return None
        parsed = _parse(raw, self.layout, self.mac_key)
        if parsed is None or parsed[0] != key:
            return None
        if self.page_bytes is not None and len(parsed[1]) != self.page_bytes:
            return None
        return parsed[1]

    def _scan(self) -> None:
        """Rebuilds the index from the files: drops temp files and bad headers, then enforces capacity."""
        found: list[tuple[float, PageKey, Path, int]] = []
        for path in self.directory.iterdir():
            if path.name.startswith(_TMP_PREFIX):
                _unlink(path)   # an interrupted put
                continue
            if not path.name.endswith(_SUFFIX) or not path.is_file():
                continue
            parsed = _parse_header(path, self.layout)
            if parsed is None or self.path_for(parsed[0]) != path or \
                    (self.page_bytes is not None and parsed[1] != self.page_bytes):
                _unlink(path)
                continue
            found.append((path.stat().st_mtime, parsed[0], path, parsed[1]))
        # Oldest first: full checksums are verified lazily on get, so a restart stays cheap.
        for _, key, path, data_bytes in sorted(found, key=lambda item: item[0]):
            self._add(key, path, data_bytes)
        self._evict_to(self.capacity_bytes)


def _split(raw: bytes, size: int, layout: bytes) -> tuple[PageKey, int, bytes, bytes] | None:
    """(key, where the data starts, checksum, keyed checksum) from a file's bytes up to its block hash at least and
    the file's size; None if the magic, the lengths, the layout or the key is off."""
    if len(raw) < _HEADER.size:
        return None
    magic, layout_len, lineage_len, hash_len, data_len, checksum, mac = _HEADER.unpack_from(raw)
    start = _HEADER.size + layout_len
    end = start + lineage_len + hash_len
    if magic != _MAGIC or size != end + data_len or len(raw) < end or raw[_HEADER.size:start] != layout:
        return None
    try:
        return PageKey(raw[start:start + lineage_len].decode("utf-8"), raw[start + lineage_len:end]), end, checksum, mac
    except UnicodeDecodeError:
        return None


def _parse(raw: bytes, layout: bytes, mac_key: bytes | None) -> tuple[PageKey, bytes] | None:
    """(key, data) of a whole file, or None if anything (magic, layout, lengths, key, checksums) is off."""
    split = _split(raw, len(raw), layout)
    if split is None:
        return None
    key, start, checksum, mac = split
    lineage, data = key.lineage.encode("utf-8"), raw[start:]
    if _checksum(layout, lineage, key.block_hash, data) != checksum:
        return None
    if mac_key is not None and not hmac.compare_digest(_checksum(layout, lineage, key.block_hash, data, mac_key), mac):
        return None
    return key, data


def _parse_header(path: Path, layout: bytes) -> tuple[PageKey, int] | None:
    """(key, data length) from a file's header only, None for another layout; the checksums are checked on get."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(_HEADER.size)
            if len(head) == _HEADER.size:
                _, layout_len, lineage_len, hash_len, *_ = _HEADER.unpack(head)
                head += f.read(layout_len + lineage_len + hash_len)
    except OSError:
        return None
    split = _split(head, size, layout)
    return (split[0], size - split[1]) if split is not None else None


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


class TieredStore:
    """Host tier in front of the disk tier: host evictions are demoted to disk."""

    def __init__(self, host: HostTier | None, disk: DiskTier | None) -> None:
        self.host = host
        self.disk = disk

    def put(self, key: PageKey, data: bytes) -> Tier | None:
        """Stores in the host tier (disk when there is no host or it is too small); returns where, or None."""
        if self.host is None:
            if self.disk is None:
                return None
            self.disk.put(key, data)
            return Tier.DISK if self.disk.contains(key) else None
        demoted = self.host.put(key, data)
        stored = self.host.contains(key)
        if not stored:
            demoted.append((key, data))   # too big for the host: straight to disk
        elif self.disk is not None:
            self.disk.discard(key)        # one copy per key: the host copy is the newest
        if self.disk is not None:
            for old_key, old_data in demoted:
                self.disk.put(old_key, old_data)
        if stored:
            return Tier.HOST
        return Tier.DISK if self.disk is not None and self.disk.contains(key) else None

    def get(self, key: PageKey) -> tuple[bytes, Tier] | None:
        """The bytes and the tier they came from; the tier copy stays (both copies are valid)."""
        if self.host is not None:
            data = self.host.get(key)
            if data is not None:
                return data, Tier.HOST
        if self.disk is not None:
            data = self.disk.get(key)
            if data is not None:
                return data, Tier.DISK
        return None

    def locate(self, key: PageKey) -> Tier | None:
        """Where a key is, from the in-memory indexes only (no disk read)."""
        if self.host is not None and self.host.contains(key):
            return Tier.HOST
        if self.disk is not None and self.disk.contains(key):
            return Tier.DISK
        return None

    def counts(self) -> dict[str, int]:
        return {"host": self.host.num_entries if self.host is not None else 0,
                "disk": self.disk.num_entries if self.disk is not None else 0}

    def counts_by_lineage(self) -> dict[str, dict[str, int]]:
        """Entries per lineage and tier (O(lineages): each tier keeps its counts)."""
        out: dict[str, dict[str, int]] = {}
        for name, store in (("host", self.host), ("disk", self.disk)):
            for lineage, n in (store.lineage_counts.items() if store is not None else ()):
                out.setdefault(lineage, {"host": 0, "disk": 0})[name] = n
        return out
