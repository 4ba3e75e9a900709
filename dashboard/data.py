"""Dashboard data layer: fetch and parse /metrics and /v1/stats, derive time series, load bench results."""
from __future__ import annotations

import json
import math
import numbers
from datetime import datetime
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pandas as pd
from prometheus_client.parser import text_string_to_metric_families

LATENCY_METRICS = {"TTFT": "mfs_ttft_seconds", "TPOT": "mfs_tpot_seconds", "E2E": "mfs_e2e_seconds"}
QUANTILES = {"p50": 0.5, "p90": 0.9, "p99": 0.99}
SYSTEM_NUMBER_FIELDS = (
    "mean_token_latency_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "e2e_p50_s",
    "e2e_p99_s", "throughput_tok_s", "prefix_hit_rate", "escalation_rate", "preemptions",
    "num_requests", "quality_reference_logprob",
)
PER_REQUEST_NUMBER_FIELDS = ("turn_index", "prompt_tokens", "cached_tokens", "output_tokens", "ttft_s", "e2e_s")
SWEEP_NUMBER_FIELDS = ("rate", "kv_pages", "reduction_mean_token_latency", "mfs_mean_token_latency_s",
                       "baseline_mean_token_latency_s")
NA = "n/a"


class DashboardDataError(Exception):
    """A problem worth a one-line message on the page (never a traceback)."""


class FetchError(DashboardDataError):
    """The server could not be reached or answered something unusable."""


class ResultsError(DashboardDataError):
    """The results file is missing, not JSON, or not in the `mfs bench` shape."""


class EmptyResultsError(ResultsError):
    """The results file holds no systems (yet)."""


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


@dataclass
class Poll:
    """One poll of a server: its /metrics samples and (when available) its /v1/stats snapshot."""
    time_s: float
    samples: list[Sample]
    stats: dict[str, Any] | None = None
    warnings: list[str] = field(default_factory=list)


# ---------------------------------------------------------------- Prometheus text

def parse_metrics(text: str) -> list[Sample]:
    try:
        families = list(text_string_to_metric_families(text))
    except Exception as exc:  # the parser raises assorted types on foreign text; all mean "not Prometheus"
        raise FetchError(f"/metrics did not return Prometheus text ({exc})") from None
    return [Sample(s.name, dict(s.labels), float(s.value)) for f in families for s in f.samples]


def sum_by(samples: list[Sample], name: str, label_names: tuple[str, ...]) -> dict[tuple[str, ...], float]:
    """Sum a metric's samples grouped by the given labels (other labels are summed away)."""
    out: dict[tuple[str, ...], float] = {}
    for s in samples:
        if s.name == name:
            key = tuple(s.labels.get(label, "") for label in label_names)
            out[key] = out.get(key, 0.0) + s.value
    return out


def counter_deltas(prev: dict, cur: dict) -> dict:
    """Per-key increase between two counter readings; a decrease means the server restarted."""
    if any(cur.get(k, 0.0) < v for k, v in prev.items()):
        return dict(cur)
    return {k: v - prev.get(k, 0.0) for k, v in cur.items()}


def histogram_buckets(samples: list[Sample], name: str) -> list[tuple[float, float]]:
    """Cumulative (upper_bound_s, count) buckets of a histogram, summed over its label sets."""
    summed: dict[float, float] = {}
    for s in samples:
        if s.name == f"{name}_bucket" and "le" in s.labels:
            le = float(s.labels["le"])  # float("+Inf") is inf
            summed[le] = summed.get(le, 0.0) + s.value
    return sorted(summed.items())


