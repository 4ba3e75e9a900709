"""`mfs simulate`: the bench's trace, systems and metrics, with the real core in virtual time on a cost model.

    mfs simulate --family tiny --cost-model measured --quick --rate 1            # this machine, validated below
    mfs simulate --family qwen3 --gpu h200_sxm --placement colocated --sessions 400 --rate 2
    mfs simulate --family qwen3 --gpu h200_sxm --placement fleet:8 --sessions 10000 --rate 20

Output: the bench JSON (systems, reductions, paired figures, hit rates by tier, pages timeline) plus
`simulated: {cost_model, gpu, placement, ...}`; every figure in it is SIMULATED.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from eval.baseline.split import SplitError, choose_baseline_split, split_lines, split_mode_label
from eval.bench.cli import (BenchSettings, mixed_in_phases, add_arguments as add_bench_arguments, curve_rates,
                            format_table, settings_from_args, static_split_for, trace_from_file)
from eval.bench.intervals import parse_seeds, run_file, write_over_runs
from eval.bench.result import curve_points, curve_result, rate_point
from eval.simulate.acceptance import acceptance_table
from eval.simulate.confidence import ConfidenceFileError, ConfidenceLibrary, Confidences
from eval.simulate.cost_model import MIXED_STEPS
from eval.simulate.escalation_model import EscalationModelError, default_model_text, parse_model
from eval.simulate.families import (DEFAULT_BLOCK_TOKENS, HOST_TIER_GIB_PER_GPU, PRESETS, TOKENIZER_NOTE,
                                    default_library, recorded_members)
from eval.simulate.fleet import PlacementError, parse_placement
from eval.simulate.published_quality import BENCHMARK
from eval.simulate.replay import cost_model_label, run_system, split_pilot_runner, stats_interval_for
from eval.simulate.setup import (SimSetup, drafter_memory, is_paper_family, paper_setup,
                                 pooled_setups, private_draft_memory, tiny_setup)
from eval.simulate.step_table import StepTableError
from eval.composition import load_system_config
from eval.systems import ELASTIC_BASELINES, SPLIT_BASELINES, needs_split, system_config, system_scheduler
from eval.machine import machine
from eval.workloads import (Trace, TraceFileError, WorkloadSpec, build_trace, save_trace,
                                  trace_digest)
from eval.simulate import compiled
from orchestrator.core.config import ConfigError
from orchestrator.core.family import FamilyError, load_family
from orchestrator.serve.tokenizer import FamilyTokenizer, complexity_estimator

# --capacity-policy -> the scheduler.decode_reservation every system runs (None: each system's own, the peak
# reservation with its decaying expected-length ratio for MFS and the fair baselines)
CAPACITY_POLICIES = {"guaranteed_no_evict": "guaranteed_no_evict", "max_utilization": None}
# Paper-scale traces: ShareGPT conversations as they are (long histories, real reply lengths).
PAPER = dict(max_prompt_tokens=4096, max_output_tokens=512, max_turns=4, think_s=5.0, kv_pages=0)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_bench_arguments(parser)
    parser.set_defaults(out="sim.json")
    parser.add_argument("--cost-model", choices=("measured", "aiconfigurator"), default=None,
                        help="measured: the family's step table of the local engine on this machine (the shipped "
                             "tiny families; eval/simulate/tables/<family>_measured.json); "
                             "aiconfigurator: NVIDIA's TensorRT-LLM performance database (paper-scale families)")
    parser.add_argument("--step-table", default=None, metavar="FILE", help="an mfs-step-table/1 file to use")
    parser.add_argument("--gpu", default="h200_sxm", help="aiconfigurator system: h200_sxm, h100_sxm, a100_sxm, l40s, ...")
    parser.add_argument("--backend", default="trtllm", help="aiconfigurator backend: trtllm, vllm, sglang")
    parser.add_argument("--placement", default="colocated",
                        help="colocated | per-member | fleet:N | pooled:N (N GPUs: the family on every GPU group "
                             "for MFS, each member on its own GPUs for the separate deployments)")
    parser.add_argument("--node-placement", default="colocated", help="inside a fleet: colocated | per-member")
    parser.add_argument("--member-tp", default=None, metavar="MEMBER=TP,...",
                        help="per-member and pooled:N placement: shard a member's own deployment over more GPUs "
                             "than it needs (tensor parallelism, a power of two; default: the least that holds it)")
    parser.add_argument("--no-member-homes", action="store_true",
                        help="pooled:N without member homes: the front router places the family's requests by "
                             "session, prefix and load alone (what homes are worth)")
    parser.add_argument("--block-tokens", type=int, default=DEFAULT_BLOCK_TOKENS, help="tokens per KV block (GPU)")
    parser.add_argument("--host-tier-gib", type=float, default=None, metavar="GIB",
                        help=f"host memory for the KV host tier per GPU of a node, paper-scale families (default "
                             f"{HOST_TIER_GIB_PER_GPU:g}: half a DGX H100/H200's share; 0: none); systems without a "
                             "host tier (baseline_legacy, unless --baseline-host-tier) keep none")
    parser.add_argument("--serial-saves", action="store_true",
                        help="paper-scale families: charge copies of evicted pages to the host tier before the step "
                             "(as the local engine does) instead of beside its compute on the GPU's copy stream "
                             "(the default, as TensorRT-LLM offloads)")
    parser.add_argument("--mixed-steps", choices=MIXED_STEPS, default="overlap",
                        help="paper-scale families: price a step holding decodes and a prefill chunk with the table's "
                             "one overlap factor (overlap, the default) or from aiconfigurator's mixed-step grid "
                             "(grid: what the chunk adds beside that many decodes; docs/SIMULATOR.md)")
    parser.add_argument("--colocated-deployments", choices=("shared", "turns"), default=None,
                        help="how separate deployments share one device: shared (the default for GPU families: each "
                             "deployment's process steps on its own, the device's time shared among the steps in "
                             "flight, as CUDA streams or MPS share it) or turns (one deployment's step at a time, "
                             "round robin: the tiny family's default, as the real bench's baseline runs)")
    parser.add_argument("--capacity-policy", choices=CAPACITY_POLICIES, default=None,
                        help="every system's admission: guaranteed_no_evict admits a request only when the KV for its "
                             "whole prompt + max_tokens fits beside every running request's remaining max_tokens "
                             "(never preempts); max_utilization packs on the expected reply length and preempts when "
                             "a decode runs short (TensorRT-LLM's two policies; default: guaranteed_no_evict, its "
                             "default, for the aiconfigurator trtllm backend, else max_utilization)")
    parser.add_argument("--confidences", default=None, metavar="FILE",
                        help="mfs-confidences/1 file recorded by mfs bench --record-confidences (default: the "
                             "family's own eval/simulate/data/<family>_confidences.json, else the tiny family's)")
    parser.add_argument("--escalation-model", default=None, metavar="MODEL",
                        help="when simulated requests escalate: 'recorded' (the --confidences file: the tiny family's "
                             "default) or 'parametric:P1,...@MEAN' (a probability per member but the largest and the "
                             "mean trip position in tokens: eval/simulate/escalation_model.py; paper-scale default "
                             "parametric with 0.15 per member @24)")
    parser.add_argument("--acceptance", type=float, default=None, metavar="A",
                        help="speculation: the per-token acceptance of every draft->target pair, greedy and sampled "
                             "(default: the published Qwen3 figure, about 0.76 greedy, for paper-scale families; the "
                             "family's measured table, else 0.7 assumed: eval/simulate/acceptance.py)")
    parser.add_argument("--max-prompt-tokens", type=int, default=None)
    parser.add_argument("--max-output-tokens", type=int, default=None)
    parser.add_argument("--max-turns", type=int, default=None)
    parser.add_argument("--think-s", type=float, default=None)
    parser.add_argument("--jobs", type=int, default=1, metavar="N",
                        help="simulate up to N systems at once, each in its own process (same output; N cores)")
    parser.add_argument("--compiled-core", action="store_true",
                        help="run the core's and the simulator's hot modules compiled by mypyc (`make compile-core` "
                             "first; same output, less CPU: docs/SIMULATOR.md, Speed); refused if the build is stale")


def sim_settings(args: argparse.Namespace) -> BenchSettings:
    settings = settings_from_args(args)
    paper = is_paper_family(args.family)
    chosen = {k: v for k, v in (("max_prompt_tokens", args.max_prompt_tokens), ("max_output_tokens", args.max_output_tokens),
                                ("max_turns", args.max_turns), ("think_s", args.think_s)) if v is not None}
    if paper and not args.quick:
        chosen = {**{k: v for k, v in PAPER.items() if k != "kv_pages"}, **chosen}
    return replace(settings, score_quality=False, **chosen)


def build_setups(args: argparse.Namespace, settings: BenchSettings) -> tuple[SimSetup, SimSetup | None]:
    """The run's setup, and under pooled:N the separate deployments' own (None: every system shares the first)."""
    placement = parse_placement(args.placement, args.node_placement)
    if placement.kind != "pooled":
        if getattr(args, "no_member_homes", False):
            raise PlacementError("--no-member-homes is an option of --placement pooled:N (member homes)")
        return build_setup(args, settings), None
    if not is_paper_family(args.family):
        raise PlacementError(f"--placement {placement.label} places a GPU family on GPUs; {args.family} runs on this "
                             "machine's measured cost model (colocated or fleet:N)")
    pooled, separate = pooled_setups(args.family, args.gpu, args.backend, placement.num_nodes, args.step_table,
                                     args.block_tokens, host_tier_gib_per_gpu=_host_tier_gib(args),
                                     saves_overlap=not args.serial_saves, member_tp=_member_tp(args),
                                     mixed_steps=args.mixed_steps)
    if args.no_member_homes:
        pooled.member_homes = None
    return (_with_acceptance(args, _with_policies(pooled, args, settings)),
            _with_acceptance(args, _with_policies(separate, args, settings)))


def _member_tp(args: argparse.Namespace) -> dict[str, int] | None:
    """--member-tp MEMBER=TP,... as {member: TP} (None when not given)."""
    text = getattr(args, "member_tp", None)
    if not text:
        return None
    out: dict[str, int] = {}
    for item in text.split(","):
        name, _, tp = item.partition("=")
        if not tp.strip().isdigit() or int(tp) < 1:
            raise PlacementError(f"--member-tp {text!r}: expected MEMBER=TP,... with a positive TP, e.g. llama3.1-8b=2")
        out[name.strip()] = int(tp)
    return out


def _host_tier_gib(args: argparse.Namespace) -> float:
    host_gib = HOST_TIER_GIB_PER_GPU if args.host_tier_gib is None else args.host_tier_gib
    if host_gib < 0:
        raise PlacementError(f"--host-tier-gib {host_gib:g}: expected 0 or more")
    return host_gib


def build_setup(args: argparse.Namespace, settings: BenchSettings) -> SimSetup:
    return _with_acceptance(args, _with_policies(_build_setup(args, settings), args, settings))


def _with_acceptance(args: argparse.Namespace, setup: SimSetup) -> SimSetup:
    """What the setup's simulated verifies accept (acceptance.py; --acceptance overrides every pair)."""
    try:
        setup.acceptance = acceptance_table(setup.family_name, setup.member_names, getattr(args, "acceptance", None))
    except ValueError as exc:
        raise PlacementError(str(exc)) from None
    return setup


