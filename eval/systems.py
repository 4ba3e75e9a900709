"""The compared systems: MFS, the separate-deployment baselines and the ablations, and the static splits
(traffic share with floors for `no_shared_pool`; proportional to weight bytes, the operator's default, is
eval/baseline/static_split.py's; the baseline's own split comes from eval/baseline/split.py). Pages per request: KVCacheManager.pages_for_tokens."""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from eval.baseline.deployments import DEPLOYMENT_SCHEDULERS
from eval.baseline.tier_parts import deployment_tiers
from eval.baseline.static_split import StaticSplit, config_layout, pages_rule
from eval.composition import load_system_config
from orchestrator.core.config import MFSConfig
from orchestrator.core.engine_core import SchedulerFactory, TiersSource
from orchestrator.core.family import FamilySpec

SYSTEMS = ("mfs", "baseline", "baseline_elastic", "baseline_per_turn", "baseline_legacy", "baseline_spec",
           "baseline_elastic_spec", "no_affinity",
           "no_family_routing", "no_shared_pool", "no_tiers", "no_warmup", "no_warm_handover", "no_layer_sharing",
           "mfs_single_server_policies", "mfs_per_turn", "mfs_every_member", "mfs_no_spec", "mfs_separate_drafts",
           "mfs_turns_by_weights", "mfs_draft_member_every_step")
# MFS with one mechanism switched off each: what `--attribution` runs beside mfs and the baseline; the points of
# reduction at the knee that each loses are what that mechanism is worth (eval/bench/curve.py attribution).
# mfs_no_spec: speculation (worth nothing where MFS runs without it: the tiny family's default); mfs_separate_drafts:
# the draft member's own batch riding in the drafts' forwards (speculation.drafts_ride: the catch-up, and in a
# family of separate weights every draft forward).
ATTRIBUTION_SYSTEMS = ("no_shared_pool", "no_family_routing", "no_warm_handover", "no_layer_sharing", "no_tiers",
                       "mfs_no_spec", "mfs_separate_drafts")
# What separate deployments of the members are, against one family server: the only configuration in which the
# fair baselines differ from MFS (tests/test_baseline_parity.py holds them to it). Every generic scheduler policy
# (reservation, retraction, aging, victim order, swap to the host tier, the stall-aware step budget), the host
# tier's total size and the engine are MFS's own; the deployments' scheduler policies (a placement that re-routes
# what a slice cannot hold, a batch cap per deployment, turns on the device, sessions kept on their member) are
# eval/baseline/deployments.py.
DEPLOYMENTS = {
    "comparison.cross_member_sharing": False,   # no KV shared across members
    "comparison.reuse_shared_layers": False,    # an escalation starts the larger member from its first layer
    "comparison.use_affinity": False,           # routing blind to what other members hold
    "comparison.use_load": False,               # ... and to their load: complexity, then the session's member
    "comparison.cold_handover": True,           # an escalation re-sends the conversation to another server
    "comparison.warmup": False,                 # no server prefills for another one
    "router.sticky_sessions": True,             # a front balancer keeps a session on its first turn's server
    "comparison.private_drafts": True,          # speculating, each server drafts with its own draft copy
}
# Speculation is a system's own switch: MFS and its ablations run as configured (speculation.enabled), mfs_no_spec
# without it; the separate deployments run without it, and baseline_spec is their speculating counterpart (each
# larger member's server with its own copy of the smallest member as draft: its weights out of that server's
# memory, eval/simulate/setup.py; its pages from that server's slice; a draft cache only it reads), and
# baseline_elastic_spec the same servers on one elastic pool (the draft copies' weights out of that pool). It is
# set after every other override: a --set cannot turn it on for the plain baselines.
SPECULATION_SWITCH = {"mfs_no_spec": False, "baseline": False, "baseline_elastic": False, "baseline_per_turn": False,
                      "baseline_legacy": False, "baseline_spec": True, "baseline_elastic_spec": True}
# Baselines on one elastic pool (kvcached-style: every deployment maps KV pages from it as it needs them).
ELASTIC_BASELINES = ("baseline_elastic", "baseline_elastic_spec")
# Baselines on a static split of the pool (the elastic baselines draw from one elastic pool instead).
SPLIT_BASELINES = ("baseline", "baseline_per_turn", "baseline_legacy", "baseline_spec")


def static_deployments(fractions: dict[str, float]) -> dict[str, Any]:
    """What separate servers on static slices are beside DEPLOYMENTS: each its slice of the pages (and its own part
    of the host tier, sized as its slice: system_tiers). baseline_elastic keeps one host tier its deployments
    share, as it keeps one pool."""
    return {"comparison.static_split": dict(fractions), **DEPLOYMENTS}


