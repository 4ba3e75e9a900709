"""How eval's compared systems are assembled from the core's unmodified objects.

A compared system is MFS's configuration plus `comparison`: what separates its members when they are not one
family server (a static split of the pages, per-member KV lineages, routing blind to the other members, cold
handovers, each server's own draft copy). The core reads none of it. `core_parts` turns it into what
EngineCore takes (the page ledger, the scheduler's policies, whether handovers are warm) and
`system_family` into the family as that system serves it; the separate deployments' own policies (placement,
batch caps, turns) and host tier are eval/baseline's.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from typing import Any

from eval.baseline.split_pool import split_pool_source
from orchestrator.core.config import ConfigError, MFSConfig, load_config
from orchestrator.core.engine_core import SchedulerFactory, TiersSource
from orchestrator.core.family import FamilySpec, load_family
from orchestrator.core.handover import HandoverRules
from orchestrator.core.router import Router
from orchestrator.core.scheduler import Scheduler, SchedulerPolicies


@dataclass(slots=True)
class ComparisonSwitches:
    """What a compared system changes beyond MFS's configuration; the defaults are MFS."""

    static_split: dict[str, float] | None = None   # fixed fraction of the pages per member (no shared pool)
    cross_member_sharing: bool = True    # nested families share lower-layer pages; False = per-member lineages
    use_affinity: bool = True            # routing reads the prefix cache and sessions
    use_load: bool = True                # routing reads load (and may downgrade)
    warmup: bool = True                  # prefill likely escalations on the next member while it is idle
    reuse_shared_layers: bool = True     # nested family: an escalation starts the target at the source's exit depth
    cold_handover: bool = False          # an escalation's target gets no cache from the source
    # speculation: each member's server drafts with its own copy of the draft member (pages from its own slice,
    # a draft cache no other server reads)
    private_drafts: bool = False
    # member turns: each member's forward priced by its weight bytes alone (not the executor's step-cost estimate)
    member_turns_by_weights: bool = False
    # a draft member whose decodes ride every draft forward steps in every step it has decodes
    draft_member_every_step: bool = False


@dataclass(slots=True)
class SystemConfig(MFSConfig):
    """MFS's configuration and the compared system's switches (set with dotted `comparison.*` overrides)."""

    comparison: ComparisonSwitches = field(default_factory=ComparisonSwitches)

    def validate(self) -> None:
        MFSConfig.validate(self)
        split = self.comparison.static_split
        if split is not None:
            total = sum(split.values())
            if not (all(v > 0 for v in split.values()) and abs(total - 1.0) < 1e-6):
                raise ConfigError(f"config key 'comparison.static_split': fractions must be positive and sum to 1 "
                                  f"(got {total})")


def load_system_config(overrides: dict[str, Any] | None = None) -> SystemConfig:
    config = load_config(overrides=overrides, cls=SystemConfig)
    assert isinstance(config, SystemConfig)
    return config


def switches(config: MFSConfig) -> ComparisonSwitches:
    """The compared system's switches (MFS's, the defaults, for a plain MFSConfig)."""
    return config.comparison if isinstance(config, SystemConfig) else ComparisonSwitches()


def handover_rules(config: MFSConfig) -> HandoverRules:
    compare = switches(config)
    return HandoverRules(warmup=compare.warmup, reuse_shared_layers=compare.reuse_shared_layers,
                         cold=compare.cold_handover)


def scheduler_policies(family: FamilySpec, config: MFSConfig, **given: Any) -> SchedulerPolicies:
    """The scheduler's policies for this system: its routing, handover rules and draft copies, beside `given`
    (placement, running_cap, step_members of the separate deployments)."""
    compare = switches(config)
    router = Router(family, config.router, use_affinity=compare.use_affinity, use_load=compare.use_load)
    return SchedulerPolicies(router=router, handover=handover_rules(config), private_drafts=compare.private_drafts,
                             turns_by_weights=compare.member_turns_by_weights,
                             draft_member_every_step=compare.draft_member_every_step, **given)


def compared_scheduler(family, config, pool, kv, estimator, tiers=None, events=None, stats=None) -> Scheduler:
    """MFS's scheduler with this system's switches (EngineCore's scheduler_factory signature): the ablations."""
    return Scheduler(family, config, pool, kv, estimator, tiers, events, stats,
                     policies=scheduler_policies(family, config))


def core_parts(config: MFSConfig, scheduler_factory: SchedulerFactory | None = None,
               tiers: TiersSource | None = None) -> dict[str, Any]:
    """EngineCore's keyword arguments for this system: its scheduler (the given one, else MFS's with this
    system's switches when it has any), its tiers, its page ledger (a static split: eval/baseline/split_pool.py)
    and whether handovers are warm."""
    compare = switches(config)
    if scheduler_factory is None and compare != ComparisonSwitches():
        scheduler_factory = compared_scheduler
    split = compare.static_split
    return {"scheduler_factory": scheduler_factory, "tiers": tiers,
            "pool": split_pool_source(split) if split is not None else None,
            "warm_handover": handover_rules(config).warm}


def system_family(config: MFSConfig) -> FamilySpec:
    """config.family as this system serves it: without cross-member sharing each member's lineages are its own
    (no page is shared between members, whatever their weights)."""
    family = load_family(config.family)
    return family if switches(config).cross_member_sharing else per_member_lineages(family)


def per_member_lineages(family: FamilySpec) -> FamilySpec:
    """The family with each member's lineages salted with its name: what an independent family would get."""
    def salted(name: str, lineages: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(hashlib.blake2b(f"{name}|{l}".encode(), digest_size=16).hexdigest() for l in lineages)
    return replace(family, members=tuple(replace(m, layer_lineages=salted(m.name, m.layer_lineages))
                                         for m in family.members))
