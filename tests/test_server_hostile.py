"""Hostile bodies and the field policy at the edge: limits, unimplemented features refused, unknown names ignored
and named, penalties checked and handed to the engine; every refusal a 4xx naming the field on a live connection."""
from __future__ import annotations

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
