"""Slow clients: a stream reader that stops taking data is cancelled after stream_stall_s (request aborted, connection
closed) while other requests go on; a body that arrives too slowly gets a 408 and never reaches the engine."""
from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from orchestrator.serve.server import ServerSettings, create_app
from tests.fakes_serving import FAKE_TEXT, FakeServingEngine, serve_in_thread

STALL_S = 0.5
BODY_TIMEOUT_S = 0.5


@pytest.fixture(scope="module")
def served(family, tokenizer):
    engine = FakeServingEngine(family.name, family.member_names, tokenizer.encode(FAKE_TEXT), token_delay_s=0.0005)
    settings = ServerSettings(stream_stall_s=STALL_S, body_timeout_s=BODY_TIMEOUT_S, request_timeout_s=120)
    app = create_app(engine, tokenizer, family, settings)
    with _serve_with_small_send_buffers(app) as url, httpx.Client(base_url=url, timeout=30) as http:
        yield engine, url, http


@contextlib.contextmanager
def _serve_with_small_send_buffers(app):
    """uvicorn on a listening socket with a small fixed SO_SNDBUF (accepted sockets inherit it): on loopback the
    kernel would otherwise buffer megabytes for a peer that reads nothing, more than the whole answer."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
    listener.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    assert _wait_for(lambda: server.started, 15)
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(15)
        listener.close()


def _connect(url: str, receive_buffer: int | None = None) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    if receive_buffer is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.connect((host, int(port)))
    sock.settimeout(30)
    return sock


def _request(path: str, body: bytes, content_length: int | None = None) -> bytes:
    length = len(body) if content_length is None else content_length
    return (f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode() + body


def _wait_for(condition, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def _read_all(sock: socket.socket) -> bytes:
    data = bytearray()
    while chunk := sock.recv(65536):
        data += chunk
    return bytes(data)


def test_a_reader_that_stops_reading_is_cancelled_and_the_engine_goes_on(served, caplog):
    engine, url, http = served
    caplog.set_level(logging.WARNING)
    before = len(engine.requests)
    # a long stream with big chunks (20 alternatives per token): far more than the socket buffers hold
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1000, "ignore_eos": True,
                       "logprobs": True, "top_logprobs": 20, "stream": True}).encode()
    sock = _connect(url, receive_buffer=4096)
    try:
        sock.sendall(_request("/v1/chat/completions", body))
        assert sock.recv(64).startswith(b"HTTP/1.1 200")          # then it reads nothing more
        assert _wait_for(lambda: len(engine.requests) > before)
        stalled = engine.requests[-1].request_id
        # meanwhile another client is served in full
        answer = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 5})
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 5
        assert _wait_for(lambda: stalled in engine.aborted), "the stalled stream was never cancelled"
        rest = _read_all(sock)                                    # the server closed the connection
        assert b"data: [DONE]" not in rest
    finally:
        sock.close()
    # the cut is logged once, as what it is; uvicorn's "returned without completing response" error is not
    messages = [record.getMessage() for record in caplog.records]
    assert any(f"stream {stalled} cancelled" in m for m in messages), messages
    assert not any("without completing response" in m for m in messages), messages
    assert "mfs_stalled_streams_total 1.0" in http.get("/metrics").text
    assert http.get("/health").status_code == 200


def test_a_reader_that_reads_slowly_but_steadily_gets_the_whole_stream(served):
    engine, url, http = served
    body = {"prompt": "x", "max_tokens": 40, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        lines = []
        for line in response.iter_lines():
            lines.append(line)
            time.sleep(STALL_S / 10)                              # slow, never stalled past stream_stall_s
    assert lines[-2:] == ["data: [DONE]", ""] or lines[-1] == "data: [DONE]"


@pytest.mark.parametrize("trickle", [False, True], ids=["stops-sending", "trickles"])
def test_a_body_that_arrives_too_slowly_is_a_408_and_never_reaches_the_engine(served, trickle):
    engine, url, http = served
    before = len(engine.requests)
    body = json.dumps({"prompt": "hello", "max_tokens": 2}).encode()
    sock = _connect(url)
    try:
        sock.sendall(_request("/v1/completions", b"", content_length=len(body)) + body[:5])
        answer = b""
        if trickle:                                               # one byte at a time, slower than the limit
            for byte in body[5:]:
                time.sleep(BODY_TIMEOUT_S / 4)
                try:
                    sock.sendall(bytes([byte]))
                except OSError:
                    break
        answer = _read_all(sock)
    finally:
        sock.close()
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), answer[:200]
    error = json.loads(payload.decode().split("\r\n")[-1] if b"chunked" in head.lower() else payload)["error"]
    assert error["code"] == "request_timeout"
    assert len(engine.requests) == before
    assert http.get("/health").status_code == 200


def test_a_client_that_gives_up_on_a_whole_answer_is_a_499_and_an_abort_not_a_500(family, tokenizer):
    engine = FakeServingEngine(family.name, family.member_names, tokenizer.encode(FAKE_TEXT), token_delay_s=0.01)
    app = create_app(engine, tokenizer, family, ServerSettings(request_timeout_s=120))
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=30) as http:
        with pytest.raises(httpx.ReadTimeout):   # leaves long before the 10 s answer is complete
            httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 1000, "ignore_eos": True},
                       timeout=httpx.Timeout(10, read=0.5))
        assert _wait_for(lambda: 'code="499",route="/v1/completions"' in http.get("/metrics").text)
        assert engine.requests and engine.requests[-1].request_id in engine.aborted
        assert 'code="500"' not in http.get("/metrics").text


HEAD_TIMEOUT_S = 0.5


@pytest.fixture(scope="module", params=["auto", "h11"])
def head_limited(request, family, tokenizer):
    """uvicorn as `mfs serve` runs it (server.server_config): the request head has a deadline and a size bound,
    on the parser uvicorn picks (httptools when installed) and on h11."""
    from orchestrator.serve import client_limits

    engine = FakeServingEngine(family.name, family.member_names, tokenizer.encode(FAKE_TEXT), token_delay_s=0.01)
    settings = ServerSettings(header_timeout_s=HEAD_TIMEOUT_S, max_header_bytes=8192, request_timeout_s=60)
    app = create_app(engine, tokenizer, family, settings)
    with pytest.MonkeyPatch.context() as patch:
        if request.param == "h11":
            from uvicorn.protocols.http.h11_impl import H11Protocol
            patch.setattr(client_limits, "_base_protocol", lambda: H11Protocol)
        with serve_in_thread(app, settings=settings) as url, httpx.Client(base_url=url, timeout=30) as http:
            yield engine, url, http


@pytest.mark.parametrize("trickle", [False, True], ids=["stops-sending", "trickles"])
def test_a_request_head_that_arrives_too_slowly_is_a_408_and_the_connection_closes(head_limited, trickle):
    engine, url, http = head_limited
    before = len(engine.requests)
    sock = _connect(url)
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\n")
        if trickle:                    # a header line now and then (slowloris): each byte must not extend the deadline
            for n in range(40):
                time.sleep(HEAD_TIMEOUT_S / 4)
                try:
                    sock.sendall(f"X-Pad-{n}: a\r\n".encode())
                except OSError:
                    break
        answer = _read_all(sock)       # returns once the server closed the connection
    finally:
        sock.close()
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), answer[:200]
    assert json.loads(payload)["error"]["code"] == "request_timeout"
    assert "request head" in json.loads(payload)["error"]["message"]
    assert len(engine.requests) == before
    assert http.get("/health").status_code == 200


def test_a_request_head_over_its_size_limit_is_a_431(head_limited):
    _, url, http = head_limited
    sock = _connect(url)
    try:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\nX-Pad: " + b"a" * 9000)   # never ends
        answer = _read_all(sock)
    finally:
        sock.close()
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431"), answer[:200]
    assert "8192 bytes" in json.loads(payload)["error"]["message"]
    assert http.get("/health").status_code == 200


def test_requests_and_streams_longer_than_the_head_deadline_are_served_in_full(head_limited):
    http = head_limited[2]
    body = {"prompt": "hello", "max_tokens": 120, "ignore_eos": True, "stream": True}   # ~1.2 s of tokens
    started = time.monotonic()
    with http.stream("POST", "/v1/completions", json=body) as response:
        lines = [line for line in response.iter_lines() if line]
    assert time.monotonic() - started > HEAD_TIMEOUT_S
    assert lines[-1] == "data: [DONE]" and not any('"error"' in line for line in lines)
    for _ in range(2):                 # kept-alive connections across the deadline serve the next request
        time.sleep(HEAD_TIMEOUT_S * 1.5)
        assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
