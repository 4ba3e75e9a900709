"""Hostile bodies and the field policy at the edge: limits, unimplemented features refused, unknown names ignored
and named, penalties checked and handed to the engine; every refusal a 4xx naming the field on a live connection."""
from __future__ import annotations

import time

import httpx
import pytest

from orchestrator.serve.openapi_models import ChatCompletionRequest, CompletionRequest
from orchestrator.serve.request_fields import HONOURED, MAX_LOGIT_BIAS_ENTRIES
from orchestrator.serve.server import ServerSettings, create_app
from tests.fakes_serving import FAKE_TEXT, FakeServingEngine, serve_in_thread
from tests.test_server_errors import CHAT, COMP, MSG, assert_error


@pytest.fixture(scope="module")
def served(family, tokenizer):
    engine = FakeServingEngine(family.name, family.member_names, tokenizer.encode(FAKE_TEXT))
    app = create_app(engine, tokenizer, family, ServerSettings(max_body_bytes=512 * 1024))
    # one connection for the whole module: a refusal that dropped it would fail the next request
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=10,
                                                   limits=httpx.Limits(max_connections=1)) as http:
        yield engine, http


def _raw(http, path: str, raw: bytes) -> httpx.Response:
    return http.post(path, content=raw, headers={"content-type": "application/json"})