def _with_policies(setup: SimSetup, args: argparse.Namespace, settings: BenchSettings) -> SimSetup:
    """The capacity policy every system runs, and how separate deployments share one device."""
    sharing = getattr(args, "colocated_deployments", None) or ("shared" if setup.family is not None else "turns")
    setup.colocated_deployments = sharing
    policy = args.capacity_policy or ("guaranteed_no_evict" if setup.family is not None and args.backend == "trtllm"
                                      else "max_utilization")
    reservation = CAPACITY_POLICIES[policy]
    if reservation is not None:
        if "scheduler.decode_reservation" in settings.extra_overrides:
            raise PlacementError(f"--capacity-policy {policy} sets scheduler.decode_reservation for every system; "
                                 "drop the --set, or pass --capacity-policy max_utilization with it")
        setup.overrides["scheduler.decode_reservation"] = reservation
    setup.capacity_policy = policy
    return setup


def _build_setup(args: argparse.Namespace, settings: BenchSettings) -> SimSetup:
    placement = parse_placement(args.placement, args.node_placement)
    if is_paper_family(args.family):
        if args.cost_model == "measured":
            raise PlacementError(f"--cost-model measured times this machine's engine; {args.family} runs on "
                                 "--cost-model aiconfigurator")
        return paper_setup(args.family, args.gpu, args.backend, placement, args.step_table, args.block_tokens,
                           host_tier_gib_per_gpu=_host_tier_gib(args), saves_overlap=not args.serial_saves,
                           member_tp=_member_tp(args), mixed_steps=args.mixed_steps)
    if args.mixed_steps != "overlap":
        raise PlacementError(f"--mixed-steps prices paper-scale families' steps from aiconfigurator; {args.family}'s "
                             "measured cost model prices a mixed step as its engine was timed")
    if args.serial_saves:
        raise PlacementError(f"--serial-saves is for paper-scale families; {args.family}'s measured cost model "
                             "already charges every copy in the step, as its engine makes them")
    if args.host_tier_gib is not None:
        raise PlacementError(f"--host-tier-gib sizes a GPU node's host tier; {args.family} runs with its config's "
                             "(--set pool.host_tier_mb=MB to change it)")
    if args.cost_model == "aiconfigurator":
        raise PlacementError(f"--cost-model aiconfigurator covers {', '.join(PRESETS)}; {args.family} uses measured")
    # the family's own measured cost model (missing: one line naming the command that measures it; step costs are
    # timed with the machine otherwise idle, never in the middle of a simulation)
    return tiny_setup(args.family, args.step_table, placement, settings.kv_pages)


