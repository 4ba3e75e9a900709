"""`mfs bench`: replays one seeded ShareGPT trace in real time through MFS, the baseline and ablations."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from eval.metrics_calc import (RequestRecord, counter_delta, decode_floor_token_latency, mean, pages_timeline,
                               paired_token_latency, percentile, reduction, summarize)
from eval.systems import DEFAULT_SYSTEMS, SYSTEMS, RoutedRequest, StaticSplit, best_static_split, needs_split, system_config
from eval.workloads import WORKLOADS, Trace, TraceFileError, WorkloadSpec, build_trace, load_trace, save_trace
from orchestrator.core.config import ConfigError, config_to_dict, load_config
from orchestrator.core.family import FamilySpec, load_family
from orchestrator.serve.tokenizer import FamilyTokenizer
from orchestrator.core.types import FinishReason, Request, RequestId, SamplingParams

STATS_INTERVAL_S = 0.5
PROBE_TOKENS = 48          # decode steps timed per member before and after the replay (the decode floor's step costs)
# Defaults: the case MFS targets - multi-turn chat under a KV budget that is tight for separate
# deployments. 768 pages x 16 KiB = 12 MiB of fp32 KV: one 1024-token conversation on tiny-l alone
# needs 8 layers x 64 blocks = 512 pages, so a static split cannot hold many live sessions.
FULL = dict(sessions=24, rate=0.5, kv_pages=768, max_turns=4, max_prompt_tokens=1024, max_output_tokens=128,
            think_s=2.0)
QUICK = dict(sessions=10, rate=1.0, kv_pages=512, max_turns=3, max_prompt_tokens=512, max_output_tokens=64,
             think_s=1.5)


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

    @classmethod
    def quick_defaults(cls, **kwargs: Any) -> "BenchSettings":
        q = QUICK
        base = cls(sessions=q["sessions"], rate=q["rate"], kv_pages=q["kv_pages"], quick=True,
                   max_turns=q["max_turns"], max_prompt_tokens=q["max_prompt_tokens"],
                   max_output_tokens=q["max_output_tokens"], think_s=q["think_s"])
        return replace(base, **kwargs)


# ----------------------------------------------------------------------------- setup
def family_tokenizer(family: FamilySpec) -> FamilyTokenizer:
    return FamilyTokenizer(family.members[0].checkpoint_dir)


def make_trace(settings: BenchSettings, tokenizer: FamilyTokenizer, family: FamilySpec) -> Trace:
    context = min(m.context_tokens for m in family.members)
    spec = WorkloadSpec(name=settings.workload, num_sessions=settings.sessions, rate_sessions_per_s=settings.rate,
                        seed=settings.seed, context_tokens=context,
                        max_prompt_tokens=min(settings.max_prompt_tokens, context),
                        max_output_tokens=settings.max_output_tokens, max_turns=settings.max_turns,
                        mean_think_time_s=settings.think_s)
    return build_trace(spec, tokenizer)


def complexity_estimator(tokenizer: FamilyTokenizer):
    from orchestrator.core.complexity import estimator_for_vocab   # the very estimator the scheduler routes with

    return estimator_for_vocab(tokenizer.vocab_texts())


def static_split_for(trace: Trace, family: FamilySpec, tokenizer: FamilyTokenizer, settings: BenchSettings) -> StaticSplit:
    estimator = complexity_estimator(tokenizer)
    requests = [RoutedRequest(estimator.score(t.prompt_token_ids), len(t.prompt_token_ids) + t.max_tokens)
                for s in trace.sessions for t in s.turns]
    config = load_config(overrides={"family": settings.family, "pool.num_pages": settings.kv_pages,
                                    **settings.extra_overrides})
    return best_static_split(family, requests, config, settings.kv_pages)


# ----------------------------------------------------------------------------- the real-time driver
async def replay(engine: Any, trace: Trace, tag: str, on_done=None) -> tuple[list[RequestRecord], list[dict], dict, float]:
    """Sessions start at their arrival times; each turn goes out when the previous one finished plus its
    think time. Returns (records, stats samples, counters delta over the replay, duration)."""
    before = engine.stats().get("counters", {})
    start = time.monotonic()
    clock = lambda: time.monotonic() - start  # noqa: E731 - seconds since the replay start
    samples: list[dict] = []
    records: list[RequestRecord] = []

    async def sample_stats() -> None:
        while True:
            stats = engine.stats()
            samples.append({"t_s": clock(), "stats": {"pages": stats.get("pages", {})}})
            await asyncio.sleep(STATS_INTERVAL_S)

    async def run_session(index: int) -> None:
        session = trace.sessions[index]
        await asyncio.sleep(max(0.0, trace.arrival_times_s[index] - clock()))
        for k, turn in enumerate(session.turns):
            if k:
                await asyncio.sleep(turn.think_time_s)
            record = RequestRecord(session_id=session.session_id, turn_index=k, send_s=clock(),
                                   first_token_s=None, finish_s=None, prompt_tokens=len(turn.prompt_token_ids),
                                   cached_tokens=0, output_tokens=0, prompt_token_ids=list(turn.prompt_token_ids))
            records.append(record)
            # Greedy and ignore_eos: every system generates exactly the trace's reply lengths.
            request = Request(request_id=RequestId(f"{tag}-{session.session_id}-t{k}"),
                              prompt_token_ids=list(turn.prompt_token_ids),
                              sampling=SamplingParams(max_tokens=turn.max_tokens, temperature=0.0, ignore_eos=True),
                              arrival_s=time.monotonic(), session_id=session.session_id)
            await run_request(engine, request, record, clock)
            if on_done is not None:
                on_done(record)

    sampler = asyncio.create_task(sample_stats())
    try:
        await asyncio.gather(*(run_session(i) for i in range(len(trace.sessions))))
    finally:
        sampler.cancel()
    duration = clock()
    counters = counter_delta(engine.stats().get("counters", {}), before)
    return records, samples, counters, duration


async def run_request(engine: Any, request: Request, record: RequestRecord, clock) -> None:
    try:
        async for out in engine.generate(request):
            now = clock()
            if out.new_token_ids:
                if record.first_token_s is None:
                    record.first_token_s = now
                record.output_token_ids.extend(out.new_token_ids)
            record.cached_tokens = max(record.cached_tokens, out.num_cached_prompt_tokens or 0)
            if out.num_prompt_tokens:
                record.prompt_tokens = out.num_prompt_tokens
            if out.spans:
                record.members = [span.member for span in out.spans if span.num_tokens > 0] or [out.member]
                record.tokens_by_member = {}
                for span in out.spans:
                    if span.num_tokens > 0:
                        record.tokens_by_member[span.member] = record.tokens_by_member.get(span.member, 0) + span.num_tokens
            elif out.member and (not record.members or record.members[-1] != out.member):
                record.members.append(out.member)
            if out.error:
                record.error = out.error
            if out.finished:
                record.finish_s = now
                if out.finish_reason in (FinishReason.ERROR, FinishReason.CANCELLED) and record.error is None:
                    record.error = out.finish_reason.value
    except Exception as exc:  # a rejected or failed request is recorded, the replay goes on
        record.error = f"{type(exc).__name__}: {exc}"
    record.output_tokens = len(record.output_token_ids)


def pinned_request(request_id: str, member: str, max_tokens: int) -> Request:
    """A short greedy request that runs on `member` only (warm-up and decode probes)."""
    return Request(request_id=RequestId(request_id), prompt_token_ids=[1, 7, 8, 9],
                   sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                   arrival_s=time.monotonic(), pinned_member=member)


async def warm_up(engine: Any, members: list[str], tag: str) -> None:
    """One short pinned request per member so first-call allocations stay out of the measurement."""
    for member in members:
        async for _ in engine.generate(pinned_request(f"{tag}-warmup-{member}", member, 2)):
            pass


async def probe_decode_step_s(engine: Any, members: list[str], tag: str, tokens: int = PROBE_TOKENS) -> dict[str, float]:
    """Per member: the median time between streamed tokens of one pinned request running alone (a decode
    step at batch one and short context, through the whole serving stack). The decode floor builds on it."""
    out: dict[str, float] = {}
    for member in members:
        gaps: list[float] = []
        last = None
        async for result in engine.generate(pinned_request(f"{tag}-probe-{member}", member, tokens)):
            now = time.monotonic()
            if result.new_token_ids:
                if last is not None:       # the first token comes from the prefill step: not a decode step
                    gaps.append((now - last) / len(result.new_token_ids))
                last = now
        if gaps:
            out[member] = percentile(gaps, 50)
    return out


async def run_system(name: str, config: Any, trace: Trace, on_done=None,
                     instrument=None) -> tuple[list[RequestRecord], dict]:
    """instrument(engine), when given, is called right before the replay (profilers); if it returns a
    callable, that is called right after the replay, before anything else runs on the engine."""
    from orchestrator.serve.serving import LocalServing

    engine = LocalServing(config)
    await engine.start()
    try:
        members = list(engine.family.member_names)
        await warm_up(engine, members, name)
        before = await probe_decode_step_s(engine, members, f"{name}-before")
        detach = instrument(engine) if instrument is not None else None
        records, samples, counters, duration = await replay(engine, trace, name, on_done)
        if callable(detach):
            detach()
        # probed again after the replay, the faster of the two kept: one probe can catch a slow moment
        # (clocks, a neighbour), and the floor must stay a lower bound
        after = await probe_decode_step_s(engine, members, f"{name}-after")
    finally:
        await engine.stop()
    step_s = {m: min(v for v in (before.get(m), after.get(m)) if v is not None)
              for m in members if m in before or m in after}
    metrics = summarize(records, counters, duration, pages_timeline(samples))
    metrics["solo_decode_step_s"] = step_s
    metrics["solo_decode_probes_s"] = {"before": before, "after": after}
    metrics["decode_floor_token_latency_s"] = decode_floor_token_latency(records, step_s)
    metrics["counters"] = counters
    return records, metrics


# ----------------------------------------------------------------------------- quality
def score_quality(family: FamilySpec, records_by_system: dict[str, list[RequestRecord]], dtype: str) -> dict[str, float | None]:
    """Mean per-token log-likelihood of each response under the largest member (higher is better)."""
    from engines.local.checkpoint import load_checkpoint
    from engines.local.model import PagedCausalLM
    from engines.local.scoring import score_tokens

    judge = family.members[-1]
    model = PagedCausalLM(judge, load_checkpoint(judge.checkpoint_dir, dtype=dtype), dtype=dtype)
    cache: dict[tuple, float] = {}   # systems often produce identical responses: score each once
    out: dict[str, float | None] = {}
    for name, records in records_by_system.items():
        per_request = []
        for r in records:
            if not r.ok:
                continue
            key = (tuple(r.prompt_token_ids), tuple(r.output_token_ids))
            if key not in cache:
                logprobs = score_tokens(model, judge.name, [*r.prompt_token_ids, *r.output_token_ids],
                                        start=len(r.prompt_token_ids))
                cache[key] = sum(logprobs) / len(logprobs)
            per_request.append(cache[key])
        out[name] = mean(per_request)
    return out


# ----------------------------------------------------------------------------- orchestration
def prepare(settings: BenchSettings) -> tuple[FamilySpec, Trace, StaticSplit | None, list[str]]:
    """The family, the trace, the baseline's static split (when a system needs it) and their notes."""
    family = load_family(settings.family)
    tokenizer = family_tokenizer(family)
    tokenizer_hash = family.members[0].tokenizer_hash
    if settings.trace_file:
        trace = load_trace(settings.trace_file, tokenizer_hash)
    else:
        trace = make_trace(settings, tokenizer, family)
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


