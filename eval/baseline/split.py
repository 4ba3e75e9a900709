"""The baseline's static split for one run, chosen by the real core: the operator's default (each deployment's
slice proportional to its member's weight bytes) and the split search's shortlist (eval/baseline/split_search.py)
each replay a short pilot of the run's own workload through the simulator (the real core on the run's cost model:
`mfs simulate`'s own; for `mfs bench`, the measured CPU cost model, so no wall time goes to it), at the curve's
lightest rate and one loaded rate. The fastest (mean token latency, averaged over the pilot's rates) of those that
give up no quality the default keeps becomes the baseline's split."""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from eval.baseline.split_search import SplitSimulator, search_split, shortlist_report, sim_sessions
from eval.baseline.static_split import StaticSplit, config_layout, pages_rule, proportional_split
from eval.workloads import Trace
from orchestrator.core.family import FamilySpec

# (fractions, the pilot trace at one rate) -> (config, records, metrics without per-request rows): the baseline on
# that split, simulated; None where no simulator is available (the operator's default then stands)
PilotRunner = Callable[[dict[str, float], Trace], tuple[Any, list, dict[str, Any]]]
# (the run's settings, its family) -> (its PilotRunner, how the pilot is priced), or (None, why no simulator prices
# it): the simulator a command hands the bench (eval/commands/bench.py: eval/simulate/replay.py measured_split_pilot)
SplitPilot = Callable[[Any, FamilySpec], tuple[PilotRunner | None, str]]

SPLIT_MODES = ("search", "proportional", "traffic")
SPLIT_CANDIDATES = 4            # the search's shortlist the core re-scores beside the default
SPLIT_PILOT_SESSIONS = 100      # the pilot: the run's first sessions (all of them in a shorter run)
# What a pilot figure block keeps of a system's metrics (per rate)
PILOT_FIGURES = ("mean_token_latency_s", "ttft_p90_s", "tpot_p90_s", "num_requests", "num_failed", "preemptions",
                 "escalation_rate", "reroutes", "reroutes_up", "reroutes_down", "escalations_refused")
# Eligibility: what a split may not do more often than the operator's default on the same pilot (each sends work
# to a smaller member than routing or escalation chose, or drops it: speed bought with quality)
QUALITY_GUARDS = ("reroutes_down", "escalations_refused", "num_failed")


class SplitError(ValueError):
    """A fixed --baseline-split that is malformed or does not name the family's members."""


def parse_split_mode(text: str) -> str:
    """--baseline-split: a mode, or fixed fractions "member=fraction,..." (checked for form here, against the
    family's members by fixed_split). Raises SplitError with what is wrong."""
    if text in SPLIT_MODES:
        return text
    fixed_fractions(text)
    return text


def fixed_fractions(text: str) -> dict[str, float]:
    """ "a=0.2,b=0.8" -> {"a": 0.2, "b": 0.8}; every fraction in (0, 1], together 1 (to 1e-6)."""
    out: dict[str, float] = {}
    for part in text.split(","):
        name, sep, value = part.partition("=")
        name = name.strip()
        try:
            fraction = float(value)
        except ValueError:
            fraction = None
        if not sep or not name or fraction is None:
            raise SplitError(f"baseline split {text!r}: expected one of {', '.join(SPLIT_MODES)} or "
                             "member=fraction,... (e.g. tiny-s=0.2,tiny-m=0.3,tiny-l=0.5)")
        if not 0.0 < fraction <= 1.0 or name in out:
            raise SplitError(f"baseline split {text!r}: {name}={value} must be a fraction in (0, 1], once per member")
        out[name] = fraction
    if abs(sum(out.values()) - 1.0) > 1e-6:
        raise SplitError(f"baseline split {text!r}: the fractions add up to {sum(out.values()):g}, not 1")
    return out


def fixed_split(mode: str, family: FamilySpec) -> dict[str, float] | None:
    """The fractions of a fixed --baseline-split for `family` (None for a mode); every member named once."""
    if mode in SPLIT_MODES:
        return None
    fractions = fixed_fractions(mode)
    if set(fractions) != set(family.serving_names):
        raise SplitError(f"baseline split {mode!r} names {sorted(fractions)}; the family {family.name} has "
                         f"{list(family.serving_names)} (a deployment each)")
    return {m: fractions[m] for m in family.serving_names}


def split_mode_label(mode: str) -> str:
    """What the JSON's baseline_split_mode says: the mode, or "fixed" for given fractions."""
    return mode if mode in SPLIT_MODES else "fixed"