def build_trace_for(settings: BenchSettings, setup: SimSetup, tokenizer: FamilyTokenizer, tokenizer_hash: str) -> Trace:
    if settings.trace_file:
        trace = trace_from_file(settings, tokenizer_hash)
    else:
        context = min(4 * settings.max_prompt_tokens, 40960) if setup.family is not None else min(
            m.context_tokens for m in load_family(settings.family).members)
        spec = WorkloadSpec(name=settings.workload, num_sessions=settings.sessions, rate_sessions_per_s=settings.rate,
                            seed=settings.seed, context_tokens=context,
                            max_prompt_tokens=min(settings.max_prompt_tokens, context),
                            max_output_tokens=settings.max_output_tokens, max_turns=settings.max_turns,
                            mean_think_time_s=settings.think_s, conversation_pool=max(1500, 3 * settings.sessions),
                            history=settings.history or "closed", lengths=settings.lengths or "natural")
        trace = build_trace(spec, tokenizer)
    trace = mixed_in_phases(trace, settings, setup.family or load_family(settings.family))
    if settings.save_trace:
        save_trace(trace, settings.save_trace, tokenizer_hash)
    return trace


def _extra(setup: SimSetup, settings: BenchSettings) -> dict[str, Any]:
    """Every system's overrides: the setup's (a GPU's scheduler, speculation's priors from the acceptance table),
    then --set."""
    priors = {"speculation.acceptance": setup.acceptance.priors()} if setup.acceptance is not None else {}
    return {**setup.overrides, **priors, **settings.extra_overrides}


