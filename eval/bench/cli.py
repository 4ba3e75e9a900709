"""`mfs bench`: replays one seeded ShareGPT trace in real time through MFS, the baseline and ablations."""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from eval.bench.driver import (PROBE_TOKENS, measure_engine, pinned_request, probe_decode_step_s,  # noqa: F401
                              replay, run_request, warm_up)
from eval.baseline.split import (SPLIT_CANDIDATES, SPLIT_PILOT_SESSIONS, SplitError, SplitPilot, choose_baseline_split,
                                 parse_split_mode, split_lines, split_mode_label)
from eval.bench.confidence_file import write_library
from eval.bench.quality import add_quality as _add_quality
from eval.bench.report import TABLE_COLUMNS, decode_floor_line, format_table, paired_line  # noqa: F401 (re-exported)
from eval.bench.curve import TPOT_SLO_X, TTFT_SLO_X, parse_rates
from eval.bench.intervals import parse_seeds, run_file, write_over_runs
from eval.bench.metrics import RequestRecord
from eval.bench.result import curve_points, curve_result, rate_point
from eval.composition import core_parts, load_system_config, system_family
from eval.systems import (ATTRIBUTION_SYSTEMS, DEFAULT_SYSTEMS, SPLIT_BASELINES, SYSTEMS, RoutedRequest, StaticSplit, best_static_split,
                          needs_split, system_config, system_scheduler,
                          system_tiers)
from eval.workloads import (HISTORIES, LENGTHS, WORKLOADS, Trace, TraceFileError, WorkloadSpec, build_trace,
                                  load_trace, save_trace, trace_digest, with_history, with_lengths, with_mix_phases)
from eval.machine import machine
from orchestrator.core.config import ConfigError
from orchestrator.core.family import FamilySpec, load_family
from orchestrator.serve.tokenizer import FamilyTokenizer, complexity_estimator, family_tokenizer

# Defaults: the case MFS targets - multi-turn chat under a KV budget that is tight for separate
# deployments. 768 pages x 16 KiB = 12 MiB of fp32 KV: one 1024-token conversation on tiny-l alone
# needs 8 layers x 64 blocks = 512 pages, so a static split cannot hold many live sessions.
FULL = dict(sessions=24, rate=0.5, kv_pages=768, max_turns=4, max_prompt_tokens=1024, max_output_tokens=128,
            think_s=2.0)
QUICK = dict(sessions=10, rate=1.0, kv_pages=512, max_turns=3, max_prompt_tokens=512, max_output_tokens=64,
             think_s=1.5)
# The load curves `mfs bench` runs without --rates (session arrivals per second): from light load to well
# past the baseline's knee on the CPU (docs/BENCHMARKS.md, Method). The headline keys describe `rate`, which is
# on each curve.
FULL_RATES = (0.25, 0.5, 1.0, 2.0, 4.0)
QUICK_RATES = (0.5, 1.0, 4.0)


@dataclass(slots=True)
class BenchSettings:
    workload: str = "multiturn"
    sessions: int = FULL["sessions"]
    rate: float = FULL["rate"]
    kv_pages: int = FULL["kv_pages"]
    systems: tuple[str, ...] = DEFAULT_SYSTEMS
    seed: int = 0
    family: str = "tiny"
    quick: bool = False
    max_turns: int = FULL["max_turns"]
    max_prompt_tokens: int = FULL["max_prompt_tokens"]
    max_output_tokens: int = FULL["max_output_tokens"]
    think_s: float = FULL["think_s"]
    score_quality: bool = True
    progress: bool = True
    extra_overrides: dict[str, Any] = field(default_factory=dict)   # applied to every system (sweeps)
    trace_file: str | None = None          # replay this saved trace instead of building one from ShareGPT
    save_trace: str | None = None          # write the trace used (built or loaded) here
    history: str | None = None             # closed | dataset; None: closed for a built trace, a file's own
    lengths: str | None = None             # natural | exact; None: natural for a built trace, a file's own
    mix_phases: tuple[float, ...] = ()     # a shifting traffic mix (workloads.with_mix_phases); () keeps the estimate
    rates: tuple[float, ...] | None = None  # the load curve: session arrival rates (None: `rate` only)
    slo_ttft_x: float = TTFT_SLO_X         # SLO: p90 TTFT within this x the lightest-rate baseline's p50 TTFT
    slo_tpot_x: float = TPOT_SLO_X         # and p90 TPOT within this x its p50 TPOT
    slo_ttft_s: float | None = None        # absolute SLO limits instead of the multiples
    slo_tpot_s: float | None = None
    baseline_split: str = "search"         # search | proportional | traffic | "member=fraction,..." (fixed)
    split_candidates: int = SPLIT_CANDIDATES   # search: the shortlist the core re-scores beside the default
    split_pilot_sessions: int = SPLIT_PILOT_SESSIONS   # search: the pilot replays the run's first sessions
    baseline_host_tier: bool = False       # baseline_legacy's deployments get MFS's host tier too (counter-check)
    record_confidences: str | None = None  # write every reply's per-token confidences here (mfs simulate reads them)

    @classmethod
    def quick_defaults(cls, **kwargs: Any) -> "BenchSettings":
        q = QUICK
        base = cls(sessions=q["sessions"], rate=q["rate"], kv_pages=q["kv_pages"], quick=True,
                   max_turns=q["max_turns"], max_prompt_tokens=q["max_prompt_tokens"],
                   max_output_tokens=q["max_output_tokens"], think_s=q["think_s"])
        return replace(base, **kwargs)


