"""The fair baselines differ from MFS only in what MFS is (eval/systems.py DEPLOYMENTS, and on a static split
each deployment's slice of the pages and its own part of the host tier): every generic scheduler policy, the host
tier's total size and the engine are MFS's own. Speculation is a system's own switch: each fair baseline is held to
the MFS that speculates as it does (baseline_spec to MFS with speculation on, the others to MFS without it), so
every speculation setting but the private draft copies is MFS's too."""
from __future__ import annotations

from dataclasses import asdict
from typing import Any

from eval.composition import core_parts, per_member_lineages, system_family
from eval.systems import DEPLOYMENTS, SYSTEMS, system_config, system_scheduler, system_tiers

SPLIT = {"tiny-s": 0.2, "tiny-m": 0.3, "tiny-l": 0.5}
FAIR = ("baseline", "baseline_per_turn", "baseline_elastic", "baseline_spec", "baseline_elastic_spec")
# One pool against a slice per deployment, one host tier against a part per deployment (separate servers' own
# host memory, sized as their slices), no KV reuse across members, family-wide routing, warm handovers: the
# settings in which a fair baseline may differ from MFS. Nothing else.
WHAT_MFS_IS = frozenset({"comparison.static_split", *DEPLOYMENTS})
LEAVES = ("static_split", "profiles")     # dict-valued settings compared whole


def flat(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, dict) and not prefix.endswith(LEAVES):
        out: dict[str, Any] = {}
        for key, value in data.items():
            out.update(flat(value, f"{prefix}.{key}" if prefix else key))
        return out
    return {prefix: data}


def differing(name: str, extra: dict | None = None, **kwargs) -> set[str]:
    """Settings in which system `name` differs from the MFS that speculates as it does."""
    other = flat(asdict(system_config(name, "tiny", 768, SPLIT, extra, **kwargs)))
    counterpart = {**(extra or {}), "speculation.enabled": other["speculation.enabled"]}
    mfs = flat(asdict(system_config("mfs", "tiny", 768, SPLIT, counterpart, **kwargs)))
    return {k for k in mfs.keys() | other.keys() if mfs.get(k) != other.get(k)}


def test_a_fair_baseline_differs_from_mfs_only_in_what_mfs_is():
    speculating = {"speculation.max_k": 5, "speculation.acceptance": {"tiny-s->tiny-l": 0.6}}
    for name in FAIR:
        for host_tier_mb in (None, 512.0):
            for extra in (None, speculating, {**speculating, "speculation.enabled": True}):
                found = differing(name, extra, host_tier_mb=host_tier_mb)
                assert found <= WHAT_MFS_IS, f"{name} differs from mfs in {sorted(found - WHAT_MFS_IS)}"
                assert found >= set(DEPLOYMENTS), f"{name} is missing part of what separate deployments are"
    for elastic in ("baseline_elastic", "baseline_elastic_spec"):      # one pool, one tier
        assert "comparison.static_split" not in differing(elastic)
    assert "comparison.static_split" in differing("baseline")
    assert {n for n in FAIR if system_tiers(n) is not None} == {"baseline", "baseline_per_turn", "baseline_spec"}


def test_each_static_deployment_gets_a_host_tier_part_sized_as_its_slice():
    from orchestrator.core.family import load_family

    config = system_config("baseline", "tiny", 768, SPLIT, host_tier_mb=512.0)
    assert config.comparison.static_split == SPLIT
    assert config.pool.host_tier_mb == system_config("mfs", "tiny", 768, SPLIT, host_tier_mb=512.0).pool.host_tier_mb
    tiers = system_tiers("baseline")(config, per_member_lineages(load_family("tiny")))
    parts = tiers.host.part_bytes()
    assert sum(parts.values()) == 512 * 2**20
    assert all(abs(parts[m] - 512 * 2**20 * f) <= 1 for m, f in SPLIT.items())


def test_speculation_is_the_systems_own_switch():
    """baseline_spec and baseline_elastic_spec speculate and mfs_no_spec does not, whatever else is set; the plain
    baselines never do (their speculating counterparts are baseline_spec and baseline_elastic_spec); MFS as
    configured."""
    for extra in (None, {"speculation.enabled": True}, {"speculation.enabled": False}):
        enabled = {name: system_config(name, "tiny", 768, SPLIT, extra).speculation.enabled
                   for name in ("mfs", "mfs_no_spec", "baseline", "baseline_elastic", "baseline_spec",
                                "baseline_elastic_spec")}
        assert enabled["baseline_spec"] and enabled["baseline_elastic_spec"] and not enabled["mfs_no_spec"]
        assert not enabled["baseline"] and not enabled["baseline_elastic"]
        assert enabled["mfs"] is bool(extra and extra["speculation.enabled"])
    for name in ("baseline_spec", "baseline_elastic_spec"):
        assert system_config(name, "tiny", 768, SPLIT).comparison.private_drafts
    assert not system_config("mfs", "tiny", 768, SPLIT).comparison.private_drafts


def test_the_legacy_baseline_is_not_held_to_parity_and_is_not_a_default():
    extra = differing("baseline_legacy")
    assert {"scheduler.victim_order", "scheduler.decode_reservation", "scheduler.aging_steps",
            "pool.host_tier_mb"} <= extra
    assert "baseline_legacy" in SYSTEMS


def test_every_fair_baseline_runs_the_cores_scheduler_with_mfs_policies_but_the_deployments():
    """Same reservation, preemption and admission classes as MFS; only placement, the running cap and the step
    members are the deployments' (what one scheduler across members is)."""
    from orchestrator.core.complexity import ComplexityEstimator
    from orchestrator.core.engine_core import EngineCore
    from tests.fakes import fake_vocab

    cores = {}
    for name in ("mfs", *FAIR):
        config = system_config(name, "tiny", 768, SPLIT)
        cores[name] = EngineCore(config, system_family(config), clock=lambda: 0.0,
                                 estimator=ComplexityEstimator(fake_vocab()),
                                 **core_parts(config, system_scheduler(name), system_tiers(name))).scheduler
    mfs = cores["mfs"]
    for name in FAIR:
        other = cores[name]
        for part in ("reservation", "preemption", "admission", "handover", "lifecycle"):
            assert type(getattr(other, part)) is type(getattr(mfs, part)), (name, part)
        assert type(other.placement).__name__ == "Deployments"
    assert system_scheduler("mfs") is None