def config_for(name: str, settings: BenchSettings, split: StaticSplit | None):
    return system_config(name, settings.family, settings.kv_pages, split.fractions if split else None,
                         settings.extra_overrides)


def run_bench(settings: BenchSettings) -> dict[str, Any]:
    family, trace, split, notes = prepare(settings)
    records_by_system: dict[str, list[RequestRecord]] = {}
    systems: dict[str, Any] = {}
    configs: dict[str, Any] = {}
    progress = _progress(settings, trace)
    try:
        for name in settings.systems:
            config = config_for(name, settings, split)
            configs[name] = config_to_dict(config)
            if progress is not None:
                progress.set_postfix_str(name)
            on_done = (lambda _r: progress.update(1)) if progress is not None else None
            records, metrics = asyncio.run(run_system(name, config, trace, on_done))
            records_by_system[name], systems[name] = records, metrics
    finally:
        if progress is not None:
            progress.close()
    dtype = next(iter(configs.values()))["engine"]["dtype"] if configs else "float32"
    _add_quality(settings, family, records_by_system, systems, notes, dtype)
    result = {
        "workload": trace.summary(),
        "settings": {**_settings_dict(settings), "static_split": split.fractions if split else None,
                     "static_split_traffic_share": split.traffic_share if split else None,
                     "static_split_requests_by_member": split.requests_by_member if split else None,
                     "configs": configs, "machine": _machine()},
        "systems": systems,
        "reduction_mean_token_latency": _reduction(systems, "mfs"),
        "reductions_vs_baseline": {n: _reduction(systems, n) for n in systems if n != "baseline"},
        "paired_vs_baseline": _paired(records_by_system),
        "reduction_ceiling": _ceilings(systems),
        "notes": notes,
    }
    return result


