"""One system's replay through simulated nodes (the real core in virtual time) and its metrics block, and the
baseline split's simulated pilot (eval/baseline/split.py's PilotRunner): `mfs simulate` runs it on its own setup,
`mfs bench` on the measured CPU cost model (measured_split_pilot), so the real bench spends no wall time on it."""
from __future__ import annotations

from typing import Any

from eval.bench.metrics import decode_floor_token_latency, pages_timeline, summarize
from eval.bench.quality import member_token_share
from eval.bench.result import without_rows
from eval.workloads import Trace, natural_lengths
from eval.bench.confidence_file import request_key
from eval.simulate.confidence import ConfidenceLibrary, Confidences
from eval.simulate.driver import STATS_INTERVAL_S, SimRun, no_full_collections, simulate
from eval.simulate.executor import SimExecutor
from eval.simulate.families import default_library, recorded_members
from eval.simulate.fleet import parse_placement
from eval.simulate.node import SimNode
from eval.simulate.published_quality import table_quality
from eval.simulate.setup import SimSetup, measured_model_path, missing_model, tiny_setup
from eval.systems import system_config, system_scheduler, system_tiers
from orchestrator.core.family import FamilySpec
from orchestrator.serve.tokenizer import FamilyTokenizer


def run_system(name: str, config, setup: SimSetup, trace: Trace, confidences: Confidences,
               vocab_size: int, stats_interval_s: float,
               replies: dict[str, list[int]] | None = None,
               keep_nodes: list | None = None, scheduler_factory=None, tiers=None) -> tuple[SimRun, dict[str, Any]]:
    """replies: request key -> token ids of a real run of this system on this trace, replayed (validation).
    keep_nodes: see driver.simulate (a forked worker's shortcut past freeing the nodes).
    scheduler_factory, tiers: the scheduler and the tiers source to run (None: the ones system `name` runs,
    eval.systems.system_scheduler and system_tiers)."""
    scheduler_factory = scheduler_factory or system_scheduler(name)
    tiers = tiers or system_tiers(name)
    lengths = natural_lengths(trace, request_key)

    def make_executor(family, num_pages, page_bytes):
        return SimExecutor(family, num_pages, page_bytes, setup.cost, confidences, vocab_size,
                           members_in_parallel=setup.members_in_parallel, replies=replies, natural_lengths=lengths,
                           acceptance=setup.acceptance, drafts_ride=config.speculation.drafts_ride)

    def make_nodes(clock, events, on_output):
        share = scheduler_factory is not None and setup.colocated_deployments == "shared"
        # a fleet of several nodes with member homes: each node's homes (the front router reads the same list)
        homes = setup.member_homes if setup.placement.num_nodes > 1 else None
        return [SimNode(f"node{i}", config, setup.family, clock, events, make_executor, on_output, scheduler_factory,
                        share_device=share, homes=homes[i] if homes else None, tiers=tiers)
                for i in range(setup.placement.num_nodes)]

    run = simulate(name, make_nodes, trace, stats_interval_s, keep_nodes, setup.member_homes)
    with no_full_collections():     # else collections walk the live records and trace: 0.6 s of a 17 s replay
        metrics = summarize(run.records, run.counters, run.duration_s, pages_timeline(run.samples), setup.member_names)
    step_s = setup.solo_decode_step_s()
    metrics["solo_decode_step_s"] = step_s
    metrics["decode_floor_token_latency_s"] = decode_floor_token_latency(run.records, step_s)
    metrics["counters"] = run.counters
    metrics["quality_reference_logprob"] = None
    metrics["member_token_share"] = member_token_share(run.records)
    metrics["quality_from_table"] = table_quality(metrics["member_token_share"])   # paper-scale families only
    metrics["simulation"] = {"steps": run.num_steps, "busy_s": run.busy_s, "events": run.num_events,
                             "wall_s": round(run.wall_s, 2), "cpu_s": round(run.cpu_s, 2),
                             "output_tokens": sum(r.output_tokens for r in run.records),
                             "front_router": run.router_decisions, "step_profile": run.step_profile}
    return run, metrics


def stats_interval_for(trace: Trace) -> float:
    return max(STATS_INTERVAL_S, (trace.arrival_times_s[-1] if trace.arrival_times_s else 0.0) / 2000)


def split_pilot_runner(setup: SimSetup, config_on, confidences: Confidences, vocab_size: int,
                       system: str = "baseline"):
    """eval.baseline.split's PilotRunner on this setup: the baseline (or `system`, another split baseline) on a
    split (config_on(fractions)), simulated."""
    def run_pilot(fractions: dict[str, float], trace: Trace):
        config = config_on(fractions)
        run, metrics = run_system(f"{system}_split_pilot", config, setup, trace, confidences, vocab_size,
                                  stats_interval_for(trace), scheduler_factory=system_scheduler(system),
                                  tiers=system_tiers(system))
        return config, run.records, without_rows(metrics)

    return run_pilot


def cost_model_label(setup: SimSetup) -> str:
    return f"the {setup.cost.name} cost model ({setup.cost.describe()['source']})"


def measured_split_pilot(settings, family: FamilySpec) -> tuple[Any, str]:
    """`mfs bench`'s split pilot, simulated on this machine's measured cost model (eval/simulate/tables/), so the
    real bench spends no wall time on it: (PilotRunner, cost model label), or (None, why) when that model does not
    price every member of the family."""
    path = measured_model_path(None, family.name)
    if not path.is_file():
        return None, missing_model(settings.family, family.name, None)
    setup = tiny_setup(settings.family, str(path), parse_placement("colocated", "colocated"), settings.kv_pages)
    described = setup.cost.describe()
    priced = set(described.get("coefficients_s") or described.get("members") or ())
    if not set(family.member_names) <= priced:
        return None, f"the measured cost model {path} prices {sorted(priced)}, not {family.name}'s members"
    confidences = ConfidenceLibrary.load(default_library(family.name), seed=settings.seed)
    confidences.map_members(setup.member_names, recorded_members(confidences, family.member_names))
    tokenizer = FamilyTokenizer(family.members[0].checkpoint_dir)

    def config_on(fractions: dict[str, float]):
        return system_config("baseline", settings.family, settings.kv_pages, fractions, settings.extra_overrides,
                             baseline_host_tier=settings.baseline_host_tier)

    return split_pilot_runner(setup, config_on, confidences, tokenizer.vocab_size), cost_model_label(setup)