@pytest.mark.parametrize("raw, param", [
    (b"[" * 100_000 + b"]" * 100_000, None),
    (b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", None),            # past the parser's own depth limit
    (b'{"prompt": ' + b"[" * 20 + b"1" + b"]" * 20 + b"}", "prompt"),     # past MFS's limit: names the field
    (b'{"messages": [{"role": "user", "content": [{"type": "text", "text": {"a": {"b": {"c": [1]}}}}]}]}', "messages"),
    (b'{"prompt": "x", "max_tokens": 1' + b"0" * 400 + b"}", None),
    (b'{"prompt": "x", "max_tokens": 18446744073709551616}', "max_tokens"),
    (b'{"prompt": "x", "temperature": 1e400}', None),
    (b'{"prompt": "x", "top_p": NaN}', None),
    (b'{"prompt": "\\ud800"}', None),
    (b'{"prompt": "x", "seed": 18446744073709551615}', None),              # in range: answered
])
def test_deep_nesting_and_extreme_numbers_are_refused_on_a_live_connection(served, raw, param):
    engine, http = served
    response = _raw(http, CHAT if raw.startswith(b'{"messages"') else COMP, raw)
    if raw.endswith(b"18446744073709551615}"):
        assert response.status_code == 200
    else:
        assert_error(response, 400, param)
    assert http.get("/health").status_code == 200


@pytest.mark.parametrize("field, value", [
    ("tools", [{"type": "function", "function": {"name": "f"}}]), ("tool_choice", "auto"),
    ("functions", [{"name": "f"}]), ("function_call", "auto"), ("response_format", {"type": "json_object"}),
    ("echo", True), ("suffix", "x"), ("best_of", 2), ("min_p", 0.1), ("guided_json", {"type": "object"}),
    ("use_beam_search", True), ("modalities", ["text", "audio"]), ("n", 3),
    ("frequency_penalty", 2.5), ("presence_penalty", 9223372036854775808), ("presence_penalty", "high"),
    ("repetition_penalty", 0), ("repetition_penalty", 1e-323), ("logit_bias", {"abc": 1}),
    ("logit_bias", {"5": 101}), ("logit_bias", {"999999": 1}), ("logit_bias", [1, 2]),
    ("logit_bias", {str(i): 1 for i in range(MAX_LOGIT_BIAS_ENTRIES + 1)}), ("stop_token_ids", [-1]),
    ("seed", 2**64), ("user", "u" * 600), ("model", "m" * 600), ("stop", ["s" * 600]),
])
def test_unimplemented_features_and_bad_penalties_are_a_400_naming_the_field(served, field, value):
    engine, http = served
    before = len(engine.requests)
    for path, base in ((COMP, {"prompt": "x"}), (CHAT, {"messages": MSG})):
        assert_error(http.post(path, json={**base, field: value}), 400, field)
    assert len(engine.requests) == before


def test_neutral_values_of_unimplemented_features_and_unknown_names_are_accepted(served):
    engine, http = served
    body = {"messages": MSG, "max_tokens": 2, "tools": [], "tool_choice": "none", "response_format": {"type": "text"},
            "n": 1, "best_of": 1, "min_p": 0, "metadata": {"k": "v"}, "store": False, "service_tier": "auto",
            "my_extension": {"x": 1}, "skip_special_tokens": True}
    response = http.post(CHAT, json=body)
    assert response.status_code == 200, response.text
    assert response.headers["x-mfs-ignored-fields"] == "my_extension,skip_special_tokens"
    assert "x-mfs-ignored-fields" not in http.post(CHAT, json={"messages": MSG, "max_tokens": 2}).headers


def test_penalties_bias_and_stop_ids_reach_the_engine(served, tokenizer):
    engine, http = served
    body = {"prompt": "hello there", "max_tokens": 2, "frequency_penalty": -2, "presence_penalty": 1.5,
            "repetition_penalty": 1.3, "logit_bias": {"7": -100, "3": 2.5}, "stop_token_ids": [11]}
    assert http.post(COMP, json=body).status_code == 200
    sampling = engine.requests[-1].sampling
    assert (sampling.frequency_penalty, sampling.presence_penalty, sampling.repetition_penalty) == (-2.0, 1.5, 1.3)
    assert sampling.logit_bias == ((3, 2.5), (7, -100.0)) and sampling.stop_token_ids == (11,)
    assert sampling.penalized_prompt_ids == tuple(sorted(set(tokenizer.encode("hello there"))))
    assert http.post(COMP, json={"prompt": "x", "max_tokens": 2}).status_code == 200
    neutral = engine.requests[-1].sampling
    assert not neutral.penalized and neutral.penalized_prompt_ids == ()


def test_the_published_schema_lists_exactly_the_honoured_fields(served):
    http = served[1]
    document = http.get("/openapi.json").json()
    for path, kind, model in ((COMP, "completion", CompletionRequest), (CHAT, "chat", ChatCompletionRequest)):
        schema = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert set(schema["properties"]) == HONOURED[kind] == set(model.model_fields)
        assert "$ref" not in str(schema)          # nested models inlined: the operation stands alone


@pytest.mark.parametrize("field, value", [("frequency_penalty", 0.5), ("presence_penalty", -1.0),
                                          ("repetition_penalty", 1.2), ("logit_bias", {"5": 10})])
def test_the_triton_engine_refuses_penalties_and_bias_with_a_400(family, tokenizer, field, value):
    from fastapi.testclient import TestClient

    from orchestrator.core.config import load_config
    from orchestrator.serve.triton_serving import TritonServing
    from tests.fakes_serving import family_dir

    config = load_config(None, {"family": str(family_dir()), "engine.kind": "triton",
                                "engine.triton_url": "127.0.0.1:1"})
    engine = TritonServing(config, url="127.0.0.1:1")      # never started: the refusal comes before any call
    app = create_app(engine, tokenizer, family, ServerSettings())
    client = TestClient(app)                                # outside `with`: no lifespan, no Triton to start
    for stream in (False, True):
        response = client.post(COMP, json={"prompt": "x", "max_tokens": 2, "stream": stream, field: value})
        assert_error(response, 400, field)
    neutral = client.post(COMP, json={"prompt": "x", "max_tokens": 2, field: {"logit_bias": {}}.get(field, None)})
    assert_error(neutral, 503, None)                       # neutral values pass the check; Triton is not there


# ----------------------------------------------------------------------------- what one client may hold
def test_a_session_header_over_256_bytes_is_a_431_naming_it_and_the_engine_keeps_a_digest(served):
    from orchestrator.serve.client_limits import MAX_SESSION_HEADER_BYTES

    engine, http = served
    before = len(engine.requests)
    for header in ("X-Session-ID", "X-SMG-Routing-Key"):
        response = http.post(COMP, json={"prompt": "x", "max_tokens": 2},
                             headers={header: "s" * (MAX_SESSION_HEADER_BYTES + 1)})
        assert_error(response, 431, header.lower())
        assert "256" in response.json()["error"]["message"]
    assert len(engine.requests) == before
    for session in ("s" * MAX_SESSION_HEADER_BYTES, "short"):
        assert http.post(COMP, json={"prompt": "x", "max_tokens": 2},
                         headers={"X-Session-ID": session}).status_code == 200
        assert len(engine.requests[-1].session_id) == 32 and session not in engine.requests[-1].session_id
    assert http.get("/health").status_code == 200


def _open_stream(http: httpx.Client, key: str | None = None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    stream = http.stream("POST", COMP, json={"prompt": "x", "max_tokens": 400, "ignore_eos": True, "stream": True},
                         headers=headers)
    response = stream.__enter__()          # the headers are in: the request is in flight
    assert response.status_code == 200
    return stream


def test_requests_in_flight_per_client_are_bounded_with_a_429_naming_the_limit(family, tokenizer):
    engine = FakeServingEngine(family.name, family.member_names, tokenizer.encode(FAKE_TEXT), token_delay_s=0.02)
    app = create_app(engine, tokenizer, family, ServerSettings(max_client_requests=2, request_timeout_s=60))
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=10) as http:
        streams = [_open_stream(http), _open_stream(http)]
        refused = http.post(COMP, json={"prompt": "x", "max_tokens": 2})
        assert_error(refused, 429, None)
        assert "limit is 2" in refused.json()["error"]["message"] and refused.headers["retry-after"] == "1"
        assert http.get("/health").status_code == 200 and http.get("/v1/models").status_code == 200
        for stream in streams:
            stream.__exit__(None, None, None)
        deadline = time.monotonic() + 10       # the streams' requests end once the server sees them gone
        while time.monotonic() < deadline:
            if http.post(COMP, json={"prompt": "x", "max_tokens": 2}).status_code == 200:
                break
            time.sleep(0.05)
        assert http.post(COMP, json={"prompt": "x", "max_tokens": 2}).status_code == 200


def test_with_api_keys_each_key_has_its_own_limit_and_its_own_cache_salt(family, tokenizer):
    engine = FakeServingEngine(family.name, family.member_names, tokenizer.encode(FAKE_TEXT), token_delay_s=0.02)
    settings = ServerSettings(api_keys=("key-a", "key-b"), max_client_requests=1, request_timeout_s=60)
    app = create_app(engine, tokenizer, family, settings)
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=10) as http:
        def post(key: str | None, **extra) -> httpx.Response:
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            headers.update(extra.pop("headers", {}))
            return http.post(COMP, json={"prompt": "x", "max_tokens": 2, **extra}, headers=headers)

        assert post(None).status_code == 401 and post("key-c").status_code == 401
        stream = _open_stream(http, "key-a")
        assert_error(post("key-a"), 429, None)       # key-a holds its one request
        assert post("key-b").status_code == 200      # another key is not held back by it
        stream.__exit__(None, None, None)
        salts = {}
        for key, salt in (("key-a", None), ("key-a", "s1"), ("key-b", None), ("key-b", "s1")):
            deadline = time.monotonic() + 10
            while (response := post(key, **({"cache_salt": salt} if salt else {}),
                                     headers={"X-Session-ID": "same"})).status_code == 429 \
                    and time.monotonic() < deadline:
                time.sleep(0.05)
            assert response.status_code == 200, response.text
            salts[key, salt] = (engine.requests[-1].cache_salt, engine.requests[-1].session_id)
        assert len({cache_salt for cache_salt, _ in salts.values()}) == 4          # one prefix cache per key and salt
        assert salts["key-a", None][1] != salts["key-b", None][1]                  # ... and one session table
        assert all("key-a" not in s and "key-b" not in s for pair in salts.values() for s in pair)
        assert salts["key-a", "s1"][0].endswith("/s1")                              # the client's salt still counts
        assert post("key-a").status_code == 200 and engine.requests[-1].cache_salt == salts["key-a", None][0]