# ----------------------------------------------------------------------------- setup
def make_trace(settings: BenchSettings, tokenizer: FamilyTokenizer, family: FamilySpec) -> Trace:
    context = min(m.context_tokens for m in family.members)
    spec = WorkloadSpec(name=settings.workload, num_sessions=settings.sessions, rate_sessions_per_s=settings.rate,
                        seed=settings.seed, context_tokens=context,
                        max_prompt_tokens=min(settings.max_prompt_tokens, context),
                        max_output_tokens=settings.max_output_tokens, max_turns=settings.max_turns,
                        mean_think_time_s=settings.think_s, history=settings.history or "closed",
                        lengths=settings.lengths or "natural")
    return build_trace(spec, tokenizer)


def static_split_for(trace: Trace, family: FamilySpec, tokenizer: FamilyTokenizer, settings: BenchSettings) -> StaticSplit:
    estimator = complexity_estimator(tokenizer)
    # Complexity from the dataset prompt: the closed-loop prompt is only known during the replay.
    requests = [RoutedRequest(estimator.score(t.prompt_token_ids), length + t.max_tokens)
                for s in trace.sessions for t, length in zip(s.turns, trace.prompt_lengths(s))]
    config = load_system_config({"family": settings.family, "pool.num_pages": settings.kv_pages,
                                    **settings.extra_overrides})
    return best_static_split(family, requests, config, settings.kv_pages)


async def run_system(name: str, config: Any, trace: Trace, on_done=None,
                     instrument=None, scheduler_factory=None) -> tuple[list[RequestRecord], dict]:
    """instrument(engine), when given, is called right before the replay (profilers); if it returns a
    callable, that is called right after the replay, before anything else runs on the engine.
    scheduler_factory: the scheduler to run (None: the one system `name` runs, eval.systems.system_scheduler)."""
    from orchestrator.serve.serving import LocalServing

    engine = LocalServing(config, system_family(config),
                          **core_parts(config, scheduler_factory or system_scheduler(name), system_tiers(name)))
    await engine.start()
    try:
        return await measure_engine(engine, list(engine.family.member_names), trace, name, on_done, instrument)
    finally:
        await engine.stop()


# ----------------------------------------------------------------------------- orchestration
def trace_from_file(settings: BenchSettings, tokenizer_hash: str) -> Trace:
    """settings.trace_file, replayed with the history and lengths the settings ask for (else the file's own)."""
    trace = load_trace(settings.trace_file, tokenizer_hash)
    if settings.history:
        trace = with_history(trace, settings.history)
    return with_lengths(trace, settings.lengths) if settings.lengths else trace


def parse_mix_phases(text: str | None) -> tuple[float, ...]:
    if not text:
        return ()
    try:
        fractions = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--mix-phases {text!r}: expected comma-separated fractions, e.g. 0.7,0.2") from None
    if any(not 0.0 <= f <= 1.0 for f in fractions):
        raise ValueError(f"--mix-phases {text!r}: each fraction must be between 0 and 1")
    return fractions


def largest_member_bound(thresholds: list[float], num_members: int) -> float:
    """The complexity from which Router.adequate_index gives the largest of num_members members (thresholds are the
    lower bounds of the members' bands after the first; a family smaller than the list uses its first ones, a
    larger one has no band for its largest members and gets the highest band's bound)."""
    if num_members < 2:
        return 0.0
    return float(thresholds[min(num_members, len(thresholds) + 1) - 2])