def bucket_deltas(prev: list[tuple[float, float]], cur: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Cumulative bucket counts of the observations made between two polls."""
    deltas = counter_deltas(dict(prev), dict(cur))
    return sorted(deltas.items())


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus-style quantile: linear interpolation inside the bucket holding rank q * count.

    Returns None without observations; a rank in the +Inf bucket returns the last finite bound.
    """
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_le, lower_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank and count > lower_count:
            if math.isinf(le):
                return lower_le
            return lower_le + (le - lower_le) * (rank - lower_count) / (count - lower_count)
        lower_le, lower_count = le, count
    return lower_le


# ---------------------------------------------------------------- fetching

def normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    return url if "://" in url else f"http://{url}"


def split_urls(text: str) -> list[str]:
    """Several nodes (fleet replicas) in one field: comma- or space-separated, order kept, duplicates dropped."""
    urls: list[str] = []
    for part in text.replace(",", " ").split():
        if part not in urls:
            urls.append(part)
    return urls


def fetch_poll(server_url: str, now_s: float, timeout_s: float = 3.0) -> Poll:
    """GET /metrics (required) and /v1/stats (optional: its failure becomes a warning)."""
    base = normalize_url(server_url)
    try:
        with httpx.Client(timeout=timeout_s) as client:
            resp = client.get(f"{base}/metrics")
            if resp.status_code != 200:
                raise FetchError(f"{base}/metrics answered HTTP {resp.status_code}")
            samples = parse_metrics(resp.text)
            poll = Poll(now_s, samples)
            try:
                stats_resp = client.get(f"{base}/v1/stats")
                stats_resp.raise_for_status()
                stats = stats_resp.json()
                poll.stats = stats if isinstance(stats, dict) else None
                if poll.stats is None:
                    poll.warnings.append("/v1/stats did not return a JSON object")
            except (httpx.HTTPError, ValueError) as exc:
                poll.warnings.append(f"/v1/stats unavailable ({exc})")
            return poll
    except httpx.HTTPError as exc:
        raise FetchError(f"cannot reach the MFS server at {base} ({type(exc).__name__}: {exc})") from None


def append_poll(history: list[Poll], poll: Poll, max_points: int) -> list[Poll]:
    return (history + [poll])[-max_points:]


# ---------------------------------------------------------------- live series

def _time(time_s: float) -> pd.Timestamp:
    return pd.Timestamp(datetime.fromtimestamp(time_s))  # local wall clock: charts show it as is


def _pairs(history: list[Poll]):
    """(prev_samples, poll) pairs; the first poll is measured against zero, i.e. since server start."""
    for i, poll in enumerate(history):
        yield (history[i - 1].samples if i > 0 else []), poll


def latency_frame(history: list[Poll]) -> pd.DataFrame:
    """TTFT/TPOT/e2e percentiles of the observations made between consecutive polls."""
    rows = []
    for prev, poll in _pairs(history):
        for metric, name in LATENCY_METRICS.items():
            delta = bucket_deltas(histogram_buckets(prev, name), histogram_buckets(poll.samples, name))
            for label, q in QUANTILES.items():
                value = histogram_quantile(q, delta)
                if value is not None:
                    rows.append({"time": _time(poll.time_s), "metric": metric, "quantile": label,
                                 "seconds": value})
    return pd.DataFrame(rows, columns=["time", "metric", "quantile", "seconds"])


def hit_rate_frame(history: list[Poll]) -> pd.DataFrame:
    """Prefix-cache hit rate (hit tokens / query tokens) between polls, per member and per tier."""
    rows = []
    for prev, poll in _pairs(history):
        hits = counter_deltas(sum_by(prev, "mfs_prefix_cache_hits_total", ("member", "tier")),
                              sum_by(poll.samples, "mfs_prefix_cache_hits_total", ("member", "tier")))
        queries = counter_deltas(sum_by(prev, "mfs_prefix_cache_queries_total", ("member",)),
                                 sum_by(poll.samples, "mfs_prefix_cache_queries_total", ("member",)))
        t = _time(poll.time_s)
        for (member,), n in sorted(queries.items()):
            if n > 0:
                hit = sum(v for (m, _tier), v in hits.items() if m == member)
                rows.append({"time": t, "by": "member", "series": member, "hit_rate": hit / n})
        total = sum(queries.values())
        if total > 0:
            for tier in sorted({tier for _m, tier in hits}):
                hit = sum(v for (_m, tr), v in hits.items() if tr == tier)
                rows.append({"time": t, "by": "tier", "series": tier, "hit_rate": hit / total})
    return pd.DataFrame(rows, columns=["time", "by", "series", "hit_rate"])


def kv_frame(history: list[Poll], include_free: bool = True) -> pd.DataFrame:
    """KV pool pages by state and member at each poll (a gauge: no deltas)."""
    rows = []
    for poll in history:
        for (state, member), pages in sorted(sum_by(poll.samples, "mfs_kv_pages", ("state", "member")).items()):
            if state == "free" and not include_free:
                continue
            series = f"{state} / {member}" if member else state
            rows.append({"time": _time(poll.time_s), "state": state, "member": member or "-",
                         "series": series, "pages": pages})
    return pd.DataFrame(rows, columns=["time", "state", "member", "series", "pages"])


def queue_frame(history: list[Poll]) -> pd.DataFrame:
    rows = [{"time": _time(p.time_s), "queue_depth": sum(sum_by(p.samples, "mfs_queue_depth", ()).values())}
            for p in history if any(s.name == "mfs_queue_depth" for s in p.samples)]
    return pd.DataFrame(rows, columns=["time", "queue_depth"])


def escalation_rate_frame(history: list[Poll]) -> pd.DataFrame:
    """Escalations per minute between polls, per from->to member pair."""
    rows = []
    for i in range(1, len(history)):
        prev, poll = history[i - 1], history[i]
        dt_s = poll.time_s - prev.time_s
        if dt_s <= 0:
            continue
        deltas = counter_deltas(sum_by(prev.samples, "mfs_escalations_total", ("from", "to")),
                                sum_by(poll.samples, "mfs_escalations_total", ("from", "to")))
        for (src, dst), n in sorted(deltas.items()):
            rows.append({"time": _time(poll.time_s), "pair": f"{src} → {dst}", "per_min": n * 60.0 / dt_s})
    return pd.DataFrame(rows, columns=["time", "pair", "per_min"])


def escalation_totals_frame(samples: list[Sample]) -> pd.DataFrame:
    rows = [{"from": src, "to": dst, "escalations": int(n)}
            for (src, dst), n in sorted(sum_by(samples, "mfs_escalations_total", ("from", "to")).items())]
    return pd.DataFrame(rows, columns=["from", "to", "escalations"])


def requests_frame(samples: list[Sample]) -> pd.DataFrame:
    rows = [{"member": m, "outcome": o, "requests": int(n)}
            for (m, o), n in sorted(sum_by(samples, "mfs_requests_total", ("member", "outcome")).items())]
    return pd.DataFrame(rows, columns=["member", "outcome", "requests"])


def routes_frame(stats: dict[str, Any] | None) -> pd.DataFrame:
    """The recent routing decisions of a /v1/stats snapshot, newest first, tolerant of missing keys."""
    columns = ["request_id", "member", "reason", "complexity", "matched_prefix_tokens", "scores"]
    routes = (stats or {}).get("recent_routes") or []
    rows = []
    for r in reversed([r for r in routes if isinstance(r, dict)]):
        rows.append({"request_id": str(r.get("request_id", NA)), "member": str(r.get("member", NA)),
                     "reason": str(r.get("reason", NA)), "complexity": fmt(r.get("complexity"), digits=3),
                     "matched_prefix_tokens": _fmt_cell(r.get("matched_prefix_tokens")),
                     "scores": _fmt_cell(r.get("scores"))})
    return pd.DataFrame(rows, columns=columns)


def _fmt_cell(value: Any) -> str:
    """A table cell: numbers to 3 significant digits, {member: number} maps as 'a: 1, b: 0.5'."""
    if isinstance(value, dict):
        return ", ".join(f"{k}: {_fmt_cell(v)}" for k, v in value.items()) or NA
    if _is_number(value):
        return f"{value:.3g}" if math.isfinite(value) else NA
    return NA if value is None else str(value)


# ---------------------------------------------------------------- results (mfs bench JSON)

def _is_number(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)  # numbers.Real also covers numpy scalars


def fmt(value: Any, scale: float = 1.0, digits: int = 2, suffix: str = "") -> str:
    """A number for display, or 'n/a' when missing or not finite."""
    if not _is_number(value) or not math.isfinite(value):
        return NA
    return f"{value * scale:,.{digits}f}{suffix}"


def load_results(path: str | Path) -> dict[str, Any]:
    p = Path(path).expanduser()
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ResultsError(f"results file not found: {p}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ResultsError(f"cannot read results file {p} ({exc})") from None
    if not text.strip():
        raise EmptyResultsError(f"results file {p} is empty")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ResultsError(f"results file {p} is not valid JSON (line {exc.lineno}, column {exc.colno}: "
                           f"{exc.msg})") from None
    return validate_results(obj)


def validate_results(obj: Any) -> dict[str, Any]:
    """Check the `mfs bench` shape; optional keys may be missing (shown as n/a), wrong types may not."""
    if not isinstance(obj, dict):
        raise ResultsError("results must be a JSON object with a 'systems' key")
    if "systems" not in obj and isinstance(obj.get("grid"), list):
        obj = sweep_file_as_results(obj)
        if not obj["sweep"]:
            raise EmptyResultsError("the sweep file holds no grid rows")
    systems = obj.get("systems")
    if systems == {} and obj.get("sweep"):
        pass  # a sweep-only file (python -m eval.bench.sweep): nothing per system to check
    elif systems is None or systems == {}:
        raise EmptyResultsError("results hold no systems (the 'systems' object is missing or empty)")
    problems: list[str] = []
    if not isinstance(systems, dict):
        problems.append("'systems' must be an object of system name -> metrics")
        systems = {}
    for key in ("workload", "settings"):
        if obj.get(key) is not None and not isinstance(obj[key], dict):
            problems.append(f"'{key}' must be an object")
    _check_number(obj, "reduction_mean_token_latency", "", problems)
    if obj.get("notes") is not None and not isinstance(obj["notes"], list):
        problems.append("'notes' must be a list")
    for name, system in systems.items():
        where = f"systems.{name}"
        if not isinstance(system, dict):
            problems.append(f"{where} must be an object")
            continue
        for key in SYSTEM_NUMBER_FIELDS:
            _check_number(system, key, where, problems)
        for key in ("prefix_hit_rate_by_tier", "prefix_hit_rate_by_member"):
            rates = system.get(key)
            if rates is not None and not (isinstance(rates, dict) and all(
                    v is None or _is_number(v) for v in rates.values())):
                problems.append(f"{where}.{key} must map names to numbers (or null)")
        timeline = system.get("pages_timeline")
        if timeline is not None and not (isinstance(timeline, list) and all(
                isinstance(r, list) and len(r) == 5 and all(_is_number(v) for v in r) for r in timeline)):
            problems.append(f"{where}.pages_timeline must be a list of [t_s, used, cached, host, disk]")
        per_request = system.get("per_request")
        if per_request is not None:
            if not isinstance(per_request, list) or not all(isinstance(r, dict) for r in per_request):
                problems.append(f"{where}.per_request must be a list of objects")
            else:
                for i, r in enumerate(per_request):
                    for key in PER_REQUEST_NUMBER_FIELDS:
                        _check_number(r, key, f"{where}.per_request[{i}]", problems)
    _check_curve(obj.get("curve"), problems)
    sweep = obj.get("sweep")
    if sweep is not None:
        if not isinstance(sweep, list) or not all(isinstance(r, dict) for r in sweep):
            problems.append("'sweep' must be a list of objects")
        else:
            for i, r in enumerate(sweep):
                for key in SWEEP_NUMBER_FIELDS:
                    _check_number(r, key, f"sweep[{i}]", problems)
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise ResultsError("results file is not in the `mfs bench` shape: " + "; ".join(problems[:3]) + more)
    return obj


def _check_curve(curve: Any, problems: list[str]) -> None:
    """`curve` (mfs bench --rates): a list of {"rate": number, "systems": {name: metrics}}."""
    if curve is None:
        return
    if not isinstance(curve, list):
        problems.append("'curve' must be a list of {rate, systems}")
        return
    for i, point in enumerate(curve):
        if not isinstance(point, dict) or not _is_number(point.get("rate")) or not isinstance(point.get("systems"), dict):
            problems.append(f"curve[{i}] must be an object with a numeric 'rate' and a 'systems' object")
            continue
        for name, system in point["systems"].items():
            if not isinstance(system, dict):
                problems.append(f"curve[{i}].systems.{name} must be an object")
                continue
            for key in CURVE_NUMBER_FIELDS:
                _check_number(system, key, f"curve[{i}].systems.{name}", problems)


# per system and rate: what the results view plots and tabulates from `curve`
CURVE_NUMBER_FIELDS = ("mean_token_latency_s", "decode_floor_token_latency_s", "ttft_p90_s", "tpot_p90_s",
                       "prefix_hit_rate", "preemptions", "reroutes", "num_failed")


def curve_frame(results: dict[str, Any]) -> pd.DataFrame | None:
    """Long frame, one row per (rate, system) of the load curve; None when the file holds no curve (or one
    rate only)."""
    curve = results.get("curve")
    if not isinstance(curve, list) or len(curve) < 2:
        return None
    rows = [{"rate": p["rate"], "system": name, **{k: m.get(k) for k in CURVE_NUMBER_FIELDS},
             "reduction_vs_baseline": (p.get("reductions_vs_baseline") or {}).get(name)}
            for p in curve for name, m in p["systems"].items()]
    return pd.DataFrame(rows, columns=["rate", "system", *CURVE_NUMBER_FIELDS, "reduction_vs_baseline"])


def curve_summary(results: dict[str, Any]) -> dict[str, Any]:
    """Knee, reduction at the knee, SLO and capacities of a curve file, in display form ('n/a' when absent)."""
    slo = results.get("slo") if isinstance(results.get("slo"), dict) else None
    lower = set(results.get("capacity_at_slo_is_lower_bound") or ())
    capacity = results.get("capacity_at_slo") if isinstance(results.get("capacity_at_slo"), dict) else {}
    return {
        "knee_rate": results.get("knee_rate"),
        "knee": NA if results.get("knee_rate") is None else f"{results['knee_rate']:g} sessions/s",
        "reduction_at_knee": fmt(results.get("reduction_at_knee"), 100, 1, "%"),
        "slo": NA if slo is None else (f"p90 TTFT <= {fmt(slo.get('ttft_p90_s'), 1e3, 0, ' ms')}, "
                                        f"p90 TPOT <= {fmt(slo.get('tpot_p90_s'), 1e3, 1, ' ms')}"),
        "slo_rule": (slo or {}).get("rule", NA),
        "capacity": {name: ("none" if rate is None else f"{'>= ' if name in lower else ''}{rate:g} sessions/s")
                     for name, rate in capacity.items()},
        "capacity_rates": {name: rate for name, rate in capacity.items() if _is_number(rate)},
    }


def sweep_file_as_results(sweep_file: dict[str, Any]) -> dict[str, Any]:
    """A `python -m eval.bench.sweep` file (flat per-system grid rows) as results holding only a sweep."""
    points: dict[tuple, dict[str, Any]] = {}
    for row in sweep_file["grid"]:
        if not isinstance(row, dict):
            raise ResultsError("sweep file 'grid' must be a list of objects")
        point = points.setdefault((str(row.get("workload")), row.get("rate"), row.get("kv_pages")), {
            "workload": row.get("workload"), "rate": row.get("rate"), "kv_pages": row.get("kv_pages")})
        if row.get("system") == "mfs":
            point["reduction_mean_token_latency"] = row.get("reduction_vs_baseline")
            point["mfs_mean_token_latency_s"] = row.get("mean_token_latency_s")
        elif row.get("system") == "baseline":
            point["baseline_mean_token_latency_s"] = row.get("mean_token_latency_s")
    return {"systems": {}, "sweep": list(points.values()), "notes": sweep_file.get("notes"),
            "settings": sweep_file.get("settings")}


def _check_number(obj: dict, key: str, where: str, problems: list[str]) -> None:
    if obj.get(key) is not None and not _is_number(obj[key]):
        problems.append(f"{where + '.' if where else ''}{key} must be a number, got {type(obj[key]).__name__}")


def system_roles(systems: dict[str, Any]) -> tuple[str | None, str | None]:
    """(mfs system, baseline system) by name: exact 'mfs'/'baseline' first, else the shortest containing it."""
    def pick(word: str, exclude: str | None = None) -> str | None:
        names = [n for n in systems if word in n.lower() and n != exclude]
        exact = [n for n in names if n.lower() == word]
        return (exact or sorted(names, key=len) or [None])[0]
    baseline = pick("baseline")
    return pick("mfs", exclude=baseline), baseline


def ordered_systems(systems: dict[str, Any]) -> list[str]:
    mfs, baseline = system_roles(systems)
    head = [n for n in (mfs, baseline) if n]
    return head + [n for n in systems if n not in head]


def headline(results: dict[str, Any]) -> dict[str, Any]:
    systems = results["systems"]
    mfs, baseline = system_roles(systems)
    ceilings = results.get("reduction_ceiling")
    ceiling = ceilings.get(mfs) if isinstance(ceilings, dict) and mfs else None
    return {"reduction": results.get("reduction_mean_token_latency"), "mfs": mfs, "baseline": baseline,
            "ceiling": ceiling if _is_number(ceiling) else None,
            "mfs_mean_s": (systems.get(mfs) or {}).get("mean_token_latency_s"),
            "baseline_mean_s": (systems.get(baseline) or {}).get("mean_token_latency_s")}


def summary_frame(results: dict[str, Any]) -> pd.DataFrame:
    """One display row per system, MFS and baseline first; missing values read 'n/a'."""
    systems = results["systems"]
    mfs, baseline = system_roles(systems)
    reductions = results.get("reductions_vs_baseline")
    reductions = dict(reductions) if isinstance(reductions, dict) else {}
    reductions.setdefault(mfs, results.get("reduction_mean_token_latency"))
    rows = []
    for name in ordered_systems(systems):
        s = systems[name]
        rows.append({
            "system": name, "role": "MFS" if name == mfs else "baseline" if name == baseline else "ablation",
            "mean token latency (ms)": fmt(s.get("mean_token_latency_s"), 1e3),
            "TTFT p50 (ms)": fmt(s.get("ttft_p50_s"), 1e3), "TTFT p99 (ms)": fmt(s.get("ttft_p99_s"), 1e3),
            "TPOT p50 (ms)": fmt(s.get("tpot_p50_s"), 1e3), "TPOT p99 (ms)": fmt(s.get("tpot_p99_s"), 1e3),
            "e2e p50 (s)": fmt(s.get("e2e_p50_s"), digits=3), "e2e p99 (s)": fmt(s.get("e2e_p99_s"), digits=3),
            "throughput (tok/s)": fmt(s.get("throughput_tok_s"), digits=1),
            "prefix hit rate": fmt(s.get("prefix_hit_rate"), 100, 1, "%"),
            "escalation rate": fmt(s.get("escalation_rate"), 100, 1, "%"),
            "preemptions": fmt(s.get("preemptions"), digits=0), "requests": fmt(s.get("num_requests"), digits=0),
            "quality (reference logprob)": fmt(s.get("quality_reference_logprob"), digits=3),
            "reduction vs baseline": fmt(reductions.get(name), 100, 1, "%") if name != baseline else "-",
        })
    return pd.DataFrame(rows)


def per_request_frame(results: dict[str, Any]) -> pd.DataFrame:
    columns = ["system", "member", "escalated", *PER_REQUEST_NUMBER_FIELDS]
    rows = [{"system": name, **{c: r.get(c) for c in columns[1:]}}
            for name in ordered_systems(results["systems"])
            for r in (results["systems"][name].get("per_request") or [])]
    return pd.DataFrame(rows, columns=columns)


def hit_rates_frame(results: dict[str, Any], key: str) -> pd.DataFrame:
    """Long frame (system, name, hit_rate) of prefix_hit_rate_by_tier or prefix_hit_rate_by_member."""
    rows = [{"system": name, "name": k, "hit_rate": v}
            for name in ordered_systems(results["systems"])
            for k, v in (results["systems"][name].get(key) or {}).items() if v is not None]
    return pd.DataFrame(rows, columns=["system", "name", "hit_rate"])


def pages_timeline_frame(results: dict[str, Any]) -> pd.DataFrame:
    rows = [{"system": name, "t_s": r[0], "state": state, "pages": r[i + 1]}
            for name in ordered_systems(results["systems"])
            for r in (results["systems"][name].get("pages_timeline") or [])
            for i, state in enumerate(("used", "cached", "host", "disk"))]
    return pd.DataFrame(rows, columns=["system", "t_s", "state", "pages"])


def sweep_frame(results: dict[str, Any]) -> pd.DataFrame | None:
    sweep = results.get("sweep")
    if not sweep:
        return None
    columns = ["workload", *SWEEP_NUMBER_FIELDS]
    rows = [{**{c: r.get(c) for c in SWEEP_NUMBER_FIELDS}, "workload": str(r.get("workload", NA))} for r in sweep]
    return pd.DataFrame(rows, columns=columns)