def test_api_keys_come_from_the_flag_the_environment_and_a_file(tmp_path):
    import argparse

    from orchestrator.serve.server import api_keys

    path = tmp_path / "keys"
    path.write_text("# tenants\nfile-1\n\n  file-2  \n")
    args = argparse.Namespace(api_key="flag", api_key_file=str(path))
    assert api_keys(args, {"MFS_API_KEY": "env-1, env-2"}) == ("flag", "env-1", "env-2", "file-1", "file-2")
    assert api_keys(argparse.Namespace(api_key=None, api_key_file=None), {}) == ()
    path.write_text("# none\n")
    with pytest.raises(ValueError, match="holds no key"):
        api_keys(args, {})


@pytest.mark.parametrize("path, field, value, param", [
    (COMP, "top_k", 4294967301, "top_k"), (COMP, "top_k", 2147483648, "top_k"),    # int32 there: would wrap
    (CHAT, "top_logprobs", 3, "top_logprobs"), (COMP, "logprobs", 2, "top_logprobs"),  # would come back empty
    (COMP, "min_tokens", 3, "min_tokens"),                                            # EOS is not banned there
])
def test_the_triton_engine_refuses_what_it_cannot_carry_or_honour_with_a_400(family, tokenizer, path, field, value,
                                                                            param):
    from fastapi.testclient import TestClient

    from orchestrator.core.config import load_config
    from orchestrator.serve.triton_serving import TritonServing
    from tests.fakes_serving import family_dir

    config = load_config(None, {"family": str(family_dir()), "engine.kind": "triton",
                                "engine.triton_url": "127.0.0.1:1"})
    client = TestClient(create_app(TritonServing(config, url="127.0.0.1:1"), tokenizer, family, ServerSettings()))
    base = {"messages": MSG, "logprobs": True} if path == CHAT else {"prompt": "x"}
    for stream in (False, True):
        response = client.post(path, json={**base, "max_tokens": 4, "stream": stream, field: value})
        assert_error(response, 400, param)
        assert "Triton" in response.json()["error"]["message"]


