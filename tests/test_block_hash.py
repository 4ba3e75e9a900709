"""Chained block hashes: a pinned digest, chaining from a parent, seeds and salts, only full blocks."""
from __future__ import annotations

import hashlib
import struct

from orchestrator.core.block_hash import HASH_BYTES, chain_block_hashes, hash_seed


def reference(token_ids: list[int], tokens_per_block: int, seed: bytes) -> list[bytes]:
    """The definition, written the slow way."""
    out, prev = [], seed
    for start in range(0, len(token_ids) - tokens_per_block + 1, tokens_per_block):
        block = token_ids[start:start + tokens_per_block]
        prev = hashlib.blake2b(prev + struct.pack(f"<{len(block)}i", *block), digest_size=16).digest()
        out.append(prev)
    return out


def test_known_digests_are_stable() -> None:
    # Pinned values: the disk tier outlives processes, so these must never change silently.
    seed = hash_seed("tok-abc", None)
    assert len(seed) == HASH_BYTES == 16
    assert seed.hex() == hashlib.blake2b(b"mfs-block-hash-v1\0tok-abc\0nosalt", digest_size=16).hexdigest()
    hashes = chain_block_hashes([1, 2, 3, 4, 5], 2, seed)
    assert hashes == reference([1, 2, 3, 4, 5], 2, seed)
    first = hashlib.blake2b(seed + b"\x01\x00\x00\x00\x02\x00\x00\x00", digest_size=16).digest()
    assert hashes[0] == first


def test_pinned_hex() -> None:
    # Literal digests: any change to the seed or block encoding breaks every disk tier on upgrade.
    seed = hash_seed("tok", "salt")
    assert seed.hex() == "862999a60d061623078e5a7907221e15"
    assert chain_block_hashes([0, 1, -1, 2**31 - 1], 4, seed)[0].hex() == "dc7fe1339d62dfd701a20e66b44908b4"
    other = hash_seed("tok-abc", None)
    assert other.hex() == "8a4c4d1e2d9bf65ffba89d92e2c8a0c7"
    assert chain_block_hashes([1, 2, 3, 4, 5], 2, other)[1].hex() == "f8ac22cc18ddff7301ad8722e57619eb"


def test_parent_chaining_equals_from_scratch() -> None:
    seed = hash_seed("tok", None)
    tokens = list(range(1000, 1037))
    full = chain_block_hashes(tokens, 4, seed)
    assert len(full) == 9
    for k in range(1, 9):
        assert full[:k] + chain_block_hashes(tokens, 4, seed, parent=full[k - 1], start_block=k) == full
    # Growing a sequence extends its chain without changing earlier hashes.
    assert chain_block_hashes(tokens[:20], 4, seed) == full[:5]
    assert chain_block_hashes(tokens, 4, seed, parent=full[-1], start_block=9) == []


def test_seeds_and_salts_separate_chains() -> None:
    seeds = {hash_seed("tok-a", None), hash_seed("tok-b", None), hash_seed("tok-a", ""),
             hash_seed("tok-a", "user-1"), hash_seed("tok-a", "user-2")}
    assert len(seeds) == 5
    tokens = [7] * 8
    assert len({chain_block_hashes(tokens, 4, s)[0] for s in seeds}) == 5


def test_only_full_blocks_and_block_size_matters() -> None:
    seed = hash_seed("tok", None)
    assert chain_block_hashes([1, 2, 3], 4, seed) == []
    assert len(chain_block_hashes(list(range(11)), 4, seed)) == 2
    assert chain_block_hashes([], 4, seed) == []
    assert chain_block_hashes(list(range(8)), 4, seed)[0] != chain_block_hashes(list(range(8)), 8, seed)[0]
    assert chain_block_hashes([1, 2, 3, 4], 2, seed) != chain_block_hashes([1, 2, 4, 3], 2, seed)
