"""The pool's page counts for stats snapshots, by state and by member (shared lineages count for the smallest)."""
from __future__ import annotations

from orchestrator.core.family import FamilySpec
from orchestrator.core.page_pool import PagePool
from orchestrator.core.tiers import TieredStore


def pages_state(family: FamilySpec, pool: PagePool, tiers: TieredStore | None, page_bytes: int) -> dict:
    counts = pool.counts()
    tier_counts = tiers.counts() if tiers is not None else {"host": 0, "disk": 0}
    by_member = {name: {"used": 0, "cached": 0, "host": 0, "disk": 0} for name in family.member_names}
    for name, states in pool.counts_by_member().items():
        if name in by_member:
            by_member[name].update(states)
    if tiers is not None:
        owner_of_lineage = {}
        for member in reversed(family.members):   # shared lineages count for the smallest member
            for lineage in (*member.layer_lineages, member.residual_lineage()):
                owner_of_lineage[lineage] = member.name
        for lineage, by_tier in tiers.counts_by_lineage().items():
            owner = owner_of_lineage.get(lineage)
            if owner is not None:
                for tier, n in by_tier.items():
                    by_member[owner][tier] += n
    return {"total": pool.num_pages, "page_bytes": page_bytes,
            "by_state": {"free": counts["free"], "used": counts["used"], "cached": counts["cached"],
                         "host": tier_counts.get("host", 0), "disk": tier_counts.get("disk", 0)},
            "by_member": by_member}