def test_the_triton_request_packs_every_field_in_range_or_names_it():
    import numpy as np
    from tritonclient.grpc import service_pb2

    from engines.triton.client import build_request
    from orchestrator.core.errors import InvalidRequestError
    from orchestrator.core.types import SamplingParams

    def packed(request: service_pb2.ModelInferRequest, name: str) -> int:
        index = [t.name for t in request.inputs].index(name)
        dtype = np.uint64 if request.inputs[index].datatype == "UINT64" else np.int32
        return int(np.frombuffer(request.raw_input_contents[index], dtype=dtype)[0])

    for seed, sent in ((-5, 2**64 - 5), (2**64 - 1, 2**64 - 1), (7, 7)):
        request = build_request("m", [1, 2], SamplingParams(max_tokens=4, seed=seed, top_k=2**31 - 1), "r", 2, 4)
        assert packed(request, "random_seed") == sent and packed(request, "runtime_top_k") == 2**31 - 1
    for sampling, ids, max_tokens, field in ((SamplingParams(max_tokens=4, top_k=2**32 + 5), [1], 4, "top_k"),
                                             (SamplingParams(max_tokens=4), [1], 2**31, "max_tokens"),
                                             (SamplingParams(max_tokens=4), [1, 2**31], 4, "prompt")):
        with pytest.raises(InvalidRequestError) as refused:
            build_request("m", ids, sampling, "r", 2, max_tokens)
        assert refused.value.param == field and refused.value.status_code == 400
