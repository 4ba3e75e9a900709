"""The engine core in its own process (engine.process: separate): a real child process behind a real uvicorn
server, driven with the `openai` client. What crosses the pipe must behave as the in-process engine does:
cancellation returns pages, the scheduler's refusals arrive as HTTP errors, stats are consistent, and a dead
engine process turns into 503s rather than hung streams."""
from __future__ import annotations

import time

import httpx
import openai
import pytest

from orchestrator.core.config import load_config
from orchestrator.serve.engine_process import ErrorInfo, ProcessServing
from orchestrator.serve.factory import build_serving_engine
from orchestrator.serve.server import ServerSettings, create_app
from orchestrator.core.errors import InvalidRequestError, QueueFullError
from tests.fakes_serving import family_dir, serve_in_thread

PROMPT = "Tell me a long story about a river, a boat and a dog who could not swim."


def _config(**overrides):
    base = {"family": str(family_dir()), "pool.num_pages": 256, "pool.host_tier_mb": 0, "engine.device": "cpu",
            "engine.num_threads": 1, "engine.process": "separate", "escalation.enabled": False}
    return load_config(None, {**base, **overrides})


@pytest.fixture(scope="module")
def served():
    engine = build_serving_engine(_config())
    assert isinstance(engine, ProcessServing)
    app = create_app(engine, engine.tokenizer, engine.family, ServerSettings(request_timeout_s=60))
    with serve_in_thread(app, timeout_s=180) as url:
        yield engine, url


def _used_pages(url: str) -> int:
    return httpx.get(url + "/v1/stats").json()["pages"]["by_state"]["used"]


def test_a_cancelled_stream_returns_its_pages(served):
    engine, url = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    stream = client.completions.create(model="tiny-l", prompt=PROMPT, max_tokens=400, stream=True,
                                       extra_body={"ignore_eos": True})
    received = 0
    for chunk in stream:
        received += bool(chunk.choices and chunk.choices[0].text)
        if received == 3:
            break
    assert _used_pages(url) > 0                   # still generating in the engine process
    stream.close()                                # the client goes away mid-answer
    deadline = time.monotonic() + 20
    while _used_pages(url) and time.monotonic() < deadline:
        time.sleep(0.05)
    stats = httpx.get(url + "/v1/stats").json()
    assert stats["pages"]["by_state"]["used"] == 0
    assert stats["engine"]["process"] == "separate"
    assert stats["counters"]["requests"]["tiny-l"]["cancelled"] >= 1


def test_the_schedulers_refusal_crosses_the_pipe_as_a_400(served):
    _, url = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    # fits the member's context (parse_request passes it) but not the 256-page pool: the engine process refuses
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny-l", prompt=PROMPT, max_tokens=900, stream=True)
    assert "KV pages" in str(err.value) and err.value.body["param"] == "max_tokens"


def test_outputs_and_stats_agree_after_a_full_answer(served):
    _, url = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    before = httpx.get(url + "/v1/stats").json()["counters"]["generated_tokens"].get("tiny-l", 0)
    answer = client.completions.create(model="tiny-l", prompt=PROMPT, max_tokens=24, temperature=0,
                                       extra_body={"ignore_eos": True})
    after = httpx.get(url + "/v1/stats").json()["counters"]["generated_tokens"]["tiny-l"]
    assert answer.usage.completion_tokens == 24
    assert after - before == 24                   # the reply to stats is ordered after the request's last output


def test_error_info_rebuilds_the_typed_error():
    refused = ErrorInfo.of(QueueFullError("queue full (3 waiting requests)", retry_after_s=2.5)).exception()
    assert isinstance(refused, QueueFullError) and refused.retry_after_s == 2.5 and refused.status_code == 429
    invalid = ErrorInfo.of(InvalidRequestError("too long", param="max_tokens")).exception()
    assert isinstance(invalid, InvalidRequestError) and invalid.param == "max_tokens"
    assert type(ErrorInfo("NoSuchError", "x").exception()).__name__ == "MFSError"


def test_a_dead_engine_process_fails_streams_and_health():
    engine = build_serving_engine(_config())
    app = create_app(engine, engine.tokenizer, engine.family, ServerSettings(request_timeout_s=60))
    with serve_in_thread(app, timeout_s=180) as url:
        assert httpx.get(url + "/health").status_code == 200
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        stream = client.completions.create(model="tiny-l", prompt=PROMPT, max_tokens=400, stream=True,
                                           extra_body={"ignore_eos": True})
        next(iter(stream))
        engine._process.kill()                    # the engine process dies mid-stream
        with pytest.raises(openai.APIError):      # the stream ends with an error event; it does not hang
            for _ in stream:
                pass
        deadline = time.monotonic() + 10
        while httpx.get(url + "/health").status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert httpx.get(url + "/health").status_code == 503
        with pytest.raises(openai.APIStatusError) as err:
            client.completions.create(model="tiny-l", prompt=PROMPT, max_tokens=4)
        assert err.value.status_code == 503


def test_an_output_survives_the_compact_pipe_encoding():
    from orchestrator.core.types import FinishReason, MemberSpan, RequestId, RequestOutput
    from orchestrator.serve.engine_process import pack_output, unpack_output

    outputs = [RequestOutput(RequestId("r1"), [5, 6], [-0.1, -2.0], [((5, -0.1), (9, -3.0)), ((6, -2.0),)], "tiny-m",
                             finished=True, finish_reason=FinishReason.LENGTH, num_prompt_tokens=40,
                             num_cached_prompt_tokens=32, spans=(MemberSpan("tiny-s", 3), MemberSpan("tiny-m", 2))),
               RequestOutput(RequestId("r2"), [], [], [], "tiny-l", error="boom")]
    assert [unpack_output(pack_output(o)) for o in outputs] == outputs


def test_the_triton_child_follows_tritons_health_and_reports_errors_through_the_pipe():
    """engine.kind triton + separate: TritonServing runs in the child. With no Triton listening the server is up
    but not ready (/health 503 via the child's health message), a request gets the child's 503, /v1/stats is the
    child's Triton snapshot, and shutdown leaves no child behind."""
    from tests.triton_helpers import free_ports

    port = free_ports(1)[0]                       # nothing listens there
    engine = build_serving_engine(_config(**{"engine.kind": "triton", "engine.triton_url": f"127.0.0.1:{port}",
                                             "engine.triton_metrics_url": f"http://127.0.0.1:{port}/metrics"}))
    assert isinstance(engine, ProcessServing)
    app = create_app(engine, engine.tokenizer, engine.family, ServerSettings(request_timeout_s=60))
    with serve_in_thread(app, timeout_s=180) as url:
        process = engine._process
        deadline = time.monotonic() + 10
        while httpx.get(url + "/health").status_code != 503 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert httpx.get(url + "/health").status_code == 503
        stats = httpx.get(url + "/v1/stats").json()
        assert (stats["engine"]["kind"], stats["engine"]["process"], stats["engine"]["ready"]) == \
            ("triton", "separate", False)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        with pytest.raises(openai.APIStatusError) as err:
            client.completions.create(model="tiny-l", prompt=PROMPT, max_tokens=4)
        assert err.value.status_code == 503 and "Triton is not ready" in str(err.value)
        counters = httpx.get(url + "/v1/stats").json()["counters"]["requests"]["tiny-l"]
        assert counters["rejected"] == 1
    process.join(10)
    assert not process.is_alive()
