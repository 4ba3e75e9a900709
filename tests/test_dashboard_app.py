"""Streamlit AppTest of the dashboard: live and results modes, and their empty and error states."""
from __future__ import annotations

import json
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from streamlit.testing.v1 import AppTest  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
APP = REPO / "dashboard" / "app.py"
FIXTURE = REPO / "tests" / "fixtures" / "bench_results_small.json"
MEMBERS = ("tiny-s", "tiny-m", "tiny-l")


class StandInServer:
    """A loopback HTTP server with the MFS /metrics and /v1/stats shapes; POST /v1/chat/completions fakes a request."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        buckets_s = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
        self.ttft = Histogram("mfs_ttft_seconds", "ttft", ["member"], buckets=buckets_s, registry=r)
        self.tpot = Histogram("mfs_tpot_seconds", "tpot", ["member"], buckets=buckets_s, registry=r)
        self.e2e = Histogram("mfs_e2e_seconds", "e2e", ["member"], buckets=buckets_s, registry=r)
        self.hits = Counter("mfs_prefix_cache_hits_total", "hit tokens", ["member", "tier"], registry=r)
        self.queries = Counter("mfs_prefix_cache_queries_total", "query tokens", ["member"], registry=r)
        self.pages = Gauge("mfs_kv_pages", "pages", ["state", "member"], registry=r)
        self.queue = Gauge("mfs_queue_depth", "queue", registry=r)
        self.escalations = Counter("mfs_escalations_total", "escalations", ["from", "to"], registry=r)
        self.requests = Counter("mfs_requests_total", "requests", ["member", "outcome"], registry=r)
        self.pages.labels("free", "all").set(200)
        self.routes: list[dict] = []
        self.count = 0
        self._lock = threading.Lock()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()

    def fake_request(self) -> None:
        """What one finished request leaves in the metrics (deterministic values)."""
        with self._lock:
            i, self.count = self.count, self.count + 1
            member = MEMBERS[i % 2]
            self.ttft.labels(member).observe(0.02 + 0.01 * (i % 3))
            self.tpot.labels(member).observe(0.012)
            self.e2e.labels(member).observe(0.2 + 0.05 * (i % 4))
            self.queries.labels(member).inc(64)
            self.hits.labels(member, "arena").inc(32 if i else 0)
            self.hits.labels(member, "host").inc(16 if i % 2 else 0)
            self.requests.labels(member, "finished").inc()
            if i % 3 == 2:
                self.escalations.labels("tiny-s", "tiny-m").inc()
            self.pages.labels("cached", member).inc(4)
            self.pages.labels("used", member).set(2)
            self.pages.labels("free", "all").dec(4)
            self.routes = (self.routes + [{"request_id": f"req-{i}", "member": member, "reason": "complexity",
                                           "complexity": 0.1 * (i % 5), "scores": {m: 0.5 for m in MEMBERS},
                                           "matched_prefix_tokens": {member: 32}}])[-20:]

    def stats(self) -> dict:
        return {"time_s": 1.0, "family": "tiny", "members": list(MEMBERS), "queue_depth": 0,
                "recent_routes": list(self.routes)}

    def _handler(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                if self.path == "/metrics":
                    self._send(200, generate_latest(server.registry), "text/plain; version=0.0.4")
                elif self.path == "/v1/stats":
                    self._send(200, json.dumps(server.stats()).encode(), "application/json")
                else:
                    self._send(404, b"{}", "application/json")

            def do_POST(self):
                self.rfile.read(int(self.headers.get("content-length") or 0))
                server.fake_request()
                self._send(200, json.dumps({"object": "chat.completion", "choices": []}).encode(), "application/json")

            def _send(self, code: int, body: bytes, content_type: str) -> None:
                self.send_response(code)
                self.send_header("content-type", content_type)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):  # keep test output clean
                pass

        return Handler

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


@pytest.fixture
def stand_in():
    server = StandInServer()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """The app reads argv and the environment: give every test a blank slate."""
    monkeypatch.delenv("MFS_SERVER_URL", raising=False)
    monkeypatch.delenv("MFS_RESULTS_FILE", raising=False)
    monkeypatch.setattr(sys, "argv", ["app.py"])


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_app() -> AppTest:
    at = AppTest.from_file(str(APP), default_timeout=60).run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def texts(elements) -> list[str]:
    return [e.value for e in elements]


# ---------------------------------------------------------------- results mode

def test_results_mode_from_cli_args(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["app.py", "--results", str(FIXTURE)])
    at = run_app()
    assert at.sidebar.radio(key="mode").value == "Results"
    assert "MFS vs baseline" in texts(at.title)
    assert {"Summary", "Latency", "Prefix cache hit rate", "KV pool", "Sweep"} <= set(texts(at.header))
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Mean token latency reduction vs baseline"] == "37.5%"
    assert metrics["Most its token placement allows"] == "52.0%"
    assert metrics["MFS mean token latency (mfs)"] == "11.80 ms"
    assert not at.error and not at.info
    summary = at.dataframe[0].value
    assert list(summary["system"]) == ["mfs", "baseline", "mfs-no-escalation"]


def test_results_mode_missing_optional_keys_read_na(tmp_path, monkeypatch):
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"systems": {"mfs": {"mean_token_latency_s": 0.01}, "baseline": {}}}))
    monkeypatch.setenv("MFS_RESULTS_FILE", str(path))
    at = run_app()
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Mean token latency reduction vs baseline"] == "n/a"
    assert metrics["Most its token placement allows"] == "n/a"     # older results files have no decode floor
    assert any("latency distributions are n/a" in t for t in texts(at.info))
    assert any("No sweep" in t for t in texts(at.info))
    assert not at.error


def test_malformed_results_file_shows_an_error(tmp_path, monkeypatch):
    path = tmp_path / "bad.json"
    path.write_text('{"systems": {"mfs": ')
    monkeypatch.setattr(sys, "argv", ["app.py", "--results", str(path)])
    at = run_app()
    assert any("not valid JSON" in t for t in texts(at.error)), texts(at.error)
    assert "Traceback" not in " ".join(texts(at.error))


def test_wrong_shape_results_file_names_the_field(tmp_path, monkeypatch):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"systems": {"mfs": {"ttft_p50_s": "fast"}}}))
    monkeypatch.setenv("MFS_RESULTS_FILE", str(path))
    at = run_app()
    assert any("systems.mfs.ttft_p50_s must be a number" in t for t in texts(at.error)), texts(at.error)


@pytest.mark.parametrize("content", ["", "{\"systems\": {}}"])
def test_empty_results_file_shows_info(tmp_path, monkeypatch, content):
    path = tmp_path / "empty.json"
    path.write_text(content)
    monkeypatch.setenv("MFS_RESULTS_FILE", str(path))
    at = run_app()
    assert any("No results to show" in t for t in texts(at.info)), texts(at.info)
    assert not at.error


def test_results_path_typed_in_the_sidebar(tmp_path):
    at = run_app()
    at.sidebar.radio(key="mode").set_value("Results").run()
    assert any("No results file" in t for t in texts(at.info))
    at.sidebar.text_input(key="results_path").input(str(tmp_path / "missing.json")).run()
    assert not at.exception
    assert any("results file not found" in t for t in texts(at.error))
    at.sidebar.text_input(key="results_path").input(str(FIXTURE)).run()
    assert not at.exception and not at.error
    assert "MFS vs baseline" in texts(at.title)


# ---------------------------------------------------------------- live mode

def test_live_mode_without_server_url_explains():
    at = run_app()
    assert "MFS live" in texts(at.title)
    assert any("No server URL" in t for t in texts(at.info))


def test_live_mode_unreachable_server(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["app.py", "--server", f"http://127.0.0.1:{closed_port()}"])
    at = run_app()
    assert any(t.startswith("Server unreachable") for t in texts(at.error)), texts(at.error)
    assert "Traceback" not in " ".join(texts(at.error))


def test_live_mode_with_data(stand_in, monkeypatch):
    for _ in range(6):
        stand_in.fake_request()
    monkeypatch.setenv("MFS_SERVER_URL", stand_in.url)
    at = run_app()
    assert not at.error, texts(at.error)
    assert "MFS live" in texts(at.title)
    assert {"Latency", "Prefix cache hit rate", "KV pool", "Escalations", "Requests per member",
            "Recent routing decisions"} <= set(texts(at.header))
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["Family"] == "tiny" and metrics["Requests"] == "6"
    for _ in range(3):
        stand_in.fake_request()
    at.run()  # a second poll: interval percentiles and escalation rates
    assert not at.exception and not at.error
    assert {m.label: m.value for m in at.metric}["Requests"] == "9"
    routes = at.dataframe[-1].value
    assert routes.iloc[0]["request_id"] == "req-8"  # newest first
    assert not any("Escalation rates appear after two polls" in t for t in texts(at.info))


def test_live_mode_before_any_request(stand_in, monkeypatch):
    monkeypatch.setenv("MFS_SERVER_URL", stand_in.url)
    at = run_app()
    assert not at.error
    infos = " ".join(texts(at.info))
    assert "No data yet" in infos and "No routing decisions yet" in infos


def test_results_view_leads_with_the_curve_when_the_file_has_one(monkeypatch):
    curve_file = REPO / "tests" / "fixtures" / "bench_results_curve.json"
    results = json.loads(curve_file.read_text())
    monkeypatch.setattr(sys, "argv", ["app.py", "--results", str(curve_file)])
    at = run_app()
    headers = texts(at.header)
    assert headers[0] == "Latency against load" and "Summary" in headers
    metrics = {m.label: m.value for m in at.metric}
    knee = results["knee_rate"]
    assert metrics["Knee (baseline at 2x its light-load latency)"] == ("n/a" if knee is None else f"{knee:g} sessions/s")
    assert any(t.startswith("Capacity at the SLO: mfs") for t in texts(at.caption))
    assert len(at.dataframe[0].value) == sum(len(p["systems"]) for p in results["curve"])
    assert not at.error