def _add_quality(settings, family, records_by_system, systems, notes, dtype: str) -> None:
    for metrics in systems.values():
        metrics["quality_mean_logprob"] = None
    if not settings.score_quality:
        notes.append("quality scoring skipped (--no-quality)")
        return
    try:
        quality = score_quality(family, records_by_system, dtype)
    except ImportError as exc:
        notes.append(f"quality_mean_logprob skipped: engines.local.scoring unavailable ({exc})")
        return
    for name, value in quality.items():
        systems[name]["quality_mean_logprob"] = value
    notes.append(f"quality_mean_logprob: mean per-token log-likelihood of each response under {family.members[-1].name}")


def _reduction(systems: dict[str, Any], name: str) -> float | None:
    if name not in systems or "baseline" not in systems:
        return None
    return reduction(systems[name]["mean_token_latency_s"], systems["baseline"]["mean_token_latency_s"])


def _ceilings(systems: dict[str, Any]) -> dict[str, float | None]:
    """Per system: the largest reduction against the baseline's measured latency that its token placement
    allows (1 - its decode floor / the baseline's mean token latency)."""
    if "baseline" not in systems:
        return {}
    base = systems["baseline"]["mean_token_latency_s"]
    return {n: reduction(m.get("decode_floor_token_latency_s"), base) for n, m in systems.items() if n != "baseline"}