def _draft_copies(setup: SimSetup, configs: dict, names) -> list[str]:
    """Separate deployments' memory: no drafts_only member's weights on co-located GPUs (setup.drafter_memory), and
    each speculating one's private draft copies out of it (setup.private_draft_memory)."""
    notes = []
    for name in names:
        if system_scheduler(name) is not None:
            note = drafter_memory(setup, configs[name])
            if note is not None:
                notes.append(f"{name}: {note}")
        note = private_draft_memory(setup, configs[name])
        if note is not None:
            notes.append(f"{name}: {note}")
    return notes


def system_configs(setup: SimSetup, settings: BenchSettings, trace: Trace, tokenizer) -> tuple[dict, Any]:
    extra = _extra(setup, settings)
    split = None
    if setup.split is not None:
        elastic = [n for n in settings.systems if n in ELASTIC_BASELINES]
        if elastic:
            raise PlacementError(f"{', '.join(elastic)} draw every deployment's KV from one pool of co-located "
                                 "engines; under per-member placement each member's KV lives on its own GPUs, so "
                                 "they are baseline and baseline_spec: run those")
        split = setup.split           # per-member: the GPUs split the memory for every system alike
        extra["comparison.static_split"] = dict(split)
    elif needs_split(settings.systems):     # the bench's own split search, on this deployment's pages
        family = setup.family or load_family(settings.family)
        split = static_split_for(trace, family, tokenizer,
                                 replace(settings, kv_pages=setup.num_pages, extra_overrides=extra))
    configs = {name: system_config(name, settings.family, setup.num_pages,
                                   split.fractions if split is not None and hasattr(split, "fractions") else split,
                                   extra, host_tier_mb=setup.host_tier_mb,
                                   baseline_host_tier=settings.baseline_host_tier)
               for name in settings.systems}
    if setup.family is not None:
        # A GPU family's cap (GPU_SCHEDULER) is one engine's batch: independent deployments get it per member
        # (eval/baseline/deployments.py), so a system running every member in one engine gets it once per member
        # too: the same number of sequences in flight, not a third of it.
        for name, config in configs.items():
            if system_scheduler(name) is None:
                config.scheduler.max_running_requests *= len(setup.family.serving_names)   # the deployments
    setup.notes.extend(_draft_copies(setup, configs, configs))
    return configs, split


