"""A static split of the KV pages among the separate deployments: its record, the operator's default split
(proportional to weight bytes) and the pages a request holds on a deployment's slice. The compared systems
(eval/systems.py: the traffic split) and the baseline's split choice (split.py and its search) read them here."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from eval.composition import handover_rules, switches
from eval.weights import member_weight_bytes
from orchestrator.core.config import MFSConfig
from orchestrator.core.family import FamilySpec, dtype_bytes
from orchestrator.core.kv_layout import KVLayout, records_residuals
from orchestrator.core.reservation import _pages_rule


@dataclass(slots=True)
class StaticSplit:
    fractions: dict[str, float]            # member -> fraction of the pages, sums to 1
    traffic_share: dict[str, float]        # member -> share of tokens x layers routed on complexity alone
    requests_by_member: dict[str, int]
    notes: list[str] = field(default_factory=list)


def proportional_split(family: FamilySpec) -> dict[str, float]:
    """The operator's default: each deployment's slice proportional to its member's weight bytes (a drafts_only
    member has no deployment)."""
    sizes = {m: n for m, n in member_weight_bytes(family).items() if m in family.serving_names}
    total = sum(sizes.values())
    fractions = {m: n / total for m, n in sizes.items()}
    largest = max(fractions, key=fractions.get)
    fractions[largest] += 1.0 - sum(fractions.values())
    return fractions


def config_layout(family: FamilySpec, config: MFSConfig, warm_handover: bool = True) -> KVLayout:
    """The layout a server with this config uses (page size, dtype, residuals when escalation reads them)."""
    return KVLayout(family, config.pool.page_bytes, dtype_bytes(config.engine.dtype),
                    records_residuals(config, warm_handover))


def pages_rule(family: FamilySpec, config: MFSConfig) -> Callable[[str, int], int]:
    """(member, tokens) -> the pages a request holds on that member's server configured like `config`: the
    scheduler's own rule (KVLayout.pages_for_tokens: residual pages included when the config records them, capped
    at the member's context), plus its draft's where each server drafts with its own copy of the smallest member
    (speculating, comparison.private_drafts: the draft's tables come from the same slice, one page per draft layer
    per block, capped at the draft's context: the core's reservation rule for a draft)."""
    layout = config_layout(family, config, handover_rules(config).warm)
    if not (config.speculation.enabled and switches(config).private_drafts):
        return layout.pages_for_tokens
    draft = family.members[0]
    draft_pages = _pages_rule(layout.tokens_per_block(draft.name), draft.num_layers, draft.context_tokens)

    def pages_for_tokens(member: str, num_tokens: int) -> int:
        own = layout.pages_for_tokens(member, num_tokens)
        return own if member == draft.name else own + draft_pages(num_tokens)
    return pages_for_tokens