def _paired(records_by_system: dict[str, list[RequestRecord]]) -> dict[str, Any]:
    """Per system: mean token latency of it and the baseline over the requests both served, and the reduction."""
    baseline = records_by_system.get("baseline")
    if baseline is None:
        return {}
    out = {}
    for name, records in records_by_system.items():
        if name == "baseline":
            continue
        ours, theirs, count = paired_token_latency(records, baseline)
        out[name] = {"num_requests": count, "mean_token_latency_s": ours, "baseline_mean_token_latency_s": theirs,
                     "reduction_mean_token_latency": reduction(ours, theirs)}
    return out


def _settings_dict(settings: BenchSettings) -> dict[str, Any]:
    d = asdict(settings)
    d["systems"] = list(settings.systems)
    d["sampling"] = {"temperature": 0.0, "ignore_eos": True, "max_tokens": "the turn's real reply length (capped)"}
    return d


def _machine() -> dict[str, Any]:
    import torch

    return {"python": platform.python_version(), "torch": torch.__version__, "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "cuda": torch.cuda.is_available()}


def _progress(settings: BenchSettings, trace: Trace):
    if not settings.progress:
        return None
    from tqdm import tqdm

    return tqdm(total=trace.num_requests * len(settings.systems), unit="req", desc="bench", file=sys.stderr)


# ----------------------------------------------------------------------------- table and CLI
TABLE_COLUMNS = (("mean_token_latency_s", "tok-lat ms", 1e3), ("ttft_p50_s", "ttft50 ms", 1e3),
                 ("ttft_p99_s", "ttft99 ms", 1e3), ("tpot_p50_s", "tpot50 ms", 1e3), ("tpot_p99_s", "tpot99 ms", 1e3),
                 ("e2e_p50_s", "e2e50 s", 1), ("throughput_tok_s", "tok/s", 1), ("prefix_hit_rate", "hit", 1),
                 ("escalation_rate", "esc", 1), ("preemptions", "preempt", 1), ("num_requests", "reqs ok", 1),
                 ("num_failed", "failed", 1), ("quality_mean_logprob", "quality", 1))


def format_table(result: dict[str, Any]) -> str:
    header = f"{'system':<18}" + "".join(f"{label:>11}" for _, label, _ in TABLE_COLUMNS)
    lines = [header, "-" * len(header)]
    for name, m in result["systems"].items():
        cells = []
        for key, _, scale in TABLE_COLUMNS:
            value = m.get(key)
            cells.append(f"{'-':>11}" if value is None else f"{value * scale:>11.3f}" if isinstance(value, float)
                         else f"{value:>11}")
        lines.append(f"{name:<18}" + "".join(cells))
    red = result.get("reduction_mean_token_latency")
    if red is not None:
        lines.append(f"mean token latency reduction, mfs vs baseline: {red * 100:.1f}%")
    floor_line = decode_floor_line(result)
    if floor_line:
        lines.append(floor_line)
    failed = {name: m.get("num_failed") for name, m in result["systems"].items() if m.get("num_failed")}
    if failed:
        lines.append(f"requests refused or failed (left out of the latency figures): {failed}")
        paired = paired_line(result)
        if paired:
            lines.append(paired)
    return "\n".join(lines)


def decode_floor_line(result: dict[str, Any], name: str = "mfs") -> str | None:
    """The decode floors and what they leave for `name`, in words; None when a figure is missing."""
    systems = result["systems"]
    ceiling = (result.get("reduction_ceiling") or {}).get(name)
    floors = {n: systems[n].get("decode_floor_token_latency_s") for n in (name, "baseline") if n in systems}
    if ceiling is None or None in floors.values():
        return None
    return (f"decode floor (each token one solo decode step of its member, no waiting): "
            + ", ".join(f"{n} {v * 1e3:.2f}" for n, v in floors.items())
            + f" ms/token; the most {name}'s token placement allows: a {ceiling * 100:.1f}% reduction")


def paired_line(result: dict[str, Any], name: str = "mfs") -> str | None:
    """`name` against the baseline over the requests both served, in words; None when there is no figure."""
    paired = (result.get("paired_vs_baseline") or {}).get(name)
    if not paired or paired.get("reduction_mean_token_latency") is None:
        return None
    return (f"over the {paired['num_requests']} requests both served: {paired['mean_token_latency_s'] * 1e3:.2f} vs "
            f"{paired['baseline_mean_token_latency_s'] * 1e3:.2f} ms/token, "
            f"reduction {paired['reduction_mean_token_latency'] * 100:.1f}%")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", choices=WORKLOADS, default="multiturn")
    parser.add_argument("--rate", type=float, default=None, help="session arrivals per second (Poisson)")
    parser.add_argument("--sessions", type=int, default=None)
    parser.add_argument("--kv-pages", type=int, default=None, help="arena pages, the same for every system")
    parser.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS), help=f"comma list of {', '.join(SYSTEMS)}")
    parser.add_argument("--out", default="results.json")
    parser.add_argument("--quick", action="store_true", help="small trace: under 4 minutes on 2 CPU cores")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--family", default="tiny", help="shipped family name or family directory")
    parser.add_argument("--no-quality", action="store_true", help="skip scoring responses under the largest member")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--trace", default=None, metavar="FILE",
                        help="replay a trace saved with --save-trace (no ShareGPT package needed; its workload, "
                             "sessions, rate and seed come from the file)")
    parser.add_argument("--save-trace", default=None, metavar="FILE", help="write the trace this run replays")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="config override for every system, YAML value (e.g. escalation.threshold=0.15)")