def search_baseline_split(setup: SimSetup, settings: BenchSettings, trace: Trace, rates, split, configs: dict,
                          confidences: Confidences, tokenizer, system: str = "baseline") -> dict[str, Any]:
    """The bench's own baseline split (eval/baseline/split.py) on this run's setup: the operator's default and the
    search's shortlist re-scored by the core on a simulated pilot. Replaces the split baselines' configs; returns
    what the JSON says about the split. system: whose split (baseline_spec searches its own: its draft copies and
    drafts change what each server holds), applied to the split baselines that speculate as it does."""
    family = setup.family or load_family(settings.family)
    extra = _extra(setup, settings)

    def config_on(fractions: dict[str, float]):
        config = system_config(system, settings.family, setup.num_pages, fractions, extra,
                               host_tier_mb=setup.host_tier_mb, baseline_host_tier=settings.baseline_host_tier)
        drafter_memory(setup, config)
        private_draft_memory(setup, config)
        return config

    run_pilot = split_pilot_runner(setup, config_on, confidences, tokenizer.vocab_size, system)
    searched = config_on(split.fractions)
    chosen, about = choose_baseline_split(replace(settings, kv_pages=searched.pool.num_pages), family, trace,
                                          tuple(rates), split, complexity_estimator(tokenizer), run_pilot,
                                          cost_model_label(setup))
    speculates = searched.speculation.enabled
    for name in configs:
        if name in SPLIT_BASELINES and configs[name].speculation.enabled == speculates:
            configs[name] = system_config(name, settings.family, setup.num_pages, chosen, extra,
                                          host_tier_mb=setup.host_tier_mb,
                                          baseline_host_tier=settings.baseline_host_tier)
            drafter_memory(setup, configs[name])
            private_draft_memory(setup, configs[name])
    return {"baseline_split_mode": split_mode_label(settings.baseline_split), "baseline_split": chosen, **about}


def run_point(setup: SimSetup | dict[str, SimSetup], configs: dict, trace: Trace, confidences: Confidences,
              vocab_size: int, interval_s: float, jobs: int = 1) -> dict[str, Any]:
    """Every system on `trace` (one rate): the point's JSON block (eval.bench.result.rate_point). setup: one for
    every system, or each system's own (pooled placement). jobs > 1: the systems run in forked processes (each
    simulation is a function of its inputs alone: same output)."""
    setups = setup if isinstance(setup, dict) else {name: setup for name in configs}
    args = (trace, confidences, vocab_size, interval_s)
    if jobs > 1 and len(configs) > 1:
        results = _run_forked(configs, setups, args, jobs)
    else:
        results = {name: _records_and_metrics(name, config, setups[name], *args) for name, config in configs.items()}
    records_by_system = {name: records for name, (records, _) in results.items()}
    systems = {name: metrics for name, (_, metrics) in results.items()}
    return rate_point(trace.spec.rate_sessions_per_s, records_by_system, systems)


