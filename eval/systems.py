"""The compared systems: MFS, the independent-deployment baseline (best static split) and the ablations."""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from orchestrator.core.config import MFSConfig, load_config
from orchestrator.core.family import FamilySpec
from orchestrator.core.kv_layout import KVLayout

SYSTEMS = ("mfs", "baseline", "no_affinity", "no_shared_pool", "no_tiers", "no_warmup", "no_layer_sharing")
DEFAULT_SYSTEMS = ("mfs", "baseline")
# A member with no routed traffic still needs pages: the baseline escalates into it (cold handover).
MIN_SPLIT_FRACTION = 0.05


@dataclass(frozen=True, slots=True)
class RoutedRequest:
    """One trace request as the static-split calculation sees it."""

    complexity: float
    tokens: int                            # prompt + output tokens: what its KV occupies at the end


@dataclass(slots=True)
class StaticSplit:
    fractions: dict[str, float]            # member -> fraction of the pages, sums to 1
    traffic_share: dict[str, float]        # member -> share of tokens x layers routed on complexity alone
    requests_by_member: dict[str, int]
    notes: list[str] = field(default_factory=list)


def system_overrides(name: str, num_pages: int, split: dict[str, float] | None) -> dict[str, Any]:
    """Dotted config overrides for system `name` (same engine, same arena size for all)."""
    if name not in SYSTEMS:
        raise ValueError(f"unknown system {name!r} (known: {', '.join(SYSTEMS)})")
    base: dict[str, Any] = {"pool.num_pages": num_pages}
    if name in ("baseline", "no_shared_pool") and split is None:
        raise ValueError(f"system {name!r} needs the static split")
    if name == "baseline":
        # Independent deployments: a fixed slice of the memory each, routing on complexity only,
        # escalation re-submits the whole conversation to a cold larger member, no tiers, no sharing.
        base.update({
            "pool.static_split": dict(split),
            "pool.cross_member_sharing": False,
            "pool.host_tier_mb": 0.0,
            "pool.disk_tier_mb": 0.0,
            "router.use_affinity": False,
            "router.use_load": False,
            "escalation.cold_handover": True,
            "escalation.warmup": False,
            "escalation.reuse_shared_layers": False,   # separate deployments share no layers
        })
    elif name == "no_affinity":
        base["router.use_affinity"] = False
    elif name == "no_shared_pool":
        base["pool.static_split"] = dict(split)
    elif name == "no_tiers":
        base.update({"pool.host_tier_mb": 0.0, "pool.disk_tier_mb": 0.0})
    elif name == "no_warmup":
        base["escalation.warmup"] = False
    elif name == "no_layer_sharing":
        base.update({"pool.cross_member_sharing": False, "escalation.reuse_shared_layers": False})
    return base


def system_config(name: str, family: str, num_pages: int, split: dict[str, float] | None,
                  extra: dict[str, Any] | None = None) -> MFSConfig:
    overrides = {"family": family, **system_overrides(name, num_pages, split), **(extra or {})}
    return load_config(overrides=overrides)


def needs_split(names: Iterable[str]) -> bool:
    return any(n in ("baseline", "no_shared_pool") for n in names)


def best_static_split(family: FamilySpec, requests: Sequence[RoutedRequest], config: MFSConfig,
                      num_pages: int) -> StaticSplit:
    """Each member's share of tokens x layers when every request is routed on complexity alone
    (Router.adequate_member): the best split an operator could pick knowing the traffic in advance.

    Adjusted so that every member can hold the trace's longest request (else that member would reject
    it outright) and gets at least MIN_SPLIT_FRACTION (it still receives escalations).
    """
    from orchestrator.core.router import Router

    router = Router(family, config.router)
    names = family.member_names
    weight = {m: 0.0 for m in names}
    counts = {m: 0 for m in names}
    for request in requests:
        member = router.adequate_member(request.complexity)
        weight[member] += request.tokens * family.member(member).num_layers
        counts[member] += 1
    total = sum(weight.values()) or 1.0
    share = {m: weight[m] / total for m in names}
    layout = KVLayout.for_config(family, config)   # the pages rule the scheduler validates with
    longest = max((r.tokens for r in requests), default=1)
    floor = {}
    for m in family.members:
        pages = layout.pages_for_tokens(m.name, longest) + config.pool.decode_reserve_blocks * layout.pages_per_block(m.name)
        floor[m.name] = max(MIN_SPLIT_FRACTION, pages / num_pages)
    fractions, notes = apply_floors(share, floor)
    if sum(floor.values()) > 1.0:
        notes.append(f"kv pages ({num_pages}) cannot give every member room for the longest request "
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
            notes.append(f"static split: {m} raised from {share[m]:.3f} to its floor {floor[m]:.3f}")
    fractions = {**fixed, **scaled}
    # Exact sum to 1 despite rounding: the config validator insists.
    largest = max(fractions, key=fractions.get)
    fractions[largest] += 1.0 - sum(fractions.values())
    return {m: fractions[m] for m in share}, notes