# The scheduler policies of a single-model server before MFS's global scheduler (no reservation of future decode
# pages beyond a one-block watermark, preempt the newest, recompute, no aging, one chunked-prefill token budget
# per step): baseline_legacy keeps them, mfs_single_server_policies is MFS with them and SINGLE_SERVER_ROUTING.
SINGLE_SERVER_POLICIES = {
    "scheduler.decode_reservation": "block",
    "scheduler.aging_steps": None,
    "scheduler.victim_order": "youngest",
    "scheduler.swap_preempted": False,
    "scheduler.decode_step_token_budget": None,
}
# Routing without MFS's load terms: a session bonus, no pool pressure, no expected-delay load or downgrades.
SINGLE_SERVER_ROUTING = {
    "router.session_bonus": 0.2,
    "router.pressure_weight": 0.0,
    "router.delay_saturation_s": 1e9,
    "router.downgrade_delay_s": 1e9,
    "router.downgrade_running": None,
}
DEFAULT_SYSTEMS = ("mfs", "baseline")
# A member with no routed traffic still needs pages: the baseline escalates into it (cold handover).
MIN_SPLIT_FRACTION = 0.05


@dataclass(frozen=True, slots=True)
class RoutedRequest:
    """One trace request as the static-split calculation sees it."""

    complexity: float
    tokens: int                            # prompt + output tokens: what its KV occupies at the end


def system_overrides(name: str, num_pages: int, split: dict[str, float] | None,
                     baseline_split: dict[str, float] | None = None, host_tier_mb: float | None = None,
                     baseline_host_tier: bool = False) -> dict[str, Any]:
    """Dotted config overrides for system `name` (same engine, same arena size for all). The split baselines run
    on baseline_split when given (the searched split), else on split.

    host_tier_mb: the node's host memory for the KV host tier (the simulator sizes it from the hardware), given to
    every system that keeps a host tier; None leaves the config's own. The fair baselines keep the same total as
    MFS: on a static split one part per deployment sized as its slice (system_tiers), baseline_elastic one
    LRU its deployments share. baseline_legacy has none, as servers run by default (TensorRT-LLM's
    kv_cache_host_memory_bytes is 0), unless baseline_host_tier."""
    if name not in SYSTEMS:
        raise ValueError(f"unknown system {name!r} (known: {', '.join(SYSTEMS)})")
    base: dict[str, Any] = {"pool.num_pages": num_pages}
    if name in (*SPLIT_BASELINES, "no_shared_pool") and split is None:
        raise ValueError(f"system {name!r} needs the static split")
    if name in SPLIT_BASELINES:
        base.update(static_deployments(baseline_split or split))
    if name in ("baseline_per_turn", "baseline_legacy"):
        base["router.sticky_sessions"] = False      # every turn routed on its complexity alone
    if name in ELASTIC_BASELINES:
        base.update(DEPLOYMENTS)
    elif name == "baseline_legacy":
        base.update({"pool.disk_tier_mb": 0.0, **SINGLE_SERVER_POLICIES})
        if not baseline_host_tier:
            base["pool.host_tier_mb"] = 0.0
    elif name == "mfs_single_server_policies":
        base.update({**SINGLE_SERVER_POLICIES, **SINGLE_SERVER_ROUTING})
    elif name == "no_affinity":
        base["comparison.use_affinity"] = False
    elif name == "mfs_every_member":           # every member steps in every step (no member turns)
        base["scheduler.member_turns"] = 0.0
    elif name == "mfs_turns_by_weights":       # member turns price each member's forward by its weight bytes
        base["comparison.member_turns_by_weights"] = True
    elif name == "mfs_draft_member_every_step":  # the riding draft member steps whenever it has decodes
        base["comparison.draft_member_every_step"] = True
    elif name == "mfs_separate_drafts":        # the draft member's own batch in a forward of its own
        base["speculation.drafts_ride"] = False
    elif name == "mfs_per_turn":               # every turn routed afresh (sessions not kept on their first member)
        base["router.sticky_sessions"] = False
    elif name == "no_family_routing":           # the baselines' routing: complexity only, blind to caches and load
        base.update({"comparison.use_affinity": False, "comparison.use_load": False})
    elif name == "no_warm_handover":            # an escalation re-sends the conversation, cold; no warm-up
        base.update({"comparison.cold_handover": True, "comparison.warmup": False})
    elif name == "no_shared_pool":
        base["comparison.static_split"] = dict(split)
    elif name == "no_tiers":
        base.update({"pool.host_tier_mb": 0.0, "pool.disk_tier_mb": 0.0})
    elif name == "no_warmup":
        base["comparison.warmup"] = False
    elif name == "no_layer_sharing":
        base.update({"comparison.cross_member_sharing": False, "comparison.reuse_shared_layers": False})
    if host_tier_mb is not None and base.get("pool.host_tier_mb") != 0.0:   # a system set to none keeps none
        base["pool.host_tier_mb"] = host_tier_mb
    return base


