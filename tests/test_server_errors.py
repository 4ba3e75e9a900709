"""Bad input, overload, unavailability and timeouts: OpenAI-style error bodies, and the server stays healthy."""
from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time

import httpx
import pytest

from orchestrator.core.errors import EngineUnavailableError, QueueFullError
from orchestrator.serve import server
from orchestrator.serve.server import ServerSettings, create_app
from tests.fakes_serving import FAKE_TEXT, FakeServingEngine, family_dir, serve_in_thread

FAMILY_DIR = family_dir()
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MSG = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def served(family, tokenizer):
    engine = FakeServingEngine(family.name, family.member_names, tokenizer.encode(FAKE_TEXT))
    app = create_app(engine, tokenizer, family, ServerSettings(max_body_bytes=64 * 1024))
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=10) as http:
        yield engine, http


def assert_error(response: httpx.Response, status: int | tuple[int, ...], param: str | None) -> dict:
    statuses = status if isinstance(status, tuple) else (status,)
    assert response.status_code in statuses, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


def bad_inputs(context_tokens: int):
    big = context_tokens
    return [
        (COMP, {"model": "tiny", "prompt": "x", "max_tokens": "ten"}, "max_tokens"),
        (COMP, {"model": 7, "prompt": "x"}, "model"),
        (COMP, {"model": "tiny"}, "prompt"),
        (COMP, {"model": "tiny", "prompt": ""}, "prompt"),
        (COMP, {"model": "tiny", "prompt": []}, "prompt"),
        (COMP, {"model": "tiny", "prompt": ["a", "b"]}, "prompt"),
        (COMP, {"model": "tiny", "prompt": [1, -4]}, "prompt"),
        (COMP, {"model": "tiny", "prompt": [1] * (big + 5), "max_tokens": 1}, "prompt"),
        (COMP, {"model": "tiny", "prompt": "x", "max_tokens": 0}, "max_tokens"),
        (COMP, {"model": "tiny", "prompt": "x", "max_tokens": big}, "max_tokens"),
        (CHAT, {"model": "tiny", "messages": MSG, "max_completion_tokens": -1}, "max_completion_tokens"),
        (COMP, {"model": "tiny", "prompt": "x", "n": 2}, "n"),
        (COMP, {"model": "tiny", "prompt": "x", "temperature": -0.1}, "temperature"),
        (COMP, {"model": "tiny", "prompt": "x", "temperature": "hot"}, "temperature"),
        (COMP, {"model": "tiny", "prompt": "x", "top_p": 0}, "top_p"),
        (COMP, {"model": "tiny", "prompt": "x", "top_p": 1.5}, "top_p"),
        (COMP, {"model": "tiny", "prompt": "x", "top_k": -3}, "top_k"),
        (COMP, {"model": "tiny", "prompt": "x", "stop": 5}, "stop"),
        (COMP, {"model": "tiny", "prompt": "x", "stop": [""]}, "stop"),
        (COMP, {"model": "tiny", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        (COMP, {"model": "tiny", "prompt": "x", "logprobs": 99}, "logprobs"),
        (COMP, {"model": "tiny", "prompt": "x", "stream": "yes"}, "stream"),
        (COMP, {"model": "tiny", "prompt": "x", "min_tokens": 50, "max_tokens": 5}, "min_tokens"),
        (COMP, {"model": "tiny", "prompt": "x", "mfs_profile": "fast"}, "mfs_profile"),
        (COMP, {"model": "tiny", "prompt": "x", "seed": 1.5}, "seed"),
        (CHAT, {"model": "tiny", "messages": []}, "messages"),
        (CHAT, {"model": "tiny", "messages": "hello"}, "messages"),
        (CHAT, {"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, "messages"),
        (CHAT, {"model": "tiny", "messages": [{"role": "user", "content": 42}]}, "messages"),
        (CHAT, {"model": "tiny", "messages": MSG, "top_logprobs": 3}, "top_logprobs"),
        (CHAT, {"model": "tiny", "messages": MSG, "logprobs": "yes"}, "logprobs"),
        (CHAT, {"model": "tiny", "messages": MSG, "stream": True, "stream_options": {"include_usage": 1}},
         "stream_options"),
        # max_completion_tokens wins, but an invalid max_tokens beside it is still refused (the schema's rule)
        (COMP, {"model": "tiny", "prompt": "x", "max_tokens": 0, "max_completion_tokens": 5}, "max_tokens"),
        (CHAT, {"model": "tiny", "messages": MSG, "max_tokens": "x", "max_completion_tokens": 5}, "max_tokens"),
        # accepted without effect, but of their OpenAI types
        (COMP, {"model": "tiny", "prompt": "x", "store": 0}, "store"),
        (COMP, {"model": "tiny", "prompt": "x", "metadata": [1]}, "metadata"),
        (CHAT, {"model": "tiny", "messages": MSG, "service_tier": 5}, "service_tier"),
        (CHAT, {"model": "tiny", "messages": MSG, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ]


def test_each_bad_input_is_a_400_naming_the_field(served, family):
    engine, http = served
    before = len(engine.requests)
    failures = []
    for path, body, param in bad_inputs(family.context_tokens()):
        response = http.post(path, json=body)
        error = response.json().get("error", {}) if response.headers.get("content-type", "").startswith(
            "application/json") else {}
        if response.status_code not in (400, 422) or error.get("param") != param:
            failures.append((body, response.status_code, response.text[:200]))
    assert not failures, failures
    assert len(engine.requests) == before          # nothing reached the engine
    assert http.get("/health").status_code == 200


def test_unknown_model_is_404(served):
    error = assert_error(served[1].post(CHAT, json={"model": "gpt-9", "messages": MSG}), 404, "model")
    assert error["code"] == "model_not_found"


def test_malformed_json_and_non_object(served):
    http = served[1]
    assert_error(http.post(COMP, content=b"{not json", headers={"content-type": "application/json"}), 400, None)
    assert_error(http.post(COMP, content=b"\xff\xfe", headers={"content-type": "application/json"}), 400, None)
    assert_error(http.post(COMP, json=[1, 2, 3]), 400, None)


def test_body_too_large_is_413(served):
    http = served[1]
    response = http.post(COMP, json={"model": "tiny", "prompt": "x" * (128 * 1024)})
    assert_error(response, 413, None)
    assert http.get("/health").status_code == 200


def test_a_body_longer_than_any_servable_request_is_refused_before_it_is_read(family, tokenizer):
    """The body limit follows the family's context: the longest prompt text it could hold, every character in
    JSON's longest escape, with a full logit_bias, still fits; one byte past the limit is a 413 answered from the
    Content-Length alone, while the body has not been sent."""
    engine = FakeServingEngine(family.name, family.member_names, tokenizer.encode(FAKE_TEXT))
    app = create_app(engine, tokenizer, family, ServerSettings())
    limit = app.state.edge.body_limit_bytes()
    assert limit < ServerSettings().max_body_bytes
    longest = {"model": family.name, "max_tokens": 1, "logit_bias": {str(i): 1 for i in range(1024)},
               "prompt": "\U0001F600" * tokenizer.max_prompt_chars(family.context_tokens())}
    body = json.dumps(longest, ensure_ascii=True, indent=2).encode()
    assert len(body) <= limit
    with serve_in_thread(app) as url:
        with httpx.Client(base_url=url, timeout=30) as http:
            response = http.post(COMP, content=body, headers={"content-type": "application/json"})
            assert response.status_code != 413, response.text
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as conn:
            conn.sendall(f"POST {COMP} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {limit + 1}\r\n\r\n".encode())
            head = conn.recv(65536).decode("latin-1")
        assert head.startswith("HTTP/1.1 413"), head
        assert f"over the limit of {limit}" in head


def test_queue_full_is_429_with_retry_after(served):
    engine, http = served
    engine.fail_with = QueueFullError("queue full", retry_after_s=2.0)
    try:
        for stream in (False, True):
            response = http.post(COMP, json={"model": "tiny", "prompt": "x", "stream": stream})
            error = assert_error(response, 429, None)
            assert error["type"] == "rate_limit_exceeded"
            assert response.headers["retry-after"] == "2"
    finally:
        engine.fail_with = None
    assert http.post(COMP, json={"model": "tiny", "prompt": "x", "max_tokens": 2}).status_code == 200


def test_engine_unavailable_is_503(served):
    engine, http = served
    engine.fail_with = EngineUnavailableError("triton is down")
    try:
        response = http.post(CHAT, json={"model": "tiny", "messages": MSG, "max_tokens": 2})
        assert assert_error(response, 503, None)["type"] == "service_unavailable"
    finally:
        engine.fail_with = None
    assert http.get("/health").status_code == 200


def test_unknown_route_and_method_are_openai_shaped(served):
    http = served[1]
    assert_error(http.get("/v1/nothing"), 404, None)
    assert_error(http.get(COMP), 405, None)


def test_server_timeout_aborts(family, tokenizer):
    # The timeout runs from the request's arrival: 1.5 s leaves a slow machine time to reach the engine (with
    # 0.3 s a CI run once timed out before the first token was asked for, so the engine never saw the request),
    # and 100 tokens at 0.1 s each cannot finish inside it.
    engine = FakeServingEngine(family.name, family.member_names, tokenizer.encode(FAKE_TEXT), token_delay_s=0.1)
    app = create_app(engine, tokenizer, family, ServerSettings(request_timeout_s=1.5))
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=10) as http:
        response = http.post(COMP, json={"model": "tiny", "prompt": "x", "max_tokens": 100})
        assert_error(response, 504, None)
        assert engine.requests[-1].request_id in engine.aborted
        streamed = http.post(COMP, json={"model": "tiny", "prompt": "x", "max_tokens": 100, "stream": True})
        assert streamed.status_code == 200
        assert '"code":"request_timeout"' in streamed.text and streamed.text.rstrip().endswith("data: [DONE]")
        deadline = time.monotonic() + 2
        while engine.requests[-1].request_id not in engine.aborted and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.requests[-1].request_id in engine.aborted
        assert http.get("/health").status_code == 200


def _response_counts(http) -> dict[str, float]:
    """mfs_http_responses_total by code, from /metrics."""
    counts: dict[str, float] = {}
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("mfs_http_responses_total{"):
            code = line.split('code="', 1)[1].split('"', 1)[0]
            counts[code] = counts.get(code, 0.0) + float(line.rsplit(" ", 1)[1])
    return counts


def test_a_client_gone_while_sending_its_body_is_a_quiet_499(family, tokenizer, caplog):
    """starlette raises ClientDisconnect from the body stream: it was an unhandled error (a traceback and a 500
    counted) for every client that left mid-body; it is a 499 like any client gone before its answer."""
    engine = FakeServingEngine(family.name, family.member_names, tokenizer.encode(FAKE_TEXT))
    app = create_app(engine, tokenizer, family, ServerSettings())
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=10) as http:
        host, port = url.removeprefix("http://").split(":")
        with caplog.at_level(logging.ERROR):
            for _ in range(3):
                with socket.create_connection((host, int(port))) as sock:
                    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                 b"Content-Length: 1000\r\n\r\n{\"prompt\": \"x")
                    time.sleep(0.3)                    # the server waits for the rest of the body
            deadline = time.monotonic() + 10
            while _response_counts(http).get("499", 0) < 3 and time.monotonic() < deadline:
                time.sleep(0.05)
            counts = _response_counts(http)
        assert counts.get("499") == 3 and not any(code.startswith("5") for code in counts), counts
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
        assert engine.requests == [] and http.get("/health").status_code == 200


def test_bodies_are_parsed_on_the_edges_few_threads_not_asyncios_default_executor(family, tokenizer, monkeypatch):
    """The tokenizer's native memory is per thread: parse_request runs on ServerSettings.parse_threads threads
    named mfs-parse, however many requests arrive at once (asyncio's default executor grew to cores + 4)."""
    seen: set[tuple[str, int]] = set()
    real = server.parse_request

    def recording(*args, **kwargs):
        thread = threading.current_thread()
        seen.add((thread.name, thread.ident))
        time.sleep(0.02)                               # overlap: a pool that may grow would grow here
        return real(*args, **kwargs)

    monkeypatch.setattr(server, "parse_request", recording)
    engine = FakeServingEngine(family.name, family.member_names, tokenizer.encode(FAKE_TEXT), token_delay_s=0.0)
    app = create_app(engine, tokenizer, family, ServerSettings())
    with serve_in_thread(app) as url:
        async def burst():
            async with httpx.AsyncClient(base_url=url, timeout=30,
                                         limits=httpx.Limits(max_connections=16)) as client:
                return await asyncio.gather(*(client.post(COMP, json={"prompt": f"x {i}", "max_tokens": 2})
                                              for i in range(16)))
        responses = asyncio.run(burst())
    assert all(r.status_code == 200 for r in responses)
    assert len(seen) <= ServerSettings().parse_threads == 2, seen        # a fixed pool, not one that grows
    assert all(name.startswith("mfs-parse") for name, _ in seen), seen
