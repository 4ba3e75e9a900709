"""Host and disk tiers: LRU byte bounds, demotion, checksums, temp files, restart."""
from __future__ import annotations

import os
from pathlib import Path

from orchestrator.core.host_tier import HostTier
from orchestrator.core.tiers import DiskTier, TieredStore
from orchestrator.core.types import PageKey, Tier


def key(n: int, lineage: str = "lin/0") -> PageKey:
    return PageKey(lineage, bytes([n]) * 16)


def blob(n: int, size: int = 10) -> bytes:
    return bytes([n]) * size


def test_host_lru_bounds_and_eviction_order() -> None:
    host = HostTier(capacity_bytes=30)
    assert host.put(key(1), blob(1)) == []
    assert host.put(key(2), blob(2)) == []
    assert host.put(key(3), blob(3)) == []
    assert host.get(key(1)) == blob(1)             # 1 becomes most recent: order 2, 3, 1
    assert host.put(key(4), blob(4, 15)) == [(key(2), blob(2)), (key(3), blob(3))]
    assert (host.num_entries, host.bytes_used) == (2, 25)
    assert not host.contains(key(2)) and host.get(key(2)) is None
    assert host.put(key(5), blob(5, 31)) == [] and not host.contains(key(5))   # larger than capacity
    host.put(key(4), blob(9, 5))                    # replace: bytes follow the new value
    assert host.bytes_used == 15 and host.get(key(4)) == blob(9, 5)
    host.discard(key(4))
    host.discard(key(4))
    assert (host.num_entries, host.bytes_used) == (1, 10)


def test_disk_put_get_and_lru(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, capacity_bytes=20)
    disk.put(key(1), blob(1))
    disk.put(key(2), blob(2))
    assert disk.get(key(1)) == blob(1)
    disk.put(key(3), blob(3))                      # evicts 2, the least recently used
    assert disk.keys() == [key(1), key(3)] and disk.bytes_used == 20
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(disk.path_for(k).name for k in (key(1), key(3)))
    disk.put(key(4), blob(4, 21))                  # larger than capacity
    assert not disk.contains(key(4)) and disk.keys() == [key(1), key(3)]
    disk.discard(key(1))
    assert not disk.path_for(key(1)).exists() and disk.get(key(1)) is None


def test_disk_corruption_returns_none_and_removes_file(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, capacity_bytes=100)
    disk.put(key(1), blob(1))
    path = disk.path_for(key(1))
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF                                # flip a data bit
    path.write_bytes(bytes(raw))
    assert disk.get(key(1)) is None
    assert not path.exists() and not disk.contains(key(1)) and disk.bytes_used == 0


def test_disk_truncated_file_and_missing_file(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, capacity_bytes=100)
    disk.put(key(1), blob(1))
    disk.put(key(2), blob(2))
    path = disk.path_for(key(1))
    path.write_bytes(path.read_bytes()[:-3])
    assert disk.get(key(1)) is None and not path.exists()
    disk.path_for(key(2)).unlink()                 # deleted behind our back
    assert disk.get(key(2)) is None and disk.num_entries == 0


def test_disk_restart_recovers_keys_and_bytes(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, capacity_bytes=100)
    disk.put(key(1, "layer:a"), blob(1))
    disk.put(key(2, "layer:b/residual"), blob(2, 7))
    again = DiskTier(tmp_path, capacity_bytes=100)
    assert set(again.keys()) == {key(1, "layer:a"), key(2, "layer:b/residual")}
    assert again.bytes_used == 17
    assert again.get(key(1, "layer:a")) == blob(1)
    assert again.get(key(2, "layer:b/residual")) == blob(2, 7)