def system_scheduler(name: str) -> SchedulerFactory | None:
    """The scheduler system `name` runs when it is not MFS's own: the baselines' separate deployments."""
    return DEPLOYMENT_SCHEDULERS.get(name)


def system_tiers(name: str) -> TiersSource | None:
    """The tiers system `name` runs when they are not the config's own: the static-split baselines' separate
    servers each keep a part of the host tier, sized as its slice (eval/baseline/tier_parts.py)."""
    return deployment_tiers if name in SPLIT_BASELINES else None


def system_config(name: str, family: str, num_pages: int, split: dict[str, float] | None,
                  extra: dict[str, Any] | None = None, baseline_split: dict[str, float] | None = None,
                  host_tier_mb: float | None = None, baseline_host_tier: bool = False) -> MFSConfig:
    overrides = {"family": family, **system_overrides(name, num_pages, split, baseline_split, host_tier_mb,
                                                      baseline_host_tier), **(extra or {})}
    if name in SPECULATION_SWITCH:
        overrides["speculation.enabled"] = SPECULATION_SWITCH[name]
    return load_system_config(overrides)


def needs_split(names: Iterable[str]) -> bool:
    return any(n in (*SPLIT_BASELINES, "no_shared_pool") for n in names)


def best_static_split(family: FamilySpec, requests: Sequence[RoutedRequest], config: MFSConfig,
                      num_pages: int) -> StaticSplit:
    """Each member's share of tokens x layers when every request is routed on complexity alone
    (Router.adequate_member): the best split an operator could pick knowing the traffic in advance.

    Adjusted so that every member can hold the trace's longest request (else that member would reject
    it outright) and gets at least MIN_SPLIT_FRACTION (it still receives escalations).
    """
    from orchestrator.core.router import Router

    router = Router(family, config.router)
    names = family.serving_names
    weight = {m: 0.0 for m in names}
    counts = {m: 0 for m in names}
    for request in requests:
        member = router.adequate_member(request.complexity)
        weight[member] += request.tokens * family.member(member).num_layers
        counts[member] += 1
    total = sum(weight.values()) or 1.0
    share = {m: weight[m] / total for m in names}
    longest = max((r.tokens for r in requests), default=1)
    # Floors through the one page rule (residual pages included when this config records them: the
    # no_shared_pool ablation does), plus the decode reserve; half a page over so rounding never bites.
    pages_for_tokens, tokens_per_block = pages_rule(family, config), config_layout(family, config).tokens_per_block
    floor = {}
    for m in names:
        reserve = config.scheduler.decode_reserve_blocks * tokens_per_block(m)
        pages = pages_for_tokens(m, longest + reserve)
        floor[m] = max(MIN_SPLIT_FRACTION, (pages + 0.5) / num_pages)
    fractions, notes = apply_floors(share, floor)
    if sum(floor.values()) > 1.0:
        notes.append(f"traffic split (no_shared_pool, --baseline-split traffic): kv pages ({num_pages}) cannot "
                     f"give every member room for the longest request "
                     f"({longest} tokens): split floors scaled down")
    return StaticSplit(fractions=fractions, traffic_share=share, requests_by_member=counts, notes=notes)


def apply_floors(share: dict[str, float], floor: dict[str, float]) -> tuple[dict[str, float], list[str]]:
    """Raise members below their floor to it; scale the others down proportionally. Sums to 1."""
    notes: list[str] = []
    if sum(floor.values()) >= 1.0:
        total = sum(floor.values())
        return {m: f / total for m, f in floor.items()}, notes
    fixed: dict[str, float] = {}
    while True:
        free = 1.0 - sum(fixed.values())
        rest = {m: s for m, s in share.items() if m not in fixed}
        rest_total = sum(rest.values())
        scaled = {m: (free * s / rest_total if rest_total else free / len(rest)) for m, s in rest.items()}
        below = [m for m, f in scaled.items() if f < floor[m]]
        if not below:
            break
        for m in below:
            fixed[m] = floor[m]
            notes.append(f"traffic split: {m} raised from {share[m]:.3f} to its floor {floor[m]:.3f}")
    fractions = {**fixed, **scaled}
    # Exact sum to 1 despite rounding: the config validator insists.
    largest = max(fractions, key=fractions.get)
    fractions[largest] += 1.0 - sum(fractions.values())
    return {m: fractions[m] for m in share}, notes