def _records_and_metrics(name: str, config, setup: SimSetup, trace: Trace, confidences: Confidences,
                         vocab_size: int, interval_s: float, keep_nodes: list | None = None) -> tuple[list, dict[str, Any]]:
    run, metrics = run_system(name, config, setup, trace, confidences, vocab_size, interval_s,
                              keep_nodes=keep_nodes)
    return run.records, metrics


_FORKED: tuple | None = None       # what forked workers simulate (inherited through fork, never pickled)
# A forked worker's finished nodes: never freed, the worker process ends (os._exit) after its one system
_WORKER_NODES: list = []


def _forked_system(name: str) -> tuple[list, dict[str, Any]]:
    configs, setups, args = _FORKED
    records, metrics = _records_and_metrics(name, configs[name], setups[name], *args, keep_nodes=_WORKER_NODES)
    for record in records:         # only latencies are read back (eval.bench.result.paired_vs_baseline): do not ship the tokens
        record.prompt_token_ids, record.output_token_ids, record.output_logprobs = [], [], []
    return records, metrics


def _run_forked(configs: dict, setups: dict, args: tuple, jobs: int) -> dict[str, tuple[list, dict[str, Any]]]:
    import multiprocessing

    global _FORKED
    _FORKED = (configs, setups, args)
    try:
        # one system per worker: a worker keeps its finished nodes (_WORKER_NODES) until it exits
        with multiprocessing.get_context("fork").Pool(min(jobs, len(configs)), maxtasksperchild=1) as pool:
            results = pool.map(_forked_system, list(configs), chunksize=1)
    finally:
        _FORKED = None
    return dict(zip(configs, results))


def load_confidences(args: argparse.Namespace, settings: BenchSettings, setup: SimSetup, tiny):
    """The recorded confidences (--confidences, else the simulated family's own recording, else the tiny
    family's), or the stated parametric model (the paper-scale default)."""
    # one probability per member requests go to but the largest (a drafts_only member never escalates)
    routed = setup.family.serving_names if setup.family is not None else setup.member_names
    text = args.escalation_model or ("recorded" if not is_paper_family(args.family)
                                     else default_model_text(routed))
    if text != "recorded":
        min_tokens = load_system_config(settings.extra_overrides or None).escalation.min_tokens
        return parse_model(text, routed, min_tokens, settings.seed)
    confidences = ConfidenceLibrary.load(args.confidences or default_library(setup.family_name), seed=settings.seed)
    confidences.map_members(setup.member_names, recorded_members(confidences, tiny.member_names))
    return confidences


