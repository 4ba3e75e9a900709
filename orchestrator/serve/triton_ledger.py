"""Triton mode's estimated KV ledger: what MFS believes each member's Triton KV pool holds.

MFS does not own those pools (docs/TRTLLM.md): PrefixEstimate is an approximate per-member prefix index built
from MFS's own routing history (chained block hashes, LRU, bounded by the member's capacity), corrected when
Triton reports fewer reused blocks than predicted; EstimateCounters keeps the prediction-vs-report totals.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

DEFAULT_INDEX_BLOCKS = 4096          # until Triton's 'max' block metric is known


class PrefixEstimate:
    """Approximate view of one member's reusable blocks: chained block hashes, LRU, bounded by capacity."""

    __slots__ = ("capacity_blocks", "_blocks")

    def __init__(self, capacity_blocks: int = DEFAULT_INDEX_BLOCKS):
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def match_blocks(self, hashes: list[bytes]) -> int:
        """Leading blocks believed cached (a chain: the first miss ends the match)."""
        count = 0
        for h in hashes:
            if h not in self._blocks:
                break
            count += 1
        return count

    def insert(self, hashes: list[bytes]) -> None:
        for h in hashes:
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        self.trim()

    def forget_from(self, hashes: list[bytes], first_missing: int) -> None:
        """Triton reported fewer reused blocks than predicted: those blocks were evicted."""
        for h in hashes[first_missing:]:
            self._blocks.pop(h, None)

    def trim(self) -> None:
        while len(self._blocks) > max(0, self.capacity_blocks):
            self._blocks.popitem(last=False)


@dataclass(slots=True)
class EstimateCounters:
    predicted_hit_tokens: int = 0     # what the prefix index expected Triton to reuse
    reported_hit_tokens: int = 0      # what Triton reported (kv_cache_reused_blocks x tokens_per_block)
    corrections: int = 0              # requests where the index over-predicted and was corrected
    disconnects: int = 0
    reconnects: int = 0
    members: dict[str, dict[str, float]] = field(default_factory=dict)   # last KV block metrics per member