def test_disk_scan_cleans_temp_files_and_junk(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, capacity_bytes=100)
    disk.put(key(1), blob(1))
    (tmp_path / ".tmp-abc123").write_bytes(b"half a block")      # an interrupted put
    (tmp_path / "0000-ffff.kv").write_bytes(b"not a block at all")  # bad header
    (tmp_path / "notes.txt").write_text("left alone")
    again = DiskTier(tmp_path, capacity_bytes=100)
    assert again.keys() == [key(1)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([disk.path_for(key(1)).name, "notes.txt"])


def test_disk_restart_enforces_smaller_capacity_oldest_first(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, capacity_bytes=100)
    for n in range(3):
        disk.put(key(n), blob(n))
        os.utime(disk.path_for(key(n)), (1000 + n, 1000 + n))   # explicit ages: 0 oldest
    small = DiskTier(tmp_path, capacity_bytes=20)
    assert small.keys() == [key(1), key(2)]
    assert not disk.path_for(key(0)).exists()


def test_tiered_store_demotes_host_evictions_to_disk(tmp_path: Path) -> None:
    store = TieredStore(HostTier(20), DiskTier(tmp_path, 100))
    assert store.put(key(1), blob(1)) is Tier.HOST
    store.put(key(2), blob(2))
    store.put(key(3), blob(3))                     # host evicts 1 -> disk
    assert store.locate(key(1)) is Tier.DISK and store.locate(key(3)) is Tier.HOST
    assert store.counts() == {"host": 2, "disk": 1}
    assert store.get(key(1)) == (blob(1), Tier.DISK)
    assert store.get(key(3)) == (blob(3), Tier.HOST)
    assert store.locate(key(3)) is Tier.HOST       # a host hit stays in the host
    assert store.put(key(4), blob(4, 50)) is Tier.DISK   # too big for the host
    assert store.locate(key(9)) is None and store.get(key(9)) is None
    store.disk.discard(key(1))
    assert store.locate(key(1)) is None
    assert store.counts_by_lineage() == {"lin/0": {"host": 2, "disk": 1}}


def test_tiered_store_put_again_keeps_one_copy(tmp_path: Path) -> None:
    store = TieredStore(HostTier(20), DiskTier(tmp_path, 100))
    for n in (1, 2, 3):
        store.put(key(n), blob(n))
    assert store.locate(key(1)) is Tier.DISK
    store.put(key(1), blob(1))                     # back into the host (2 demoted), disk copy of 1 dropped
    assert store.locate(key(1)) is Tier.HOST and store.locate(key(2)) is Tier.DISK
    assert store.counts() == {"host": 2, "disk": 1}


def test_tiered_store_without_tiers(tmp_path: Path) -> None:
    only_host = TieredStore(HostTier(10), None)
    only_host.put(key(1), blob(1))
    only_host.put(key(2), blob(2))
    assert only_host.counts() == {"host": 1, "disk": 0} and only_host.locate(key(1)) is None
    only_disk = TieredStore(None, DiskTier(tmp_path, 10))
    assert only_disk.put(key(1), blob(1)) is Tier.DISK
    assert only_disk.get(key(1)) == (blob(1), Tier.DISK)
    nothing = TieredStore(None, None)
    assert nothing.put(key(1), blob(1)) is None and nothing.get(key(1)) is None
    assert nothing.counts() == {"host": 0, "disk": 0}


def test_per_lineage_counts_follow_every_put_eviction_discard_and_restart(tmp_path: Path) -> None:
    """counts_by_lineage is kept as entries come and go (not recounted): it must equal a count over the keys
    after any mix of puts, replacements, evictions (host -> disk -> gone), discards, corrupt reads and a restart."""
    import random

    rng = random.Random(3)
    store = TieredStore(HostTier(60), DiskTier(tmp_path, 120))

    def recount(s: TieredStore) -> dict:
        out: dict = {}
        for name, tier in (("host", s.host), ("disk", s.disk)):
            for k in tier.keys():
                out.setdefault(k.lineage, {"host": 0, "disk": 0})[name] += 1
        return out
    for step in range(400):
        k = key(rng.randrange(40), f"lin/{rng.randrange(3)}")
        op = rng.random()
        if op < 0.6:
            store.put(k, blob(k.block_hash[0], rng.choice([5, 10, 20])))
        elif op < 0.8:
            store.host.discard(k)
            store.disk.discard(k)
        elif op < 0.9:
            store.get(k)
        elif store.disk.keys():                     # a corrupt file: get() drops it
            victim = rng.choice(store.disk.keys())
            store.disk.path_for(victim).write_bytes(b"garbage")
            assert store.disk.get(victim) is None
        assert store.counts_by_lineage() == recount(store), step
    reopened = TieredStore(HostTier(60), DiskTier(tmp_path, 50))    # restart, smaller: the scan evicts
    assert reopened.counts_by_lineage() == recount(reopened) and reopened.disk.num_entries > 0


def test_host_tier_parts_are_separate_lrus() -> None:
    host = HostTier.in_parts({"a": 20, "b": 30}, {"lin/a": "a", "lin/b": "b"})
    assert (host.capacity_bytes, host.part_bytes()) == (50, {"a": 20, "b": 30})
    host.put(key(1, "lin/b"), blob(1))
    for n in range(2, 8):                          # a's saves overflow a's part many times over
        host.put(key(n, "lin/a"), blob(n))
    assert host.contains(key(1, "lin/b"))          # ... and never evict b's page
    assert [k.block_hash[0] for k in host.keys() if k.lineage == "lin/a"] == [6, 7]   # a keeps its two newest
    assert host.room_bytes(key(9, "lin/a")) == 0 and host.room_bytes(key(9, "lin/b")) == 20
    assert host.bytes_used == 30 and host.num_entries == 3
    assert host.put(key(8, "lin/a"), blob(8, 25)) == [] and not host.contains(key(8, "lin/a"))   # over a's part
    assert host.put(key(9, "lin/x"), blob(9)) == [] and not host.contains(key(9, "lin/x"))   # a lineage of no part
    assert host.lineage_counts == {"lin/a": 2, "lin/b": 1}


def test_member_host_tier_sizes_parts_by_fraction_and_needs_per_member_lineages() -> None:
    import pytest

    from eval.baseline.tier_parts import member_host_tier

    host = member_host_tier(1000, {"s": 0.2, "l": 0.8}, {"s": ("s0", "s1"), "l": ("l0", "l1", "l2")})
    assert host.part_bytes() == {"s": 200, "l": 800}
    with pytest.raises(ValueError, match="per-member lineages"):
        member_host_tier(1000, {"s": 0.5, "l": 0.5}, {"s": ("x0",), "l": ("x0", "l1")})
    with pytest.raises(ValueError, match="host tier parts name"):
        member_host_tier(1000, {"s": 1.0}, {"s": ("s0",), "l": ("l0",)})


def test_a_static_deployments_saves_cannot_evict_anothers_but_an_elastic_ones_can() -> None:
    """The static-split baseline's core: one host tier part per deployment, sized as its slice, together MFS's
    tier; baseline_elastic keeps one LRU its deployments share."""
    from eval.composition import core_parts
    from eval.systems import system_config, system_scheduler, system_tiers
    from orchestrator.core.complexity import ComplexityEstimator
    from orchestrator.core.engine_core import EngineCore
    from eval.composition import per_member_lineages
    from orchestrator.core.family import load_family
    from tests.fakes import fake_vocab

    split = {"tiny-s": 0.2, "tiny-m": 0.3, "tiny-l": 0.5}
    survivors = {}
    for name in ("baseline", "baseline_elastic"):
        config = system_config(name, "tiny", 768, split, host_tier_mb=1.0)
        family = per_member_lineages(load_family("tiny"))
        core = EngineCore(config, family, estimator=ComplexityEstimator(fake_vocab()), clock=lambda: 0.0,
                          **core_parts(config, system_scheduler(name), system_tiers(name)))
        host = core.tiers.host
        assert host.capacity_bytes == 2**20
        if name == "baseline":
            parts = host.part_bytes()
            assert sum(parts.values()) == 2**20 and all(abs(parts[m] - 2**20 * f) <= 1 for m, f in split.items())
        small, large = family.member("tiny-s"), family.member("tiny-l")
        page = bytes(config.pool.page_bytes)
        core.tiers.put(PageKey(small.layer_lineages[0], b"s" * 16), page)
        for n in range(2 * 2**20 // len(page)):        # tiny-l saves twice the whole tier
            core.tiers.put(PageKey(large.layer_lineages[n % large.num_layers], n.to_bytes(16, "big")), page)
        survivors[name] = core.tiers.locate(PageKey(small.layer_lineages[0], b"s" * 16))
    assert survivors == {"baseline": Tier.HOST, "baseline_elastic": None}


def test_disk_files_of_another_page_size_or_dtype_are_a_miss_never_data_of_the_wrong_shape(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 1000, page_bytes=10, dtype="float16")
    disk.put(key(1), blob(1))
    disk.put(key(2), blob(2))
    for page_bytes, dtype in ((20, "float16"), (10, "bfloat16")):   # a restart with another geometry or dtype
        other = DiskTier(tmp_path, 1000, page_bytes=page_bytes, dtype=dtype)
        assert other.num_entries == 0 and other.get(key(1)) is None   # refused by the scan, counted as a miss
    assert not any(p.suffix == ".kv" for p in tmp_path.iterdir())      # ... and not left to fill the disk
    half, brain = DiskTier(tmp_path, 1000, page_bytes=10, dtype="float16"), \
        DiskTier(tmp_path, 1000, page_bytes=10, dtype="bfloat16")   # two servers sharing one directory
    half.put(key(3), blob(3))
    brain.put(key(3), blob(9))                                       # replaces the file under the same name
    assert half.get(key(3)) is None and not half.contains(key(3))    # a miss, not brain's bytes
    wrong_size = DiskTier(tmp_path / "y", 1000, page_bytes=10, dtype="float16")
    wrong_size.put(key(4), blob(4, 7))                               # no page of 10 bytes: never served as one
    assert wrong_size.get(key(4)) is None


def test_a_restart_with_another_page_size_through_the_engine_config_loads_no_page(tmp_path: Path) -> None:
    from orchestrator.core.config import load_config
    from orchestrator.core.engine_core import with_disk_tier

    def disk(page_bytes: int, **more) -> DiskTier:
        config = load_config(None, {"pool.disk_tier_mb": 1, "pool.disk_dir": str(tmp_path),
                                    "pool.page_bytes": page_bytes, **more})
        return with_disk_tier(config, None).disk
    disk(16).put(key(1), blob(1, 16))
    assert disk(16).get(key(1)) == blob(1, 16)
    assert disk(32).get(key(1)) is None                              # the old bytes cannot reach write_page
    disk(16).put(key(2), blob(2, 16))
    assert disk(16, **{"engine.dtype": "bfloat16"}).get(key(2)) is None


def test_the_keyed_checksum_refuses_files_written_without_the_key(tmp_path: Path) -> None:
    import pytest

    from orchestrator.core.config import ConfigError, load_config
    from orchestrator.core.engine_core import with_disk_tier

    keyed = DiskTier(tmp_path, 1000, mac_key=b"secret")
    keyed.put(key(1), blob(1))
    assert DiskTier(tmp_path, 1000, mac_key=b"secret").get(key(1)) == blob(1)
    assert DiskTier(tmp_path, 1000).get(key(1)) == blob(1)             # the plain checksum alone still verifies
    DiskTier(tmp_path, 1000).put(key(2), blob(2))                       # a writer without the key
    DiskTier(tmp_path, 1000, mac_key=b"other").put(key(3), blob(3))     # ... or with another one
    reader = DiskTier(tmp_path, 1000, mac_key=b"secret")
    assert reader.get(key(2)) is None and reader.get(key(3)) is None and reader.get(key(1)) == blob(1)
    key_file = tmp_path / "disk.key"
    key_file.write_text("secret\n")
    config = load_config(None, {"pool.disk_tier_mb": 1, "pool.disk_dir": str(tmp_path / "d"),
                                "pool.disk_key_file": str(key_file)})
    assert with_disk_tier(config, None).disk.mac_key == DiskTier(tmp_path, 1, mac_key=b"secret").mac_key
    config.pool.disk_key_file = str(tmp_path / "missing")
    with pytest.raises(ConfigError, match="pool.disk_key_file"):
        with_disk_tier(config, None)