def run_simulation(args: argparse.Namespace) -> dict[str, Any]:
    settings = sim_settings(args)
    setup, separate = build_setups(args, settings)
    tiny = load_family("tiny") if setup.family is not None else load_family(settings.family)
    tokenizer = FamilyTokenizer(tiny.members[0].checkpoint_dir)
    started = time.perf_counter()
    trace = build_trace_for(settings, setup, tokenizer, tiny.members[0].tokenizer_hash)
    trace_s = time.perf_counter() - started
    rates = curve_rates(settings, trace)
    headline = trace.spec.rate_sessions_per_s if trace.spec.rate_sessions_per_s in rates else rates[0]
    confidences = load_confidences(args, settings, setup, tiny)
    if separate is None:
        configs, split = system_configs(setup, settings, trace, tokenizer)
        setups: SimSetup | dict[str, SimSetup] = setup
    else:       # pooled: the separate deployments on their per-member GPUs, the family's systems pooled
        deployed = tuple(n for n in settings.systems if system_scheduler(n) is not None)
        pooled = tuple(n for n in settings.systems if n not in deployed)
        configs, _ = system_configs(setup, replace(settings, systems=pooled), trace, tokenizer)
        deployed_configs, split = system_configs(separate, replace(settings, systems=deployed), trace, tokenizer)
        merged = {**configs, **deployed_configs}
        configs = {n: merged[n] for n in settings.systems}
        setups = {n: separate if n in deployed else setup for n in settings.systems}
    sim_started = time.perf_counter()
    split_baselines = [n for n in configs if n in SPLIT_BASELINES]
    placed = (separate or setup).split is not None       # the deployments' GPUs fix their split
    about_split: dict[str, Any] = {"baseline_split_mode": None if not split_baselines else
                                   "placement" if placed else "traffic"}
    if split_baselines and not placed and settings.baseline_split != "traffic":
        plain = [n for n in split_baselines if not configs[n].speculation.enabled]
        if plain:
            about_split = search_baseline_split(setup, settings, trace, rates, split, configs, confidences, tokenizer)
        if "baseline_spec" in configs:
            spec_split = search_baseline_split(setup, settings, trace, rates, split, configs, confidences, tokenizer,
                                               system="baseline_spec")
            if not plain:
                about_split = {"baseline_split_mode": spec_split["baseline_split_mode"]}
            about_split["baseline_spec_split"] = {k: v for k, v in spec_split.items() if k != "baseline_split_mode"}
    points = []
    for rate in rates:
        at_rate = trace.at_rate(rate)
        points.append(run_point(setups, configs, at_rate, confidences, tokenizer.vocab_size, stats_interval_for(at_rate),
                                jobs=getattr(args, "jobs", 1)))
    sim_s = time.perf_counter() - sim_started
    head = next(p for p in points if p["rate"] == headline)
    curve = curve_points(points)
    notes = list(trace.notes) + list(setup.notes) + (list(split.notes) if hasattr(split, "notes") else [])
    notes.append(f"SIMULATED with the {setup.cost.name} cost model ({setup.cost.describe()['source']}): no figure here "
                 "is a measurement")
    notes.append("quality_reference_logprob: not simulated (no model runs); member_token_share says which members served"
                 + ("; quality_from_table weights each member's published score by it (eval/simulate/published_quality.py)"
                    if head["systems"] and all(m.get("quality_from_table") for m in head["systems"].values()) else ""))
    if setup.host_tier_mb is not None:
        per_gpu = setup.memory.get("host_tier_gib_per_gpu")
        notes.append(f"host KV tier: {setup.host_tier_mb / 1024:g} GiB per node"
                     + (f" ({per_gpu:g} GiB per GPU)" if per_gpu is not None else "")
                     + " for every system that keeps one (the "
                     "static-split baselines: one part per deployment, sized as its slice; the elastic baselines: one "
                     "LRU their deployments share); baseline_legacy: "
                     + ("the same (--baseline-host-tier)" if settings.baseline_host_tier else "none (its servers' default)")
                     + ("; copies of evicted pages to it run beside the step's compute (the GPU's copy stream; "
                        "--serial-saves charges them before the step)" if setup.cost.saves_overlap
                        else "; copies to and from it are charged in the step"))
    return {
        "workload": {**trace.at_rate(headline).summary(), "trace_sha256": trace_digest(trace, tiny.members[0].tokenizer_hash)},
        "settings": {**_settings(settings), "static_split": getattr(split, "fractions", split),
                     "static_split_traffic_share": getattr(split, "traffic_share", None),
                     "baseline_split_mode": about_split.pop("baseline_split_mode"),
                     "baseline_split": about_split.pop("baseline_split", getattr(split, "fractions", split)),
                     "configs": {n: asdict(c) for n, c in configs.items()}, "machine": machine()},
        **about_split,
        **curve_result(settings, headline, head, rates, curve),
        "notes": notes,
        "simulated": {"cost_model": setup.cost.describe(), "gpu": setup.gpu,
                      "placement": setup.placement.label if separate is None else args.placement,
                      "capacity_policy": setup.capacity_policy,
                      "colocated_deployments": setup.colocated_deployments,
                      "node_placement": setup.placement.kind, "num_nodes": setup.placement.num_nodes,
                      "member_homes": setup.member_homes,
                      "memory": setup.memory, "num_pages_per_node": setup.num_pages, "page_bytes": setup.page_bytes,
                      **({} if separate is None else {"separate_deployments": {
                          "placement": separate.placement.label, "num_nodes": separate.placement.num_nodes,
                          "memory": separate.memory, "num_pages_per_node": separate.num_pages,
                          "cost_model": separate.cost.describe(),
                          "systems": [n for n in settings.systems if setups[n] is separate]}}),
                      "confidences": confidences.describe(),
                      "acceptance": setup.acceptance.describe() if setup.acceptance is not None else None,
                      "tokenizer": (f"{tiny.name}'s own tokenizer (the simulated family's)" if
                                    setup.family is None else TOKENIZER_NOTE),
                      "trace_build_s": round(trace_s, 1), "simulate_s": round(sim_s, 1),
                      "core": {"compiled_modules": compiled.active_modules()}},
    }


