"""The dashboard in a real headless Chromium: live mode against an MFS server on loopback, and results mode."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.browser

CHROMIUM = Path("/usr/bin/chromium")
REPO = Path(__file__).resolve().parent.parent
ARTIFACTS = REPO / "artifacts"
DOCS_SCREENSHOT = REPO / "docs" / "img" / "dashboard.png"
FIXTURE = REPO / "tests" / "fixtures" / "bench_results_small.json"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync"]
LIVE_HEADINGS = ("MFS live", "Latency", "Prefix cache hit rate", "KV pool", "Escalations", "Requests per member",
                 "Recent routing decisions")
RESULTS_HEADINGS = ("MFS vs baseline", "Summary", "Latency", "Prefix cache hit rate", "KV pool", "Sweep")
PROMPTS = ("You are a helpful assistant. Tell me about the weather in Paris in spring.",
           "Write a haiku about caches.")

if not CHROMIUM.is_file():
    message = "Debian's chromium is missing at /usr/bin/chromium (apt-get install -y chromium; .ci/run does)"
    if os.environ.get("CI"):
        raise RuntimeError(message)     # CI must run the real-browser test, never skip it silently
    pytest.skip(message, allow_module_level=True)
from playwright import sync_api  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


from tests.fakes_serving import family_dir, start_process, stop_process  # noqa: E402



def wait_http(url: str, proc: subprocess.Popen, log_path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"{proc.args[:4]} exited with {proc.returncode}: {log_path.read_text()[-2000:]}")
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    pytest.fail(f"{url} did not answer within {timeout_s} s: {log_path.read_text()[-2000:]}")


@pytest.fixture(scope="module")
def mfs_server() -> Iterator[dict]:
    """The real `mfs serve` when a trained tiny family exists, else the stand-in of test_dashboard_app."""
    ARTIFACTS.mkdir(exist_ok=True)
    family = family_dir()
    if family is None:
        from tests.test_dashboard_app import StandInServer

        stand_in = StandInServer()
        try:
            yield {"url": stand_in.url, "kind": "stand-in (no trained tiny family found)", "model": "tiny"}
        finally:
            stand_in.close()
        return
    port, log_path = free_port(), ARTIFACTS / "dashboard_browser_serve.log"
    proc = start_process([sys.executable, "-m", "orchestrator.serve.cli", "serve", "--family", str(family), "--port", str(port),
                  "--log-level", "warning"], log_path)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http(f"{url}/metrics", proc, log_path, timeout_s=180)
        yield {"url": url, "kind": f"real `mfs serve --family {family}`", "model": "tiny"}
    finally:
        stop_process(proc)


def send_requests(server: dict, n: int) -> None:
    for i in range(n):
        messages = [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]
        if i >= len(PROMPTS):  # a second turn that repeats the first: prefix-cache hits
            messages += [{"role": "assistant", "content": "Sure."}, {"role": "user", "content": "Tell me more."}]
        resp = httpx.post(f"{server['url']}/v1/chat/completions", timeout=60.0,
                          json={"model": server["model"], "messages": messages, "max_tokens": 8})
        assert resp.status_code == 200, resp.text


@pytest.fixture
def dashboard():
    """Starts `mfs dashboard ARGS` on a free port; yields a function that returns its URL."""
    procs: list[subprocess.Popen] = []

    def launch(*args: str, name: str) -> str:
        port, log_path = free_port(), ARTIFACTS / f"dashboard_browser_{name}.log"
        proc = start_process([sys.executable, "-m", "orchestrator.serve.cli", "dashboard", "--port", str(port), *args], log_path)
        procs.append(proc)
        wait_http(f"http://127.0.0.1:{port}/_stcore/health", proc, log_path, timeout_s=90)
        return f"http://127.0.0.1:{port}"

    try:
        yield launch
    finally:
        for proc in procs:
            stop_process(proc)


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


def wait_for_charts(page, minimum: int, timeout_s: float = 60.0) -> int:
    """Waits until at least `minimum` Vega charts have drawn (a canvas or svg inside .vega-embed)."""
    deadline = time.monotonic() + timeout_s
    drawn = 0
    while time.monotonic() < deadline:
        drawn = page.locator(".vega-embed canvas, .vega-embed svg.marks").count()
        if drawn >= minimum:
            return drawn
        page.wait_for_timeout(500)
    pytest.fail(f"only {drawn} of {minimum} charts drew within {timeout_s} s")


def check_page(page, headings: tuple[str, ...]) -> None:
    text = page.locator("body").inner_text()
    assert "Traceback" not in text
    assert page.locator("[data-testid='stException']").count() == 0, "Streamlit exception box on the page"
    errors = page.locator("[data-testid='stAlertContentError']")
    assert errors.count() == 0, errors.all_inner_texts()
    for heading in headings:
        assert page.get_by_role("heading", name=heading, exact=True).count() >= 1, f"heading {heading!r} missing"


def screenshot(page, path: Path) -> None:
    # Streamlit scrolls inside its main view: grow the viewport to the content so full_page captures it all.
    height_px = page.evaluate("() => Math.max(document.body.scrollHeight, "
                              "document.querySelector('[data-testid=\"stMain\"]')?.scrollHeight || 0)")
    page.set_viewport_size({"width": 1440, "height": min(int(height_px) + 80, 8000)})
    page.wait_for_timeout(1500)  # charts re-lay out to the new size
    page.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 10_000


def test_live_mode_in_chromium(mfs_server, dashboard, browser):
    print(f"server used: {mfs_server['kind']}")
    send_requests(mfs_server, 4)
    url = dashboard("--server", mfs_server["url"], name="live")
    page = browser.new_page(viewport={"width": 1440, "height": 900})
    try:
        page.goto(url, wait_until="networkidle", timeout=60_000)
        page.get_by_text("MFS live", exact=True).first.wait_for(timeout=60_000)
        wait_for_charts(page, minimum=5)
        send_requests(mfs_server, 4)
        page.get_by_text("2 poll(s) collected", exact=False).first.wait_for(timeout=30_000)  # 5 s refresh
        wait_for_charts(page, minimum=5)
        check_page(page, LIVE_HEADINGS)
        shot = ARTIFACTS / "dashboard_live.png"
        screenshot(page, shot)
        check_page(page, LIVE_HEADINGS)
        (ARTIFACTS / "dashboard_browser_server.txt").write_text(mfs_server["kind"] + "\n")
        if not DOCS_SCREENSHOT.exists() or os.environ.get("MFS_UPDATE_SCREENSHOT") == "1":
            DOCS_SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(shot, DOCS_SCREENSHOT)
    finally:
        page.close()


def test_results_mode_in_chromium(dashboard, browser):
    ARTIFACTS.mkdir(exist_ok=True)
    url = dashboard("--results", str(FIXTURE), name="results")
    page = browser.new_page(viewport={"width": 1440, "height": 900})
    try:
        page.goto(url, wait_until="networkidle", timeout=60_000)
        page.get_by_text("MFS vs baseline", exact=True).first.wait_for(timeout=60_000)
        wait_for_charts(page, minimum=6)
        check_page(page, RESULTS_HEADINGS)
        assert "37.5%" in page.locator("[data-testid='stMetricValue']").all_inner_texts()
        screenshot(page, ARTIFACTS / "dashboard_results.png")
    finally:
        page.close()