def pilot_trace(trace: Trace, num_sessions: int) -> Trace:
    """The run's first `num_sessions` sessions, as they arrive in the run (the whole trace when it is shorter)."""
    if len(trace.sessions) <= num_sessions:
        return trace
    return Trace(spec=replace(trace.spec, num_sessions=num_sessions), sessions=trace.sessions[:num_sessions],
                 arrival_times_s=trace.arrival_times_s[:num_sessions], notes=list(trace.notes))


def pilot_rates(rates: Sequence[float]) -> tuple[float, ...]:
    """The curve's lightest rate and one loaded rate (its middle one: past the light end, short of the rates
    where every split only queues); one rate when the curve has one."""
    ordered = sorted(set(rates))
    return tuple(dict.fromkeys((ordered[0], ordered[len(ordered) // 2])))


def pilot_figures(metrics: Mapping[str, Any]) -> dict[str, Any]:
    return {k: metrics.get(k) for k in PILOT_FIGURES}


def choose_baseline_split(settings, family: FamilySpec, trace: Trace, rates: tuple[float, ...],
                          split: StaticSplit, estimator, run_pilot: PilotRunner | None, cost_model: str = "",
                          progress=None) -> tuple[dict[str, float], dict[str, Any]]:
    """The baseline's split and what the JSON says about it. `search` (the default): the operator's default
    (`baseline_proportional`) and the search's shortlist (`baseline_split_search`) re-scored on the simulated pilot
    (`baseline_split_rescore`: every candidate's figures, the default's and the winner's). `run_pilot` simulates
    the baseline on a split (None: no simulator for this run; the default stands). cost_model: how the pilot is
    priced, for the JSON."""
    proportional = proportional_split(family)
    rule = "each deployment's slice proportional to its member's weight bytes"
    out: dict[str, Any] = {}
    fixed = fixed_split(settings.baseline_split, family)
    if fixed is not None:         # the operator's own split: no pilot, no search
        out["baseline_fixed"] = {"fractions": fixed, "rule": "given with --baseline-split"}
        return fixed, out
    if settings.baseline_split == "traffic":
        return split.fractions, out
    out["baseline_proportional"] = {"fractions": proportional, "rule": rule}
    if settings.baseline_split == "proportional":     # no pilot needed: the baseline itself runs on it
        out["baseline_proportional"]["note"] = "the baseline ran on this split: its figures are the curve's"
        return proportional, out
    if run_pilot is None:
        out["baseline_proportional"]["note"] = ("the baseline ran on this split: no simulator prices this family, "
                                                f"so no split was re-scored ({cost_model or 'no cost model'})")
        return proportional, out
    pilot = pilot_trace(trace, settings.split_pilot_sessions)
    at = pilot_rates(rates)

    lightest: list = []            # the default's run at the lightest rate: what the search's shortlist is fed

    def replay(fractions: dict[str, float], label: str) -> dict[float, dict[str, Any]]:
        figures = {}
        for rate in at:
            if progress is not None:
                progress.set_postfix_str(f"baseline split pilot: {label} @ {rate:g}/s (simulated)")
            run = run_pilot(fractions, pilot.at_rate(rate))
            if not lightest:
                lightest.extend(run)
            figures[rate] = pilot_figures(run[2])
        return figures

    default = candidate_entry(proportional, "the operator's default (proportional)", replay(proportional, "default"))
    shortlist, out["baseline_split_search"] = shortlisted(settings, family, pilot, at, split, estimator, *lightest,
                                                          proportional)
    candidates = [candidate_entry(c, f"the search's #{k + 1}", replay(c, f"search #{k + 1}"))
                  for k, c in enumerate(shortlist)]
    winner = rescore(default, candidates)
    out["baseline_split_rescore"] = {
        "pilot": {"sessions": len(pilot.sessions), "rates": list(at), "cost_model": cost_model,
                  "simulated": True},
        "objective": "mean token latency of the baseline on the pilot, averaged over its rates (lower is better)",
        "eligible": (f"a split is eligible when none of {', '.join(QUALITY_GUARDS)} exceeds the default's on the "
                     "pilot (speed bought by sending work to smaller members, or dropping it, is not a split to pick)"),
        "default": default, "candidates": candidates, "winner": winner,
        "chosen": "default" if winner is default else winner["source"]}
    return dict(winner["fractions"]), out


def candidate_entry(fractions: Mapping[str, float], source: str, by_rate: Mapping[float, Mapping[str, Any]]) -> dict:
    latencies = [f["mean_token_latency_s"] for f in by_rate.values()]
    score = sum(latencies) / len(latencies) if latencies and None not in latencies else None
    return {"fractions": dict(fractions), "source": source, "score_s": score,
            "by_rate": {str(rate): dict(f) for rate, f in by_rate.items()}}


def rescore(default: dict[str, Any], candidates: list[dict[str, Any]]) -> dict[str, Any]:
    """Marks each candidate eligible or not (QUALITY_GUARDS against the default, summed over the pilot's rates)
    and returns the winner: the eligible candidate with the lowest score, if it beats the default; else the
    default."""
    def total(entry: Mapping[str, Any], key: str) -> int:
        return sum(int(f.get(key) or 0) for f in entry["by_rate"].values())

    default["eligible"] = True
    best = default
    for entry in candidates:
        worse = [k for k in QUALITY_GUARDS if total(entry, k) > total(default, k)]
        entry["eligible"] = not worse and entry["score_s"] is not None
        if worse:
            entry["ineligible_because"] = {k: total(entry, k) for k in worse}
        if entry["eligible"] and (best["score_s"] is None or entry["score_s"] < best["score_s"]):
            best = entry
    return best


def shortlisted(settings, family: FamilySpec, pilot: Trace, at: tuple[float, ...], split: StaticSplit, estimator,
                config, records: list, metrics: Mapping[str, Any],
                default: dict[str, float]) -> tuple[list[dict[str, float]], dict[str, Any]]:
    """The search's top settings.split_candidates splits (the default left out: it is scored anyway), fed with the
    default's pilot run at the lightest rate (its escalations and solo decode steps)."""
    from orchestrator.core.router import Router

    router = Router(family, config.router)
    layout = config_layout(family, config)             # the blocks of the baseline's config (pages: pages_rule)
    simulator = SplitSimulator(family.serving_names, pages_rule(family, config), config.num_arena_pages(),
                               metrics["solo_decode_step_s"],
                               {m: layout.tokens_per_block(m) for m in family.serving_names},
                               max_running=config.scheduler.max_running_requests,
                               max_batch_tokens=config.scheduler.max_batch_tokens,
                               prefill_chunk_tokens=config.scheduler.prefill_chunk_tokens,
                               reserve_blocks=config.scheduler.decode_reserve_blocks)
    route = lambda ids: router.adequate_member(estimator.score(ids))  # noqa: E731 - complexity only, as the baseline
    sessions = {rate: sim_sessions(pilot.at_rate(rate), records, route) for rate in at}
    try:
        search = search_split(simulator, sessions, extra=[split.fractions])
    except ValueError as exc:      # no candidate lets every request run somewhere: only the default is scored
        return [], {"error": str(exc), "shortlist": []}
    entries = [e for e in search["ranked"] if e["split"] != default][:settings.split_candidates]
    return [e["split"] for e in entries], shortlist_report(search, entries)


def split_lines(result: Mapping[str, Any]) -> list[str]:
    """What the command prints about the baseline's split: the split, and with the re-scoring the default's and
    the winner's pilot figures (SIMULATED)."""
    chosen = result.get("settings", {}).get("baseline_split")
    if not chosen:
        return []
    lines = [f"baseline split ({result['settings'].get('baseline_split_mode')}): "
             + ", ".join(f"{m} {f:.3f}" for m, f in chosen.items())]
    about = result.get("baseline_split_rescore")
    if about:
        pilot = about["pilot"]
        eligible = sum(bool(c.get("eligible")) for c in about["candidates"])
        lines.append(f"  SIMULATED pilot ({pilot['sessions']} sessions at {', '.join(f'{r:g}' for r in pilot['rates'])}"
                     f" sessions/s; {pilot['cost_model']}): the default and {len(about['candidates'])} of the search's "
                     f"splits ({eligible} eligible); chosen: {about['chosen']}")
        for label, entry in (("default", about["default"]), ("chosen ", about["winner"])):
            per_rate = "; ".join(
                f"{rate}/s {f['mean_token_latency_s'] * 1e3:.3f} ms/token, re-routes up {f['reroutes_up']} "
                f"down {f['reroutes_down']}, escalations refused {f['escalations_refused']}"
                for rate, f in entry["by_rate"].items() if f.get("mean_token_latency_s") is not None)
            fractions = ", ".join(f"{m} {f:.3f}" for m, f in entry["fractions"].items())
            lines.append(f"  {label} {fractions}: {per_rate}")
    return lines