def settings_from_args(args: argparse.Namespace) -> BenchSettings:
    systems = tuple(s.strip() for s in args.systems.split(",") if s.strip())
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        raise SystemExit(f"mfs bench: unknown system(s) {', '.join(unknown)} (known: {', '.join(SYSTEMS)})")
    trace_file = getattr(args, "trace", None)
    if trace_file and (args.rate is not None or args.sessions is not None):
        raise SystemExit("mfs bench: --trace replays the file's sessions and arrivals; drop --rate/--sessions")
    base = BenchSettings.quick_defaults() if args.quick else BenchSettings()
    chosen = {k: v for k, v in (("sessions", args.sessions), ("rate", args.rate), ("kv_pages", args.kv_pages))
              if v is not None}
    extra = dict(base.extra_overrides)
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"mfs bench: --set expects KEY=VALUE, got {item!r}")
        extra[key.strip()] = yaml.safe_load(value)
    return replace(base, workload=args.workload, systems=systems, seed=args.seed, family=args.family,
                   score_quality=not args.no_quality, progress=not args.no_progress, extra_overrides=extra,
                   trace_file=trace_file, save_trace=getattr(args, "save_trace", None), **chosen)


def main(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    started = time.monotonic()
    try:
        result = run_bench(settings)
    except (TraceFileError, ConfigError) as exc:      # a bad trace file or --set override: say what, no traceback
        raise SystemExit(f"mfs bench: {exc}") from None
    result["settings"]["command"] = "mfs bench " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["bench"] else None
    result["settings"]["wall_s"] = round(time.monotonic() - started, 1)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(format_table(result))
    for note in result["notes"]:
        print(f"note: {note}")
    print(f"wrote {args.out} ({result['settings']['wall_s']} s)")
    return 0
