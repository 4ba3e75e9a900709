"""Streamlit page: `streamlit run dashboard/app.py -- [--server URL] [--results FILE]` (live server or bench results)."""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

import altair as alt
import pandas as pd
import streamlit as st

if __package__ in (None, ""):  # `streamlit run` executes this file as a script: make `dashboard` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dashboard import data  # noqa: E402

log = logging.getLogger("mfs.dashboard")
MAX_HISTORY_POINTS = 720  # 1 h at the default 5 s refresh
CHART_HEIGHT_PX = 260


def parse_cli(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--server", default=None)
    parser.add_argument("--results", default=None)
    try:
        args, _unknown = parser.parse_known_args(argv)  # foreign args (pytest's, under AppTest) are ignored
    except SystemExit:  # e.g. `--server` without a value: fall back to the environment
        args = argparse.Namespace(server=None, results=None)
    return args


def guarded(render, *args) -> None:
    """Run a view; any failure becomes a one-line message on the page, never a traceback."""
    try:
        render(*args)
    except data.DashboardDataError as exc:
        st.error(str(exc))
    except Exception as exc:  # last resort: the traceback goes to the console log only
        log.exception("dashboard view failed")
        st.error(f"The dashboard could not render this view ({type(exc).__name__}) - {exc}")


# ---------------------------------------------------------------- charts

def axis(y_format: str | None) -> alt.Axis:
    return alt.Axis(format=y_format or "~g")  # "~g": 0.005 rather than 0.005000


TIME_X = alt.X("time:T", title="time", axis=alt.Axis(format="%H:%M:%S"))


def line_chart(df: pd.DataFrame, y: str, color: str, y_title: str, y_format: str | None = None) -> None:
    chart = alt.Chart(df).mark_line(point=True).encode(
        x=TIME_X, y=alt.Y(f"{y}:Q", title=y_title, axis=axis(y_format)),
        color=alt.Color(f"{color}:N", title=None), tooltip=["time:T", f"{color}:N", alt.Tooltip(f"{y}:Q", format=".4g")])
    st.altair_chart(chart.properties(height=CHART_HEIGHT_PX), width="stretch")


def bar_chart(df: pd.DataFrame, x: str, y: str, color: str, y_title: str, y_format: str | None = None,
              stack: bool = False) -> None:
    encoding = dict(x=alt.X(f"{x}:N", title=None), y=alt.Y(f"{y}:Q", title=y_title, axis=axis(y_format)),
                    color=alt.Color(f"{color}:N", title=None), tooltip=[f"{x}:N", f"{color}:N", f"{y}:Q"])
    if not stack:
        encoding["xOffset"] = alt.XOffset(f"{color}:N")
    st.altair_chart(alt.Chart(df).mark_bar().encode(**encoding).properties(height=CHART_HEIGHT_PX), width="stretch")


# ---------------------------------------------------------------- live mode

def render_live(server_url: str, refresh_s: int, include_free: bool) -> None:
    st.title("MFS live")
    if not server_url:
        st.info("No server URL. Pass `--server URL`, set MFS_SERVER_URL, or type one in the sidebar.")
        return
    st.caption(f"Polling {data.normalize_url(server_url)}/metrics and /v1/stats every {refresh_s} s. "
               "Rates and percentiles are over each interval between polls (the first: since server start).")
    st.fragment(live_panel, run_every=refresh_s)(server_url, include_free)


def live_panel(server_url: str, include_free: bool) -> None:
    guarded(poll_and_render, server_url, include_free)


def poll_and_render(server_url: str, include_free: bool) -> None:
    state = st.session_state.setdefault("live", {"url": None, "polls": []})
    if state["url"] != server_url:  # a new server: its counters are not comparable with the old one's
        state.update(url=server_url, polls=[])
    try:
        poll = data.fetch_poll(server_url, now_s=time.time())
    except data.FetchError as exc:
        st.error(f"Server unreachable: {exc}")
        st.info("Start one with `mfs serve`, or check the URL in the sidebar. Retrying at every refresh.")
        if not state["polls"]:
            return
        st.caption("Showing the data collected before the server stopped answering.")
    else:
        state["polls"] = data.append_poll(state["polls"], poll, MAX_HISTORY_POINTS)
        for warning in poll.warnings:
            st.warning(warning)
    render_history(state["polls"], include_free)


def render_history(polls: list[data.Poll], include_free: bool) -> None:
    # one guard per section: a surprise in one chart leaves the others on the page
    for section in (live_overview, live_latency, live_hit_rate, live_kv, live_escalations, live_requests,
                    live_routes):
        guarded(section, polls, include_free)


def live_overview(polls: list[data.Poll], _include_free: bool) -> None:
    latest = polls[-1]
    stats = latest.stats or {}
    requests = data.requests_frame(latest.samples)
    queue = data.queue_frame([latest])
    free = data.sum_by(latest.samples, "mfs_kv_pages", ("state",)).get(("free",))
    cols = st.columns(5)
    cols[0].metric("Family", str(stats.get("family", data.NA)))
    members = [str(m) for m in stats.get("members", [])]
    cols[1].metric("Members", str(len(members)) if members else data.NA, help=", ".join(members) or None)
    cols[2].metric("Queue depth", data.fmt(queue["queue_depth"].iloc[-1], digits=0) if len(queue) else data.NA)
    cols[3].metric("Requests", data.fmt(requests["requests"].sum(), digits=0) if len(requests) else "0")
    cols[4].metric("Free KV pages", data.fmt(free, digits=0))
    st.caption(f"{', '.join(members) or 'members n/a'} · {len(polls)} poll(s) collected; "
               f"last at {pd.Timestamp.fromtimestamp(latest.time_s):%H:%M:%S}.")


def live_latency(polls: list[data.Poll], _include_free: bool) -> None:
    st.header("Latency")
    latency = data.latency_frame(polls)
    if latency.empty:
        st.info("No data yet: latency percentiles appear once the server has finished requests.")
        return
    for col, metric in zip(st.columns(3), data.LATENCY_METRICS):
        with col:
            st.subheader(metric)
            frame = latency[latency["metric"] == metric]
            if frame.empty:
                st.info(f"No {metric} observations yet.")
            else:
                line_chart(frame, "seconds", "quantile", "seconds")


def live_hit_rate(polls: list[data.Poll], _include_free: bool) -> None:
    st.header("Prefix cache hit rate")
    hits = data.hit_rate_frame(polls)
    if hits.empty:
        st.info("No prefix-cache queries yet.")
        return
    for col, by in zip(st.columns(2), ("member", "tier")):
        with col:
            st.subheader(f"per {by}")
            line_chart(hits[hits["by"] == by], "hit_rate", "series", "hit rate", ".0%")


def live_kv(polls: list[data.Poll], include_free: bool) -> None:
    st.header("KV pool")
    kv, queue = data.kv_frame(polls, include_free), data.queue_frame(polls)
    kv = kv[kv.groupby("series")["pages"].transform("max") > 0]  # all-zero series only crowd the legend
    left, right = st.columns([2, 1])
    with left:
        st.subheader("Pages by state and member" + ("" if include_free else " (free pages hidden)"))
        if kv.empty:
            st.info("No KV pages to show yet.")
        else:
            chart = alt.Chart(kv).mark_area().encode(
                x=TIME_X, y=alt.Y("pages:Q", stack="zero", title="pages", axis=axis(None)),
                color=alt.Color("series:N", title=None), tooltip=["time:T", "state:N", "member:N", "pages:Q"])
            st.altair_chart(chart.properties(height=CHART_HEIGHT_PX), width="stretch")
    with right:
        st.subheader("Queue depth")
        if queue.empty:
            st.info("No queue depth gauge yet.")
        else:
            line_chart(queue.assign(series="queue"), "queue_depth", "series", "waiting requests")


def live_escalations(polls: list[data.Poll], _include_free: bool) -> None:
    st.header("Escalations")
    left, right = st.columns([2, 1])
    with left:
        st.subheader("Escalations per minute")
        rate = data.escalation_rate_frame(polls)
        if rate.empty:
            st.info("Escalation rates appear after two polls.")
        else:
            line_chart(rate, "per_min", "pair", "escalations / min")
    with right:
        st.subheader("Totals")
        totals = data.escalation_totals_frame(polls[-1].samples)
        if totals.empty:
            st.info("No escalations yet.")
        else:
            st.dataframe(totals, hide_index=True, width="stretch")


def live_requests(polls: list[data.Poll], _include_free: bool) -> None:
    st.header("Requests per member")
    requests = data.requests_frame(polls[-1].samples)
    if requests.empty:
        st.info("No requests yet.")
    else:
        bar_chart(requests, "member", "requests", "outcome", "requests", stack=True)


def live_routes(polls: list[data.Poll], _include_free: bool) -> None:
    st.header("Recent routing decisions")
    stats = polls[-1].stats
    routes = data.routes_frame(stats)
    if stats is None:
        st.info("No /v1/stats snapshot from this server.")
    elif routes.empty:
        st.info("No routing decisions yet.")
    else:
        st.dataframe(routes, hide_index=True, width="stretch")


# ---------------------------------------------------------------- results mode

def render_results(results_path: str) -> None:
    st.title("MFS vs baseline")
    if not results_path:
        st.info("No results file. Pass `--results FILE` (written by `mfs bench`) or type a path in the sidebar.")
        return
    try:
        results = data.load_results(results_path)
    except data.EmptyResultsError as exc:
        st.info(f"No results to show: {exc}.")
        return
    except data.ResultsError as exc:
        st.error(f"Cannot load the results: {exc}")
        return
    st.caption(f"From {results_path}")
    for note in results.get("notes") or []:
        st.markdown(f"- {note}")
    with st.expander("Workload and settings"):
        st.json({"workload": results.get("workload") or data.NA, "settings": results.get("settings") or data.NA})
    if results["systems"]:
        render_systems(results)
    else:
        st.info("This file holds a sweep only (`python -m eval.bench.sweep`): no per-system results.")
    guarded(render_sweep, results)


def render_systems(results: dict) -> None:
    for section in (results_curve, results_headline, results_latency, results_hit_rates, results_pages):
        guarded(section, results)  # one guard per section: a surprise in one leaves the others


def results_curve(results: dict) -> None:
    """The load curve (mfs bench --rates), when the file has one: it leads the results view."""
    curve = data.curve_frame(results)
    if curve is None:
        return
    st.header("Latency against load")
    summary = data.curve_summary(results)
    cols = st.columns(3)
    cols[0].metric("Knee (baseline at 2x its light-load latency)", summary["knee"])
    cols[1].metric("MFS reduction at the knee", summary["reduction_at_knee"])
    cols[2].metric("SLO", summary["slo"], help=summary["slo_rule"])
    st.caption("Capacity at the SLO: " + (", ".join(f"{n} {c}" for n, c in summary["capacity"].items()) or data.NA))
    frame = curve.dropna(subset=["mean_token_latency_s"]).assign(
        latency_ms=lambda f: f["mean_token_latency_s"] * 1e3)
    order = data.ordered_systems({n: None for n in frame["system"]})
    lines = alt.Chart(frame).mark_line(point=True).encode(
        x=alt.X("rate:Q", title="session arrival rate (sessions/s)", scale=alt.Scale(type="log")),
        y=alt.Y("latency_ms:Q", title="mean e2e / output token (ms)"),
        color=alt.Color("system:N", title=None, sort=order), tooltip=list(frame.columns))
    layers = [lines]
    if summary["knee_rate"] is not None:
        layers.append(alt.Chart(pd.DataFrame({"rate": [summary["knee_rate"]], "mark": ["knee"]}))
                      .mark_rule(color="black", strokeDash=[4, 2]).encode(x="rate:Q", tooltip=["mark:N", "rate:Q"]))
    if summary["capacity_rates"]:
        marks = pd.DataFrame([{"rate": r, "system": n, "mark": f"{n} capacity"} for n, r in summary["capacity_rates"].items()])
        layers.append(alt.Chart(marks).mark_rule(strokeDash=[2, 2]).encode(
            x="rate:Q", color=alt.Color("system:N", sort=order), tooltip=["mark:N", "rate:Q"]))
    st.altair_chart(alt.layer(*layers).properties(height=CHART_HEIGHT_PX), width="stretch")
    table = curve.assign(**{c: curve[c] * 1e3 for c in ("mean_token_latency_s", "decode_floor_token_latency_s",
                                                          "ttft_p90_s", "tpot_p90_s")})
    st.dataframe(table.rename(columns={"mean_token_latency_s": "token latency (ms)",
                                       "decode_floor_token_latency_s": "decode floor (ms)",
                                       "ttft_p90_s": "TTFT p90 (ms)", "tpot_p90_s": "TPOT p90 (ms)"}),
                 hide_index=True, width="stretch")
    st.caption(f"The summary below is the headline rate ({results.get('headline_rate', data.NA)} sessions/s).")


def results_headline(results: dict) -> None:
    head = data.headline(results)
    cols = st.columns(4)
    cols[0].metric("Mean token latency reduction vs baseline", data.fmt(head["reduction"], 100, 1, "%"))
    # the decode floor's ceiling: what MFS's token placement allows at zero scheduling cost
    cols[1].metric("Most its token placement allows", data.fmt(head["ceiling"], 100, 1, "%"),
                   help="1 - MFS's decode floor / the baseline's measured latency (docs/BENCHMARKS.md, Method: Metrics)")
    cols[2].metric(f"MFS mean token latency ({head['mfs'] or data.NA})", data.fmt(head["mfs_mean_s"], 1e3, 2, " ms"))
    cols[3].metric(f"Baseline mean token latency ({head['baseline'] or data.NA})",
                   data.fmt(head["baseline_mean_s"], 1e3, 2, " ms"))
    st.header("Summary")
    st.dataframe(data.summary_frame(results), hide_index=True, width="stretch")


def results_latency(results: dict) -> None:
    st.header("Latency")
    per_request = data.per_request_frame(results)
    if per_request.empty:
        st.info("No per-request data in this results file: latency distributions are n/a.")
        return
    for col, (column, title) in zip(st.columns(2), (("ttft_s", "TTFT (s)"), ("e2e_s", "e2e latency (s)"))):
        with col:
            st.subheader(title)
            frame = per_request.dropna(subset=[column])
            if frame.empty:
                st.info(f"{title}: n/a")
                continue
            chart = alt.Chart(frame).mark_boxplot(extent="min-max").encode(
                x=alt.X("system:N", title=None, sort=data.ordered_systems(results["systems"])),
                y=alt.Y(f"{column}:Q", title=title), color=alt.Color("system:N", legend=None))
            st.altair_chart(chart.properties(height=CHART_HEIGHT_PX), width="stretch")


def results_hit_rates(results: dict) -> None:
    st.header("Prefix cache hit rate")
    for col, (key, by) in zip(st.columns(2), (("prefix_hit_rate_by_tier", "tier"),
                                              ("prefix_hit_rate_by_member", "member"))):
        with col:
            st.subheader(f"per {by}")
            rates = data.hit_rates_frame(results, key)
            if rates.empty:
                st.info(f"Hit rate per {by}: n/a")
            else:
                bar_chart(rates, "name", "hit_rate", "system", "hit rate", ".0%")


def results_pages(results: dict) -> None:
    st.header("KV pool")
    timeline = data.pages_timeline_frame(results)
    if timeline.empty:
        st.info("No pages timeline in this results file.")
        return
    systems = list(dict.fromkeys(timeline["system"]))
    for i in range(0, len(systems), 2):
        for col, name in zip(st.columns(2), systems[i:i + 2]):
            with col:
                st.subheader(name)
                chart = alt.Chart(timeline[timeline["system"] == name]).mark_area().encode(
                    x=alt.X("t_s:Q", title="time (s)"), y=alt.Y("pages:Q", stack="zero", title="pages"),
                    color=alt.Color("state:N", title=None, sort=["used", "cached", "host", "disk"]))
                st.altair_chart(chart.properties(height=CHART_HEIGHT_PX - 40), width="stretch")


def render_sweep(results: dict) -> None:
    st.header("Sweep")
    sweep = data.sweep_frame(results)
    if sweep is None:
        st.info("No sweep in this results file.")
    else:
        chart = alt.Chart(sweep.dropna(subset=["rate", "reduction_mean_token_latency"])).mark_line(point=True).encode(
            x=alt.X("rate:Q", title="request rate (req/s)"),
            y=alt.Y("reduction_mean_token_latency:Q", title="mean token latency reduction", axis=alt.Axis(format=".0%")),
            color=alt.Color("workload:N", title=None), strokeDash=alt.StrokeDash("kv_pages:N", title="KV pages"),
            tooltip=list(sweep.columns))
        st.altair_chart(chart.properties(height=CHART_HEIGHT_PX), width="stretch")
        st.dataframe(sweep, hide_index=True, width="stretch")


# ---------------------------------------------------------------- page

def main() -> None:
    st.set_page_config(page_title="MFS dashboard", layout="wide")
    args = parse_cli(sys.argv[1:])
    server_default = args.server or os.environ.get("MFS_SERVER_URL", "")
    results_default = args.results or os.environ.get("MFS_RESULTS_FILE", "")
    modes = ["Live", "Results"]
    st.sidebar.title("MFS dashboard")
    mode = st.sidebar.radio("Mode", modes, index=1 if results_default and not server_default else 0, key="mode")
    if mode == "Live":
        server_text = st.sidebar.text_input("Server URL(s)", value=server_default, key="server_url",
                                            placeholder="http://127.0.0.1:8000",
                                            help="Several nodes of a fleet: comma-separated; pick one below.")
        nodes = data.split_urls(server_text)
        server_url = nodes[0] if nodes else ""
        if len(nodes) > 1:  # a fleet: /metrics and /v1/stats are per replica, so the charts show one node
            server_url = st.sidebar.selectbox("Node", nodes, key="node")
        refresh_s = st.sidebar.slider("Refresh interval (s)", min_value=1, max_value=60, value=5, key="refresh_s")
        # free pages usually dwarf the rest: hidden by default so used/cached stay readable
        include_free = st.sidebar.checkbox("KV chart: include free pages", value=False, key="include_free")
        if st.sidebar.button("Clear history"):
            st.session_state.pop("live", None)
        guarded(render_live, server_url, refresh_s, include_free)
    else:
        results_path = st.sidebar.text_input("Results file", value=results_default, key="results_path",
                                             placeholder="results.json")
        guarded(render_results, results_path.strip())


main()
