"""A real `mfs serve` whose engine process is killed (os.kill): in-flight streams end with an error event, the log
says what happened, and the server exits with ENGINE_DIED_EXIT so that its supervisor restarts it. An engine
process whose steps fail or hang: its requests get a 503, and /health turns 503 while the failure repeats or the
loop stands still with work."""
from __future__ import annotations

import json
import os
import signal
import sys
import time

import httpx
import pytest

from orchestrator.serve.server import ENGINE_DIED_EXIT
from tests.fakes_serving import free_port, start_process, stop_process, wait_healthy


def test_killing_the_engine_process_fails_streams_and_exits_the_server_non_zero(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "serve.log"
    proc = start_process([sys.executable, "-m", "orchestrator.serve.cli", "serve", "--port", str(port),
                          "--log-level", "warning"], log_path)
    try:
        wait_healthy(url, proc, log_path)
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


# ----------------------------------------------------------------------------- an engine that fails or hangs
def _child_whose_steps(behaviour: str):
    """An engine process (engine_main's) whose every step raises or hangs: a device lost or stuck."""
    def child(config, conn) -> None:
        from orchestrator.serve import engine_process

        engine = engine_process._EngineCore(config, conn)
        real_step, calls = engine.core.step, []
        if behaviour == "forward":                       # the device fails each forward; the step loop is real
            def lost(*args, **kwargs):
                raise RuntimeError("device lost (injected)")
            for model in engine.core.executor.models.values():
                model.forward = lost

        def step():
            calls.append(1)
            if behaviour == "raise" or (behaviour == "raise_once" and len(calls) == 1):
                raise RuntimeError("device lost (injected)")
            if behaviour == "hang":
                time.sleep(3600)
            return real_step()
        engine.core.step = step
        conn.send(("ready", None))
        try:
            engine.run()
        except (EOFError, OSError):
            pass
    return child


def _failing_child(config, conn) -> None:
    _child_whose_steps("raise")(config, conn)


def _once_failing_child(config, conn) -> None:
    _child_whose_steps("raise_once")(config, conn)


def _forward_failing_child(config, conn) -> None:
    _child_whose_steps("forward")(config, conn)


def _hanging_child(config, conn) -> None:
    _child_whose_steps("hang")(config, conn)


def _serving(child_main, **overrides):
    from orchestrator.core.config import load_config
    from orchestrator.serve.engine_process import ProcessServing
    from orchestrator.serve.server import ServerSettings, create_app
    from tests.fakes_serving import family_dir

    config = load_config(None, {"family": str(family_dir()), "pool.num_pages": 256, "pool.host_tier_mb": 0,
                                "engine.device": "cpu", "engine.num_threads": 1, "escalation.enabled": False,
                                **overrides})
    engine = ProcessServing(config, child_main=child_main)
    return engine, create_app(engine, engine.tokenizer, engine.family, ServerSettings(request_timeout_s=60))


def _post(url: str) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json={"model": "tiny-s", "prompt": "The river", "max_tokens": 4},
                      timeout=60)


def test_a_failed_step_fails_its_requests_with_a_503_and_the_engine_serves_on():
    from tests.fakes_serving import serve_in_thread

    _, app = _serving(_once_failing_child)
    with serve_in_thread(app, timeout_s=180) as url:
        response = _post(url)
        assert response.status_code == 503, response.text                  # the server failed it, not the client
        error = response.json()["error"]
        assert error["type"] == "service_unavailable"
        assert "engine step failed: RuntimeError: device lost (injected)" in error["message"]
        assert _post(url).status_code == 200                                # the next step works: so does it
        assert httpx.get(url + "/health").status_code == 200


@pytest.mark.parametrize("child", [_failing_child, _forward_failing_child], ids=["step", "forward"])
def test_steps_that_keep_failing_turn_health_503_and_say_why(child):
    """Also when only the forward fails: the step after each failure, which just ends the failed request, runs
    nothing and so does not count as a good one."""
    from tests.fakes_serving import serve_in_thread

    engine, app = _serving(child)
    with serve_in_thread(app, timeout_s=180) as url:
        assert httpx.get(url + "/health").status_code == 200
        response = _post(url)
        assert response.status_code == 503 and "device lost (injected)" in response.json()["error"]["message"]
        deadline = time.monotonic() + 30
        while httpx.get(url + "/health").status_code == 200 and time.monotonic() < deadline:
            assert _post(url).status_code == 503                              # requests keep coming, and failing
        health = httpx.get(url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "unhealthy"
        assert "engine steps failed in a row; the last: RuntimeError: device lost" in health.json()["reason"]
        assert engine._process.is_alive()                                     # it keeps serving (and failing)
        assert _post(url).status_code == 503


def test_an_engine_that_stops_stepping_with_work_turns_health_503():
    import threading

    from tests.fakes_serving import serve_in_thread

    engine, app = _serving(_hanging_child, **{"engine.stall_timeout_s": 1.0})
    with serve_in_thread(app, timeout_s=180) as url:
        time.sleep(1.5)                       # idle longer than the stall timeout: idle is not stalled
        assert httpx.get(url + "/health").status_code == 200
        answers = []
        request = threading.Thread(target=lambda: answers.append(_post(url)))
        request.start()
        deadline = time.monotonic() + 15
        while httpx.get(url + "/health").status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        health = httpx.get(url + "/health")
        assert health.status_code == 503 and "made no progress" in health.json()["reason"], health.text
        engine._process.kill()                # what a supervisor does next; the request ends with a 503
        request.join(30)
        assert answers and answers[0].status_code == 503