def mixed_in_phases(trace: Trace, settings: BenchSettings, family: FamilySpec) -> Trace:
    """The trace with the settings' shifting mix (--mix-phases), on the router's own band of the largest member."""
    if not settings.mix_phases:
        return trace
    if len(family.serving_names) < 2:
        raise ValueError("--mix-phases shifts traffic between members: the family has one to route to")
    thresholds = load_system_config(settings.extra_overrides or None).router.complexity_thresholds
    return with_mix_phases(trace, settings.mix_phases, largest_member_bound(thresholds, len(family.serving_names)),
                           settings.seed)


def prepare(settings: BenchSettings) -> tuple[FamilySpec, Trace, StaticSplit | None, list[str]]:
    """The family, the trace, the baseline's static split (when a system needs it) and their notes."""
    family = load_family(settings.family)
    tokenizer = family_tokenizer(family)
    tokenizer_hash = family.members[0].tokenizer_hash
    if settings.trace_file:
        trace = trace_from_file(settings, tokenizer_hash)
    else:
        trace = make_trace(settings, tokenizer, family)
    trace = mixed_in_phases(trace, settings, family)
    if settings.save_trace:
        save_trace(trace, settings.save_trace, tokenizer_hash)
    notes: list[str] = list(trace.notes)
    if settings.trace_file:
        notes.append(f"trace replayed from {settings.trace_file}: the workload block describes it, "
                     "the trace settings (workload, sessions, rate, seed, turns, lengths) were not used")
    split = static_split_for(trace, family, tokenizer, settings) if needs_split(settings.systems) else None
    if split is not None:
        notes += split.notes
    return family, trace, split, notes


def config_for(name: str, settings: BenchSettings, split: StaticSplit | None,
               baseline_split: dict[str, float] | None = None):
    return system_config(name, settings.family, settings.kv_pages, split.fractions if split else None,
                         settings.extra_overrides, baseline_split, baseline_host_tier=settings.baseline_host_tier)


def run_coroutine(coro):
    """asyncio.run, also from inside a running event loop (a Jupyter kernel): then on a fresh thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()


def curve_rates(settings: BenchSettings, trace: Trace) -> tuple[float, ...]:
    """The rates to replay: settings.rates, else the trace's own rate only."""
    return tuple(settings.rates) if settings.rates else (trace.spec.rate_sessions_per_s,)


def run_point(settings: BenchSettings, family: FamilySpec, trace: Trace, split: StaticSplit | None,
              configs: dict[str, Any], notes: list[str], progress=None,
              baseline_split: dict[str, float] | None = None) -> tuple[dict, dict]:
    """Every system on `trace` (one rate): (records by system, the point's JSON block)."""
    records_by_system: dict[str, list[RequestRecord]] = {}
    systems: dict[str, Any] = {}
    for name in settings.systems:
        config = config_for(name, settings, split, baseline_split)
        configs[name] = asdict(config)
        if progress is not None:
            progress.set_postfix_str(f"{name} @ {trace.spec.rate_sessions_per_s:g}/s")
        on_done = (lambda _r: progress.update(1)) if progress is not None else None
        records, metrics = run_coroutine(run_system(name, config, trace, on_done))
        records_by_system[name], systems[name] = records, metrics
    dtype = next(iter(configs.values()))["engine"]["dtype"] if configs else "float32"
    _add_quality(settings, family, trace, records_by_system, systems, notes, dtype)
    return records_by_system, rate_point(trace.spec.rate_sessions_per_s, records_by_system, systems)