def _settings(settings: BenchSettings) -> dict[str, Any]:
    d = asdict(settings)
    d["systems"] = list(settings.systems)
    d["rates"] = list(settings.rates) if settings.rates else None
    return d


def use_compiled_core() -> None:
    """--compiled-core: the compiled modules are chosen when their packages are imported, so a process that has
    not chosen them re-executes itself with MFS_COMPILED_CORE set (the command line is `mfs simulate ...`)."""
    if compiled.build_dir() is None:
        reason = compiled.stale_reason(compiled.DEFAULT_DIR)
        if reason is not None:
            raise SystemExit(f"mfs simulate: --compiled-core: {reason}")
        if sys.argv[1:2] != ["simulate"]:
            raise SystemExit(f"mfs simulate: --compiled-core: set {compiled.ENV}=1 before this process imports the "
                             "core (only the `mfs simulate` command line re-executes itself)")
        os.execve(sys.executable, [sys.executable, "-m", "orchestrator.serve.cli", *sys.argv[1:]],
                  {**os.environ, compiled.ENV: "1"})
    if not compiled.active_modules():
        raise SystemExit(f"mfs simulate: --compiled-core: {compiled.stale_reason(compiled.build_dir())}")


def main(args: argparse.Namespace) -> int:
    if getattr(args, "compiled_core", False):
        use_compiled_core()
    if not args.seeds:
        return main_one(args)
    try:
        seeds = parse_seeds(args.seeds)
    except ValueError as exc:
        raise SystemExit(f"mfs simulate: {exc}") from None
    if args.repeats != 1:
        raise SystemExit("mfs simulate: --repeats is for real runs (a simulation gives the same figures every time)")
    command = ("mfs simulate " + " ".join(sys.argv[2:])) if sys.argv[1:2] == ["simulate"] else None
    files = []
    for seed in seeds:
        path = run_file(args.out, seed, 0, 1)
        main_one(argparse.Namespace(**{**vars(args), "seed": seed, "out": str(path)}))
        files.append(path)
    write_over_runs(args.out, files, command)
    return 0


def main_one(args: argparse.Namespace) -> int:
    started = time.monotonic()
    try:
        result = run_simulation(args)
    except (TraceFileError, ConfigError, StepTableError, PlacementError, ConfidenceFileError, EscalationModelError,
            FamilyError, SplitError) as exc:
        raise SystemExit(f"mfs simulate: {exc}") from None
    result["settings"]["command"] = ("mfs simulate " + " ".join(sys.argv[2:])) if sys.argv[1:2] == ["simulate"] else None
    result["settings"]["wall_s"] = round(time.monotonic() - started, 1)
    Path(args.out).write_text(json.dumps(result, indent=1))
    sim = result["simulated"]
    print(f"SIMULATED ({sim['cost_model']['source']}; placement {sim['placement']})")
    print(format_table(result))
    for line in split_lines(result):
        print(line)
    quality = {name: m.get("quality_from_table") for name, m in result["systems"].items()}
    if quality and all(quality.values()):
        print(f"quality from the published table ({BENCHMARK}; weighted by each member's token share, not measured): "
              + ", ".join(f"{name} {q['score']:.2f}" for name, q in quality.items()))
    for note in result["notes"]:
        print(f"note: {note}")
    print(f"wrote {args.out} (trace {sim['trace_build_s']} s, simulation {sim['simulate_s']} s, "
          f"total {result['settings']['wall_s']} s)")
    return 0
