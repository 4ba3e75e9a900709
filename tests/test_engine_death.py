"""A real `mfs serve` whose engine process is killed (os.kill): in-flight streams end with an error event, the log
says what happened, and the server exits with ENGINE_DIED_EXIT so that its supervisor restarts it."""
from __future__ import annotations

import json
import os
import signal
import sys
import time

import httpx

from orchestrator.serve.server import ENGINE_DIED_EXIT
from tests.fakes_serving import free_port, start_process, stop_process


def test_killing_the_engine_process_fails_streams_and_exits_the_server_non_zero(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "serve.log"
    proc = start_process([sys.executable, "-m", "orchestrator.serve.cli", "serve", "--port", str(port),
                          "--log-level", "warning"], log_path)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        assert httpx.get(url + "/health", timeout=2).status_code == 200, log_path.read_text()
        engine_pid = httpx.get(url + "/v1/stats", timeout=10).json()["engine"]["pid"]
        assert engine_pid != proc.pid
        body = {"model": "tiny-l", "prompt": "The river", "max_tokens": 900, "ignore_eos": True, "stream": True}
        events = []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line)
                    if len(events) == 2:
                        os.kill(engine_pid, signal.SIGKILL)      # the engine process dies mid-stream
        assert json.loads(events[-2].removeprefix("data: "))["error"]["type"] == "service_unavailable", events[-3:]
        assert events[-1] == "data: [DONE]"
        assert proc.wait(timeout=60) == ENGINE_DIED_EXIT
        log = log_path.read_text()
        assert f"engine process {engine_pid} exited" in log and "so that its supervisor restarts it" in log
    finally:
        stop_process(proc)