def run_bench(settings: BenchSettings, split_pilot: SplitPilot | None = None) -> dict[str, Any]:
    """split_pilot: the simulator on which `--baseline-split search` re-scores the split search's shortlist beside
    the operator's default (`mfs bench`, eval/commands/bench.py, hands in eval/simulate/replay.py's
    measured_split_pilot: the simulator reads the bench's workloads and maths, so the bench does not import it).
    None: no split is re-scored, the default stands."""
    family, trace, split, notes = prepare(settings)
    rates = curve_rates(settings, trace)
    headline = settings.rate if settings.rate in rates and not settings.trace_file else rates[0]
    if settings.trace_file and trace.spec.rate_sessions_per_s in rates:
        headline = trace.spec.rate_sessions_per_s
    configs: dict[str, Any] = {}
    split_baselines = [n for n in settings.systems if n in SPLIT_BASELINES]
    progress = _progress(settings, trace, len(rates))
    points: list[dict[str, Any]] = []
    head: dict[str, Any] = {}
    baseline_split, about_split = None, {}
    recorded = []          # every reply, for --record-confidences
    try:
        if split_baselines:
            searching = settings.baseline_split == "search"     # the pilot is simulated: no wall time on it
            run_pilot, cost_model = (split_pilot(settings, family) if searching and split_pilot is not None
                                     else (None, "no pilot simulator given" if searching else ""))
            estimator = complexity_estimator(family_tokenizer(family))
            baseline_split, about_split = choose_baseline_split(settings, family, trace, rates, split, estimator,
                                                                run_pilot, cost_model, progress)
        for rate in rates:
            records_by_system, point = run_point(settings, family, trace.at_rate(rate), split, configs, notes,
                                                 progress, baseline_split)
            recorded += [r for records in records_by_system.values() for r in records]
            if rate == headline:
                head = point
            points.append(point)
    finally:
        if progress is not None:
            progress.close()
    curve = curve_points(points)
    if settings.record_confidences:   # the simulator's escalation input (eval/bench/confidence_file.py)
        _record_confidences(settings, family, recorded, notes)
    result = {
        "workload": {**trace.at_rate(headline).summary(),
                     "trace_sha256": trace_digest(trace, family.members[0].tokenizer_hash)},
        "settings": {**_settings_dict(settings, trace.spec), "static_split": split.fractions if split else None,
                     "static_split_traffic_share": split.traffic_share if split else None,
                     "static_split_requests_by_member": split.requests_by_member if split else None,
                     "baseline_split_mode": split_mode_label(settings.baseline_split), "baseline_split": baseline_split,
                     "configs": configs, "machine": _machine()},
        **about_split,
        **curve_result(settings, headline, head, rates, curve),
        "notes": list(dict.fromkeys(notes)),
    }
    return result


def _record_confidences(settings: BenchSettings, family: FamilySpec, records: list, notes: list[str]) -> None:
    counts = write_library(records, settings.record_confidences, family.name,
                           f"mfs bench systems {','.join(settings.systems)} seed {settings.seed}")
    notes.append(f"per-token confidences written to {settings.record_confidences} (sequences per member: {counts})")


def _settings_dict(settings: BenchSettings, spec: WorkloadSpec) -> dict[str, Any]:
    """The settings as run; `sampling` says what every request asked for under the trace's reply lengths."""
    d = asdict(settings)
    d["systems"] = list(settings.systems)
    d["sampling"] = sampling_record(spec.lengths, spec.max_output_tokens)
    return d


def sampling_record(lengths: str, max_output_tokens: int) -> dict[str, Any]:
    """natural: greedy, EOS ends a reply, max_tokens the cap a chat client sends; exact: every reply the dataset
    reply's length (ignore_eos), capped."""
    if lengths == "exact":
        return {"temperature": 0.0, "ignore_eos": True,
                "max_tokens": f"the dataset reply's length, at most {max_output_tokens}"}
    return {"temperature": 0.0, "ignore_eos": False, "max_tokens": max_output_tokens}


def _machine() -> dict[str, Any]:
    import torch  # noqa: F401  (described by eval.machine when imported: the engine ran on it)

    return machine()


def _progress(settings: BenchSettings, trace: Trace, num_rates: int = 1):
    if not settings.progress:
        return None
    from tqdm import tqdm

    return tqdm(total=round(trace.num_requests * len(settings.systems) * num_rates), unit="req", desc="bench",
                file=sys.stderr)


