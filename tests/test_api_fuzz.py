"""Property-based hostile input against a real server (local engine, tiny family): bodies generated from the served
/openapi.json and mutated, raw garbage, deep nesting, huge numbers; never a 5xx or a dropped connection, and the
server stays healthy, holds no used page and answers a fixed greedy request as before (eval/bench/fuzz_api.py)."""
from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, given, settings

from eval.bench.fuzz_api import FAILURES, exchange, greedy_text, hostile_request, pages_used_when_idle, request_schemas
from orchestrator.core.config import load_config
from orchestrator.serve.factory import build_serving_engine
from orchestrator.serve.server import ServerSettings, create_app
from tests.fakes_serving import family_dir, serve_in_thread


@pytest.fixture(scope="module")
def served():
    config = load_config(None, {"family": str(family_dir()), "pool.num_pages": 1024, "pool.host_tier_mb": 0,
                                "engine.device": "cpu", "engine.num_threads": 1, "engine.process": "thread"})
    engine = build_serving_engine(config)
    app = create_app(engine, engine.tokenizer, engine.family, ServerSettings(request_timeout_s=60))
    with serve_in_thread(app, timeout_s=120) as url, httpx.Client(base_url=url, timeout=60) as http:
        yield engine, http


def test_hostile_bodies_get_a_2xx_or_a_4xx_and_leave_the_server_as_it_was(served):
    engine, http = served
    schemas = request_schemas(http)
    assert set(schemas["/v1/chat/completions"]["required"]) == {"messages"}
    before = greedy_text(http)
    seen = []

    # derandomize: the same examples on every run, so a CI failure reproduces; the benchmark run is random
    @settings(max_examples=300, derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(hostile_request(schemas, engine.tokenizer.vocab_size))
    def one(request):
        outcome = exchange(http, *request)     # one keep-alive client: a dropped connection would show here
        seen.append(outcome)
        assert outcome not in FAILURES, (outcome, request[0], request[1][:300])

    one()
    assert {"2xx", "4xx"} <= set(seen)         # the generator reaches both answers
    assert http.get("/health").status_code == 200
    assert pages_used_when_idle(http) == 0
    assert greedy_text(http) == before
