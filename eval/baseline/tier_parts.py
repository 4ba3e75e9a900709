"""The separate deployments' host KV tier: one part per deployment, each an LRU of its own, sized as its slice.

Separate per-member servers each keep their own host memory; together the parts are as large as MFS's one host
tier (pool.host_tier_mb), in the proportion of the static split. EngineCore takes `deployment_tiers` as its
tiers source for the static-split baselines (eval/systems.py: system_tiers).
"""
from __future__ import annotations

from orchestrator.core.config import MFSConfig
from orchestrator.core.engine_core import with_disk_tier
from orchestrator.core.family import FamilySpec
from orchestrator.core.host_tier import HostTier
from orchestrator.core.tiers import TieredStore


def deployment_tiers(config: MFSConfig, family: FamilySpec) -> TieredStore | None:
    """The host tier in one part per deployment (the fractions of config's static split), beside the disk tier."""
    fractions = config.comparison.static_split
    if fractions is None:
        raise ValueError("a host tier in per-deployment parts needs the static split (comparison.static_split)")
    host = None
    if config.pool.host_tier_mb > 0:
        host = member_host_tier(int(config.pool.host_tier_mb * 2**20), fractions, host_tier_lineages(family))
    return with_disk_tier(config, host)


def host_tier_lineages(family: FamilySpec) -> dict[str, tuple[str, ...]]:
    """Each deployment's lineages, for a host tier in per-member parts. A drafts_only member has no deployment: its
    pages are the speculating deployments' draft copies, kept in the largest one's part (a lineage has one part)."""
    lineages = {m.name: (*m.layer_lineages, m.residual_lineage()) for m in family.members if not m.drafts_only}
    drafter = family.drafter
    if drafter is not None:
        largest = family.serving_names[-1]
        lineages[largest] = (*lineages[largest], *drafter.layer_lineages, drafter.residual_lineage())
    return lineages


def member_host_tier(capacity_bytes: int, fractions: dict[str, float],
                     lineages: dict[str, tuple[str, ...]]) -> HostTier:
    """The host tier in one part per member (member -> its fraction of capacity_bytes; member -> its lineages):
    what separate per-member servers have. Each lineage must belong to one member only (per-member lineages)."""
    if set(fractions) != set(lineages):
        raise ValueError(f"host tier parts name {sorted(fractions)}; the family has {sorted(lineages)}")
    part_bytes = {m: int(capacity_bytes * f) for m, f in fractions.items()}
    largest = max(fractions, key=lambda m: fractions[m])
    part_bytes[largest] += capacity_bytes - sum(part_bytes.values())
    part_of: dict[str, str] = {}
    for member, names in lineages.items():
        for lineage in names:
            owner = part_of.setdefault(lineage, member)
            if owner != member:
                raise ValueError(f"lineage {lineage} belongs to {owner} and {member}: host tier parts need "
                                 "per-member lineages (the deployments load the family with per-member lineages)")
    return HostTier.in_parts(part_bytes, part_of)