# ----------------------------------------------------------------------------- CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", choices=WORKLOADS, default="multiturn")
    parser.add_argument("--rate", type=float, default=None,
                        help="session arrivals per second (Poisson); alone: one rate instead of the default curve")
    parser.add_argument("--rates", default=None, metavar="R1,R2,...",
                        help="the load curve: replay the same sessions at each session arrival rate (default: "
                             f"{','.join(map(str, FULL_RATES))}; --quick: {','.join(map(str, QUICK_RATES))})")
    parser.add_argument("--history", choices=HISTORIES, default=None,
                        help="closed (default): each turn re-sends the reply this system generated; "
                             "dataset: re-sends ShareGPT's reply (an open-loop replay)")
    parser.add_argument("--lengths", choices=LENGTHS, default=None,
                        help="natural (default): EOS ends a reply, max_tokens is the cap (--max-output-tokens) as "
                             "chat clients send it; exact: every reply has the dataset reply's length (ignore_eos), "
                             "the same work for every system")
    parser.add_argument("--mix-phases", default=None, metavar="F1,F2,...",
                        help="a traffic mix that shifts: the sessions fall into equal phases by arrival, and in "
                             "phase i a share Fi of them is for the largest member (the rest for the smaller "
                             "ones); every system routes on these difficulties, e.g. 0.7,0.2")
    parser.add_argument("--slo-ttft-x", type=float, default=TTFT_SLO_X,
                        help="SLO: p90 TTFT within this multiple of the lightest-rate baseline's p50 TTFT")
    parser.add_argument("--slo-tpot-x", type=float, default=TPOT_SLO_X,
                        help="SLO: p90 TPOT within this multiple of the lightest-rate baseline's p50 TPOT")
    parser.add_argument("--baseline-split", type=_split_mode, default="search", metavar="MODE|MEMBER=F,...",
                        help="the split baselines' static split: search (default: the best of a simulated search, see "
                             "docs/BENCHMARKS.md, Method), proportional (to weight bytes), traffic (share of routed "
                             "tokens x layers with floors), or fixed fractions of the pool per "
                             "member, e.g. tiny-s=0.2,tiny-m=0.3,tiny-l=0.5 (no pilot, no search)")
    parser.add_argument("--split-candidates", type=int, default=SPLIT_CANDIDATES, metavar="N",
                        help="--baseline-split search: how many of the search's best splits the simulated pilot "
                             "re-scores beside the operator's default")
    parser.add_argument("--split-pilot-sessions", type=int, default=SPLIT_PILOT_SESSIONS, metavar="N",
                        help="--baseline-split search: the pilot replays the run's first N sessions (simulated)")
    parser.add_argument("--baseline-host-tier", action="store_true",
                        help="give baseline_legacy's deployments the same host KV tier as MFS (the fair baselines "
                             "always have it; by default baseline_legacy has none, as TensorRT-LLM servers run)")
    parser.add_argument("--slo-ttft-s", type=float, default=None, help="absolute p90 TTFT limit (with --slo-tpot-s)")
    parser.add_argument("--slo-tpot-s", type=float, default=None, help="absolute p90 TPOT limit (with --slo-ttft-s)")
    parser.add_argument("--sessions", type=int, default=None)
    parser.add_argument("--kv-pages", type=int, default=None, help="arena pages, the same for every system")
    parser.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS), help=f"comma list of {', '.join(SYSTEMS)}")
    parser.add_argument("--attribution", action="store_true",
                        help=f"also run MFS with one mechanism off at a time ({', '.join(ATTRIBUTION_SYSTEMS)}): "
                             "the points of reduction each loses is what that mechanism is worth")
    parser.add_argument("--out", default="results.json")
    parser.add_argument("--quick", action="store_true",
                        help="small trace, 3-rate curve: under 4 minutes on a quiet 2-core CPU")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seeds", default=None, metavar="S1,S2,...|A-B",
                        help="run every trace seed (and --repeats) as its own run beside OUT, then write the means "
                             "and 95%% intervals of the curve figures over them to OUT")
    parser.add_argument("--repeats", type=int, default=1, help="with --seeds: runs of each seed (real runs vary)")
    parser.add_argument("--family", default="tiny", help="shipped family name or family directory")
    parser.add_argument("--no-quality", action="store_true", help="skip scoring the reference replies under the serving members")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--trace", default=None, metavar="FILE",
                        help="replay a trace saved with --save-trace (no ShareGPT package needed; its workload, "
                             "sessions, rate and seed come from the file)")
    parser.add_argument("--save-trace", default=None, metavar="FILE", help="write the trace this run replays")
    parser.add_argument("--record-confidences", default=None, metavar="FILE",
                        help="write every reply's per-token top-1 probabilities (the input mfs simulate's escalation uses)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="config override for every system, YAML value (e.g. escalation.threshold=0.15)")


def _split_mode(text: str) -> str:
    try:
        return parse_split_mode(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_overrides(items: list[str], prog: str) -> dict[str, Any]:
    """--set KEY=VALUE items (YAML values) as config overrides; a malformed item exits with one line."""
    extra: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise SystemExit(f"{prog}: --set expects KEY=VALUE, got {item!r}")
        extra[key.strip()] = yaml.safe_load(value)
    return extra


def settings_from_args(args: argparse.Namespace) -> BenchSettings:
    systems = tuple(s.strip() for s in args.systems.split(",") if s.strip())
    if getattr(args, "attribution", False):
        systems = tuple(dict.fromkeys((*systems, "mfs", "baseline", *ATTRIBUTION_SYSTEMS)))
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        raise SystemExit(f"mfs bench: unknown system(s) {', '.join(unknown)} (known: {', '.join(SYSTEMS)})")
    trace_file = getattr(args, "trace", None)
    if trace_file and (args.rate is not None or args.sessions is not None):
        raise SystemExit("mfs bench: --trace replays the file's sessions and arrivals; drop --rate/--sessions "
                         "(--rates replays them at other rates)")
    if args.split_candidates < 0 or args.split_pilot_sessions < 1:
        raise SystemExit("mfs bench: --split-candidates must be 0 or more, --split-pilot-sessions 1 or more")
    if (args.slo_ttft_s is None) != (args.slo_tpot_s is None):
        raise SystemExit("mfs bench: give both --slo-ttft-s and --slo-tpot-s, or neither")
    try:
        if args.rates is not None:
            rates = parse_rates(args.rates)
        elif args.rate is not None:
            rates = (args.rate,)
        else:
            rates = QUICK_RATES if args.quick else FULL_RATES
        mix_phases = parse_mix_phases(args.mix_phases)
    except ValueError as exc:
        raise SystemExit(f"mfs bench: {exc}") from None
    base = BenchSettings.quick_defaults() if args.quick else BenchSettings()
    chosen = {k: v for k, v in (("sessions", args.sessions), ("rate", args.rate), ("kv_pages", args.kv_pages))
              if v is not None}
    extra = {**base.extra_overrides, **parse_overrides(args.set, "mfs bench")}
    return replace(base, workload=args.workload, systems=systems, seed=args.seed, family=args.family,
                   score_quality=not args.no_quality, progress=not args.no_progress, extra_overrides=extra,
                   trace_file=trace_file, save_trace=getattr(args, "save_trace", None), rates=rates,
                   history=args.history, lengths=args.lengths, mix_phases=mix_phases,
                   baseline_split=args.baseline_split,
                   split_candidates=args.split_candidates, split_pilot_sessions=args.split_pilot_sessions,
                   baseline_host_tier=args.baseline_host_tier, slo_ttft_x=args.slo_ttft_x,
                   slo_tpot_x=args.slo_tpot_x, slo_ttft_s=args.slo_ttft_s, slo_tpot_s=args.slo_tpot_s,
                   record_confidences=getattr(args, "record_confidences", None), **chosen)


def main(args: argparse.Namespace, split_pilot: SplitPilot | None = None) -> int:
    """The bench's command line (`mfs bench` is eval/commands/bench.py: this with the simulated split pilot)."""
    if args.seeds:
        return main_over_seeds(args, split_pilot)
    return main_one(args, split_pilot)


def main_over_seeds(args: argparse.Namespace, split_pilot: SplitPilot | None = None) -> int:
    """Every trace seed x repeat as its own run (OUT_seedS[_repR].json), then the intervals over them in OUT."""
    try:
        seeds = parse_seeds(args.seeds)
    except ValueError as exc:
        raise SystemExit(f"mfs bench: {exc}") from None
    if args.repeats < 1:
        raise SystemExit("mfs bench: --repeats must be at least 1")
    command = "mfs bench " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["bench"] else None
    files = []
    for seed in seeds:
        for repeat in range(args.repeats):
            path = run_file(args.out, seed, repeat, args.repeats)
            main_one(argparse.Namespace(**{**vars(args), "seed": seed, "out": str(path)}), split_pilot)
            files.append(path)
    write_over_runs(args.out, files, command)
    return 0


def main_one(args: argparse.Namespace, split_pilot: SplitPilot | None = None) -> int:
    settings = settings_from_args(args)
    started = time.monotonic()
    try:
        result = run_bench(settings, split_pilot)
    except (TraceFileError, ConfigError, SplitError) as exc:   # a bad trace file, --set or split: say what, no traceback
        raise SystemExit(f"mfs bench: {exc}") from None
    result["settings"]["command"] = "mfs bench " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["bench"] else None
    result["settings"]["wall_s"] = round(time.monotonic() - started, 1)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(format_table(result))
    for line in split_lines(result):
        print(line)
    for note in result["notes"]:
        print(f"note: {note}")
    print(f"wrote {args.out} ({result['settings']['wall_s']} s)")
    return 0
