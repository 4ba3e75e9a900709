"""KVLayout: how each family member lays its KV out in pages, and THE rule for the pages N tokens occupy.

A member's logical block is one page per layer, plus one residual page when the member records its
exit-depth hidden states for a nested handover. No pool and no state: the KV cache manager, the
scheduler's validation and the baseline's split arithmetic (eval/baseline/static_split.py) all ask this one object.
"""
from __future__ import annotations

from orchestrator.core.config import MFSConfig
from orchestrator.core.family import FamilySpec, MemberSpec


def records_residuals(config: MFSConfig, warm_handover: bool = True) -> bool:
    """Residual pages are worth writing only when a warm escalation may read them (HandoverRules.warm)."""
    return config.escalation.enabled and warm_handover


class KVLayout:
    def __init__(self, family: FamilySpec, page_bytes: int, dtype_bytes: int, record_residuals: bool = True):
        self.family = family
        self._blocks: dict[str, int] = {m.name: m.tokens_per_block(page_bytes, dtype_bytes) for m in family.members}
        # A member records residuals when a larger member starts from its exit depth (nested family).
        self._records_residual: dict[str, bool] = {
            m.name: record_residuals and m.residual_fits_page(page_bytes, dtype_bytes)
            and any(family.shared_depth(m.name, big.name) == m.num_layers
                    and self._blocks[big.name] == self._blocks[m.name]
                    for big in family.members[m.index + 1:])
            for m in family.members
        }
        # For each member, the smaller members whose exit residual can feed its handover (largest depth first).
        self.residual_sources: dict[str, list[MemberSpec]] = {
            m.name: [s for s in reversed(family.members[:m.index])
                     if self._records_residual[s.name] and family.shared_depth(s.name, m.name) == s.num_layers
                     and self._blocks[s.name] == self._blocks[m.name]]
            for m in family.members
        }

    def tokens_per_block(self, member: str) -> int:
        return self._blocks[member]

    def records_residual(self, member: str) -> bool:
        return self._records_residual[member]

    def pages_per_block(self, member: str) -> int:
        return self.family.member(member).num_layers + (1 if self._records_residual[member] else 0)

    def pages_for_tokens(self, member: str, num_tokens: int) -> int:
        """THE rule for pages a sequence of num_tokens holds on member (every layer, plus the residual
        page when the member records one; a partial block takes whole pages); capped at the member's context."""
        num_tokens = min(num_tokens, self.family.member(member).context_tokens)
        return -(-num_tokens // self._blocks[member]) * self.pages_per_block(member)
