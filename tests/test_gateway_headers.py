"""The header contract between the fleet front, the gateway and a replica (orchestrator/serve/gateway_headers.py):
pure functions, then a real replica (fake engine) receiving a request in the shape the gateway forwards it."""
from __future__ import annotations

import httpx
import pytest

from orchestrator.serve import gateway_headers as gh
from orchestrator.serve.api_schema import session_digest
from orchestrator.serve.server import ServerSettings, create_app
from tests.fakes_serving import FAKE_TEXT, FakeServingEngine, serve_in_thread


def test_session_key_precedence():
    assert gh.session_key({"x-session-id": "h", gh.ROUTING_KEY_HEADER: "k"}, {"user": "u"}) == "h"
    assert gh.session_key({gh.ROUTING_KEY_HEADER: "k"}, {"user": "u"}) == "u"
    assert gh.session_key({gh.ROUTING_KEY_HEADER: "k"}, {"user": ""}) == "k"
    assert gh.session_key({}, {"user": 7}) is None and gh.session_key({}, None) is None


def test_routing_key_is_header_safe_and_bounded():
    assert gh.routing_key("alice") == "alice"
    assert gh.routing_key("Zoë & co/1") == "Zo%C3%AB%20%26%20co%2F1"
    long_key = gh.routing_key("x" * 500)
    assert long_key.startswith("sha256-") and len(long_key) == 7 + 64
    assert gh.routing_key("x" * 500) == long_key and gh.routing_key("y" * 500) != long_key


def test_lifted_fields_round_trip_and_the_body_wins():
    body = {"cache_salt": "tenant é/1", "mfs_profile": "quality", "user": "u"}
    headers = gh.lifted_headers(body)
    assert headers == {"x-request-id-mfs-cache-salt": "tenant%20%C3%A9%2F1", "x-request-id-mfs-profile": "quality"}
    assert all(h.startswith("x-request-id-") for h in headers)    # the prefix the gateway forwards
    assert gh.restore_lifted({}, headers) == {"cache_salt": "tenant é/1", "mfs_profile": "quality"}
    assert gh.restore_lifted({"cache_salt": "mine"}, headers)["cache_salt"] == "mine"
    assert gh.lifted_headers(None) == {} and gh.lifted_headers({"cache_salt": 3}) == {}
    assert gh.restore_lifted([1], headers) == [1]


@pytest.fixture(scope="module")
def replica(family, tokenizer):
    engine = FakeServingEngine(family.name, family.member_names, tokenizer.encode(FAKE_TEXT))
    app = create_app(engine, tokenizer, family, ServerSettings(request_timeout_s=30, node_name="node-a"))
    with serve_in_thread(app) as url:
        yield engine, url


def test_replica_reads_what_the_gateway_forwards(replica):
    engine, url = replica
    # The gateway dropped X-Session-ID, `user`, `cache_salt` and `mfs_profile`; the front had put them here:
    response = httpx.post(url + "/v1/chat/completions", json={"model": "tiny", "max_tokens": 1,
                                                               "messages": [{"role": "user", "content": "x"}]},
                          headers={gh.ROUTING_KEY_HEADER: "sess-9", "x-request-id-mfs-cache-salt": "t%20a",
                                   "x-request-id-mfs-profile": "quality"})
    assert response.status_code == 200
    request = engine.requests[-1]
    assert (request.session_id, request.cache_salt, request.profile.value) == (session_digest("sess-9"), "t a",
                                                                                "quality")
    assert response.headers[gh.NODE_HEADER] == "node-a" and len(response.headers[gh.BOOT_HEADER]) == 12
    # A client talking to the replica directly still wins with its own header and body.
    httpx.post(url + "/v1/chat/completions", json={"model": "tiny", "max_tokens": 1, "cache_salt": "own",
                                                    "messages": [{"role": "user", "content": "x"}]},
               headers={"X-Session-ID": "direct", gh.ROUTING_KEY_HEADER: "sess-9",
                        "x-request-id-mfs-cache-salt": "t%20a"})
    assert (engine.requests[-1].session_id, engine.requests[-1].cache_salt) == (session_digest("direct"), "own")
    # Every response names the node, errors and control routes included.
    assert httpx.get(url + "/health").headers[gh.NODE_HEADER] == "node-a"
    assert httpx.post(url + "/v1/completions", content=b"{").headers[gh.NODE_HEADER] == "node-a"


def test_bad_lifted_profile_is_a_clear_error(replica):
    _, url = replica
    response = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1},
                          headers={"x-request-id-mfs-profile": "fastest"})
    assert response.status_code == 400 and "mfs_profile" in response.json()["error"]["message"]
