"""The fleet front (orchestrator/serve/fleet_edge.py) against a stand-in gateway that shows what it receives and can
cut a stream, plus a real replica (fake engine) with an API key for /v1/models. No sglang-router needed here;
tests/test_fleet.py runs the real one."""
from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from orchestrator.serve.fleet_edge import FleetFront, FrontSettings
from orchestrator.serve.server import ServerSettings, create_app
from tests.fakes_serving import FAKE_TEXT, FakeServingEngine, serve_in_thread


def stand_in_gateway(name: str) -> FastAPI:
    """Answers a chat request with the headers and body it received; `"cut": true` streams one event and dies."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        try:
            body = await request.json()
        except (ValueError, RecursionError):
            return JSONResponse({"gateway": name, "raw_bytes": len(await request.body())})
        seen = {"gateway": name, "headers": dict(request.headers), "body": body}
        if body.get("cut"):
            async def events():
                yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'content': 'a'}}]})}\n\n"
                await asyncio.sleep(0.05)
                raise RuntimeError("node lost")           # uvicorn drops the connection mid-body
            return StreamingResponse(events(), media_type="text/event-stream")
        node = {"x-mfs-node": body.get("node", "n1"), "x-mfs-boot": body.get("boot", "b1")}
        return JSONResponse(seen, headers=node)

    @app.get("/workers")
    async def workers():
        return {"workers": [{"url": "http://w1", "is_healthy": True, "load": 0},
                            {"url": "http://w2", "is_healthy": name == "sticky", "load": 3}]}
    return app


@pytest.fixture(scope="module")
def front(family, tokenizer):
    engine = FakeServingEngine(family.name, family.member_names, tokenizer.encode(FAKE_TEXT))
    replica = create_app(engine, tokenizer, family, ServerSettings(request_timeout_s=30, api_key="k"))
    with serve_in_thread(stand_in_gateway("cache_aware")) as keyless, \
            serve_in_thread(stand_in_gateway("sticky")) as sticky, serve_in_thread(replica) as replica_url:
        settings = FrontSettings(keyless_gateway_url=keyless, sticky_gateway_url=sticky,
                                 worker_urls=("http://127.0.0.1:1", replica_url), request_timeout_s=30)
        with serve_in_thread(FleetFront(settings)) as url:
            yield url


def post(front: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(front + "/v1/chat/completions", json=body, headers=headers or {}, timeout=10)


def test_session_becomes_the_routing_key_and_dropped_fields_travel_as_headers(front):
    seen = post(front, {"messages": [], "cache_salt": "tenant é", "mfs_profile": "quality"},
                {"X-Session-ID": "s 1", "Accept-Encoding": "gzip"}).json()
    assert seen["gateway"] == "sticky"
    assert seen["headers"]["x-smg-routing-key"] == "s%201"
    assert seen["headers"]["x-request-id-mfs-cache-salt"] == "tenant%20%C3%A9"
    assert seen["headers"]["x-request-id-mfs-profile"] == "quality"
    assert seen["headers"]["accept-encoding"] == "identity"       # a cut stream must stay detectable
    assert seen["body"]["cache_salt"] == "tenant é"                 # the body itself is forwarded unchanged
    by_user = post(front, {"messages": [], "user": "alice"}).json()
    assert (by_user["gateway"], by_user["headers"]["x-smg-routing-key"]) == ("sticky", "alice")
    keyless = post(front, {"messages": []}, {"x-smg-routing-key": ""}).json()
    assert keyless["gateway"] == "cache_aware" and "x-smg-routing-key" not in keyless["headers"]


def test_a_body_nested_too_deep_to_parse_is_forwarded_as_is(front):
    deep = b"[" * 100_000 + b"]" * 100_000
    response = httpx.post(front + "/v1/chat/completions", content=deep, timeout=10,
                          headers={"content-type": "application/json"})
    assert response.json() == {"gateway": "cache_aware", "raw_bytes": len(deep)}   # the replica names the problem


def test_a_session_answered_elsewhere_is_reported_as_moved(front):
    assert "x-mfs-session-moved" not in post(front, {"messages": [], "node": "n1"}, {"X-Session-ID": "m"}).headers
    assert "x-mfs-session-moved" not in post(front, {"messages": [], "node": "n1"}, {"X-Session-ID": "m"}).headers
    moved = post(front, {"messages": [], "node": "n2"}, {"X-Session-ID": "m"})
    assert moved.headers["x-mfs-session-moved"] == "n1"
    restarted = post(front, {"messages": [], "node": "n2", "boot": "b2"}, {"X-Session-ID": "m"})
    assert restarted.headers["x-mfs-session-moved"] == "n2 (restarted)"
    metrics = httpx.get(front + "/metrics").text
    assert "mfs_fleet_session_moves_total 2.0" in metrics


def test_a_cut_stream_ends_with_an_error_event(front):
    client = openai.OpenAI(base_url=front + "/v1", api_key="k", max_retries=0, timeout=10)
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], stream=True,
                                            extra_body={"cut": True})
    with pytest.raises(openai.APIError, match="node serving this request was lost"):
        for _ in stream:
            pass
    assert "mfs_fleet_lost_streams_total 1.0" in httpx.get(front + "/metrics").text


def test_models_come_from_a_replica_with_the_client_key_and_health_from_the_gateways(front, family):
    assert httpx.get(front + "/v1/models").status_code == 401       # the replica's refusal, not a 503
    models = openai.OpenAI(base_url=front + "/v1", api_key="k", max_retries=0).models.list()
    assert [m.id for m in models.data] == [family.name, *family.member_names]   # skipped the unreachable one
    health = httpx.get(front + "/health")
    assert health.status_code == 200 and health.json()["healthy_workers"] == {"cache_aware": 1, "sticky": 2}
    assert httpx.get(front + "/v1/stats").status_code == 404           # per node: on each replica


def test_unreachable_gateway_and_oversized_body_are_clear_errors(family):
    settings = FrontSettings(keyless_gateway_url="http://127.0.0.1:1", sticky_gateway_url=None, worker_urls=(),
                             max_body_bytes=1000)
    with serve_in_thread(FleetFront(settings)) as url:
        response = post(url, {"messages": []})
        assert response.status_code == 502
        assert "cache_aware gateway is unreachable" in response.json()["error"]["message"]
        assert post(url, {"messages": [], "pad": "x" * 2000}).status_code == 413
        assert httpx.get(url + "/health").status_code == 503
        assert httpx.get(url + "/v1/models").status_code == 503


def test_a_slow_body_is_a_408_and_an_oversized_session_header_a_431_at_the_front():
    import socket

    settings = FrontSettings(keyless_gateway_url="http://127.0.0.1:1", sticky_gateway_url=None, worker_urls=(),
                             body_timeout_s=0.5)
    with serve_in_thread(FleetFront(settings)) as url:
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"messa")            # and then nothing
            answer = bytearray()
            while chunk := sock.recv(65536):
                answer += chunk
        head, _, payload = bytes(answer).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), answer[:200]
        assert "did not arrive within 0.5 s" in json.loads(payload)["error"]["message"]
        response = post(url, {"messages": []}, headers={"X-Session-ID": "s" * 257})
        assert response.status_code == 431 and "x-session-id" in response.json()["error"]["message"]
