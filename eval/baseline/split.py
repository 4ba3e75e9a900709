"""The baseline's static split for one `mfs bench` run: the operator's default (proportional to weight
bytes) run for real at the lightest rate as the pilot, then, by default, the simulated search
(eval/baseline/split_search.py) over splits, fed with the pilot's escalations and measured decode steps."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from eval.baseline.split_search import SplitSimulator, search_report, search_split, sim_sessions
from eval.systems import StaticSplit, proportional_split
from eval.bench.workloads import Trace
from orchestrator.core.family import FamilySpec
from orchestrator.core.kv_layout import KVLayout

# (fractions, rate) -> (config, records, metrics): the bench's real replay of the baseline on a split
PilotRunner = Callable[[dict[str, float], float], tuple[Any, list, dict[str, Any]]]

SPLIT_MODES = ("search", "proportional", "traffic")


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
    if set(fractions) != set(family.member_names):
        raise SplitError(f"baseline split {mode!r} names {sorted(fractions)}; the family {family.name} has "
                         f"{list(family.member_names)}")
    return {m: fractions[m] for m in family.member_names}


def split_mode_label(mode: str) -> str:
    """What the JSON's baseline_split_mode says: the mode, or "fixed" for given fractions."""
    return mode if mode in SPLIT_MODES else "fixed"


def runs_pilot(mode: str) -> bool:
    """Whether choose_baseline_split replays the baseline once before the curve (the search's pilot)."""
    return mode == "search"


def pages_rule(layout: KVLayout, family: FamilySpec, config) -> Callable[[str, int], int]:
    """(member, tokens) -> the pages a request holds on that member's server: its own, plus its draft's where each
    server drafts with its own copy of the smallest member (speculating, comparison.private_drafts: the draft's
    tables come from the same slice, one page per draft layer per block)."""
    if not (config.speculation.enabled and config.comparison.private_drafts):
        return layout.pages_for_tokens
    draft = family.members[0]
    draft_block = layout.tokens_per_block(draft.name)

    def pages_for_tokens(member: str, num_tokens: int) -> int:
        own = layout.pages_for_tokens(member, num_tokens)
        return own if member == draft.name else own + -(-num_tokens // draft_block) * draft.num_layers
    return pages_for_tokens


def choose_baseline_split(settings, family: FamilySpec, trace: Trace, rates: tuple[float, ...],
                          split: StaticSplit, estimator, run_pilot: PilotRunner,
                          progress=None) -> tuple[dict[str, float], dict[str, Any]]:
    """The baseline's split and what the JSON says about it: `baseline_proportional` (the operator's default
    split by weight bytes, run for real at the lightest rate: the pilot) and, for `search`, the search
    (eval/baseline/split_search.py: every candidate split scored by a simulated replay of the trace with the pilot's
    escalations and measured step costs). `run_pilot(fractions, rate)` runs the baseline for real on a split
    (the bench's replay) and returns (config, records, metrics without per-request rows)."""

    proportional = proportional_split(family)
    out: dict[str, Any] = {}
    fixed = fixed_split(settings.baseline_split, family)
    if fixed is not None:         # the operator's own split: no pilot, no search
        out["baseline_fixed"] = {"fractions": fixed, "rule": "given with --baseline-split"}
        return fixed, out
    if settings.baseline_split == "traffic":
        return split.fractions, out
    if settings.baseline_split == "proportional":     # no pilot needed: the baseline itself runs on it
        out["baseline_proportional"] = {"fractions": proportional, "rate": rates[0], "metrics": None,
                                        "rule": "each deployment's slice proportional to its member's weight bytes",
                                        "note": "the baseline ran on this split: its figures are the curve's"}
        return proportional, out
    if progress is not None:
        progress.set_postfix_str(f"baseline_proportional @ {rates[0]:g}/s (pilot)")
    config, records, metrics = run_pilot(proportional, rates[0])
    out["baseline_proportional"] = {"fractions": proportional, "rate": rates[0],
                                    "rule": "each deployment's slice proportional to its member's weight bytes",
                                    "metrics": metrics}
    from orchestrator.core.router import Router

    router = Router(family, config.router)
    layout = KVLayout.for_config(family, config)       # the scheduler's own pages rule for the baseline's config
    simulator = SplitSimulator(family.member_names, pages_rule(layout, family, config), settings.kv_pages,
                               metrics["solo_decode_step_s"], {m: layout.tokens_per_block(m) for m in family.member_names},
                               max_running=config.scheduler.max_running_requests,
                               max_batch_tokens=config.scheduler.max_batch_tokens,
                               prefill_chunk_tokens=config.scheduler.prefill_chunk_tokens,
                               reserve_blocks=config.comparison.decode_reserve_blocks)
    route = lambda ids: router.adequate_member(estimator.score(ids))  # noqa: E731 - complexity only, as the baseline
    sessions = {rate: sim_sessions(trace.at_rate(rate), records, route) for rate in rates}
    try:
        search = search_split(simulator, sessions, extra=[proportional, split.fractions])
    except ValueError as exc:      # the search's model holds no candidate feasible: the operator's default stands
        out["baseline_split_search"] = {"error": str(exc), "chosen": "the operator's default (proportional)"}
        out["baseline_proportional"]["note"] = "the baseline ran on this split: the search found none feasible"
        return proportional, out
    out["baseline_split_search"] = search_report(search)
    proportional_score = next((e["score_s"] for e in search["scored"] if e["split"] == proportional), None)
    out["baseline_proportional"]["simulated_score_s"] = proportional_score
    return search["best"], out
