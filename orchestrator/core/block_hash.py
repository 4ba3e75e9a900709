"""Chained token-block hashes: the prefix identity of every full block (seed = tokenizer hash + cache_salt)."""
from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

HASH_BYTES = 16   # blake2b digest size of the seed and of every block hash

# The wire format is int32 little-endian whatever the platform's C int size and byte order.
_INT32_CODE = next(code for code in "il" if array(code).itemsize == 4)
_BIG_ENDIAN = sys.byteorder == "big"


def hash_seed(tokenizer_hash: str, cache_salt: str | None) -> bytes:
    """The chain's root: members with different tokenizers, or requests with different salts, never match."""
    h = hashlib.blake2b(digest_size=HASH_BYTES)
    h.update(b"mfs-block-hash-v1\0")
    h.update(tokenizer_hash.encode("utf-8"))
    # "\0" separates the fields; a marker distinguishes "no salt" from the empty salt.
    if cache_salt is None:
        h.update(b"\0nosalt")
    else:
        h.update(b"\0salt\0" + cache_salt.encode("utf-8"))
    return h.digest()


def chain_block_hashes(token_ids: Sequence[int], tokens_per_block: int, seed: bytes,
                       parent: bytes | None = None, start_block: int = 0) -> list[bytes]:
    """Hashes of the FULL blocks of token_ids from block index start_block on.

    token_ids is the whole sequence; parent is the hash of block start_block - 1 (None = the seed, which
    matches a from-scratch chain only when start_block == 0). h_i = blake2b(h_{i-1} || int32-LE tokens of block i).
    A trailing partial block is never hashed: only full blocks are shared.
    """
    prev = seed if parent is None else parent
    num_full_blocks = len(token_ids) // tokens_per_block
    if start_block >= num_full_blocks:
        return []
    # One conversion for all blocks, then zero-copy slices: this runs for every request.
    tokens = array(_INT32_CODE, token_ids[start_block * tokens_per_block:num_full_blocks * tokens_per_block])
    if _BIG_ENDIAN:
        tokens.byteswap()
    view = memoryview(tokens.tobytes())
    block_bytes = tokens_per_block * 4
    hashes: list[bytes] = []
    blake2b = hashlib.blake2b
    for offset in range(0, len(view), block_bytes):
        h = blake2b(prev, digest_size=HASH_BYTES)
        h.update(view[offset:offset + block_bytes])
        prev = h.digest()
        hashes.append(prev)
    return hashes
