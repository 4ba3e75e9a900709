"""The OpenAI API against a real uvicorn server with the fake engine, driven by the official `openai` client."""
from __future__ import annotations

import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from orchestrator.serve.api_schema import session_digest
from orchestrator.serve.server import ServerSettings, create_app
from tests.fakes_serving import BLOCK_TOKENS, FAKE_TEXT, FakeServingEngine, family_dir, serve_in_thread

FAMILY_DIR = family_dir()
SPEC_METRICS = {
    "mfs_requests", "mfs_prefix_cache_queries", "mfs_prefix_cache_hits", "mfs_kv_pages", "mfs_escalations",
    "mfs_queue_depth", "mfs_running_requests", "mfs_preemptions", "mfs_evictions", "mfs_generated_tokens",
    "mfs_ttft_seconds", "mfs_tpot_seconds", "mfs_e2e_seconds",
}


def make_engine(family, tokenizer) -> FakeServingEngine:
    return FakeServingEngine(family.name, family.member_names, tokenizer.encode(FAKE_TEXT))


@pytest.fixture(scope="module")
def served(family, tokenizer):
    engine = make_engine(family, tokenizer)
    app = create_app(engine, tokenizer, family, ServerSettings(request_timeout_s=30))
    with serve_in_thread(app) as url:
        yield engine, url


@pytest.fixture()
def client(served):
    return openai.OpenAI(base_url=served[1] + "/v1", api_key="unused", max_retries=0, timeout=20)


def expected_cached_tokens(earlier: list[int], prompt: list[int]) -> int:
    """What the fake engine's prefix cache must hit: the prompt's longest prefix shared with an earlier
    prompt, short of the last prompt token (always recomputed), in whole BLOCK_TOKENS blocks."""
    shared = 0
    while shared < min(len(earlier), len(prompt) - 1) and earlier[shared] == prompt[shared]:
        shared += 1
    return shared // BLOCK_TOKENS * BLOCK_TOKENS


def expected_text(tokenizer, n: int) -> str:
    return tokenizer.decode(tokenizer.encode(FAKE_TEXT)[:n])


def test_chat_non_streaming_shape_usage_and_model(client, tokenizer):
    messages = [{"role": "user", "content": "Tell me a story about a fox and a dog, please. " * 3}]
    first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8)
    assert first.object == "chat.completion" and first.id.startswith("chatcmpl-")
    choice = first.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected_text(tokenizer, 8)
    assert choice.finish_reason == "length"
    assert first.model == "tiny-s"
    assert first.usage.completion_tokens == 8
    assert first.usage.prompt_tokens == len(tokenizer.apply_chat_template(messages))
    assert first.usage.total_tokens == first.usage.prompt_tokens + 8
    mfs = first.model_extra["mfs"]
    assert mfs["members"] == [{"member": "tiny-s", "tokens": 8}] and mfs["escalated"] is False
    assert mfs["route"]["member"] == "tiny-s"
    # Second turn of the same conversation: the shared prefix is reported as cached.
    turn2 = messages + [{"role": "assistant", "content": choice.message.content}, {"role": "user", "content": "More."}]
    second = client.chat.completions.create(model="tiny", messages=turn2, max_tokens=4)
    expected = expected_cached_tokens(tokenizer.apply_chat_template(messages), tokenizer.apply_chat_template(turn2))
    assert expected >= 48                   # turn 1's prompt is 56 tokens: three whole blocks at least
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == expected


def test_chat_streaming_role_deltas_finish_and_usage(client, tokenizer):
    messages = [{"role": "user", "content": "Which birds fish at dawn along a quiet river, and how? " * 2}]

    def stream_once():
        return list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, stream=True,
                                                   stream_options={"include_usage": True}))
    chunks = stream_once()
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == expected_text(tokenizer, 12)
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 0     # a prompt no earlier test sent
    assert all(c.model == "tiny-s" for c in chunks)
    # The same prompt again: every whole block before its last token comes from the cache, in the usage chunk.
    prompt = tokenizer.apply_chat_template(messages)
    again = stream_once()
    assert again[-1].usage.prompt_tokens_details.cached_tokens == (len(prompt) - 1) // BLOCK_TOKENS * BLOCK_TOKENS > 0


def test_completions_streaming_and_not(client, tokenizer):
    full = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=10)
    assert full.object == "text_completion"
    assert full.choices[0].text == expected_text(tokenizer, 10)
    assert full.usage.completion_tokens == 10 and full.choices[0].finish_reason == "length"
    parts = list(client.completions.create(model="tiny", prompt=[5, 6, 7, 8], max_tokens=10, stream=True))
    assert "".join(p.choices[0].text for p in parts if p.choices) == full.choices[0].text
    assert parts[-1].choices[0].finish_reason == "length"


def test_stop_string_ends_answer_and_aborts(served, client, tokenizer):
    engine = served[0]
    full = client.completions.create(model="tiny", prompt="go", max_tokens=40, stop=["STOP"])
    assert full.choices[0].finish_reason == "stop"
    assert full.choices[0].text == FAKE_TEXT[:FAKE_TEXT.index("STOP")]
    assert full.id in engine.aborted
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "go"}],
                                            max_tokens=40, stop="STOP", stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == FAKE_TEXT[:FAKE_TEXT.index("STOP")]
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert chunks[-1].id in engine.aborted


def test_logprobs_chat_and_completions(client):
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                          max_tokens=5, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 5 and all(len(e.top_logprobs) == 2 for e in content)
    assert content[0].logprob == pytest.approx(-0.5)
    assert "".join(e.token for e in content) == chat.choices[0].message.content
    comp = client.completions.create(model="tiny", prompt="x", max_tokens=5, logprobs=3)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == 5 and len(lp.token_logprobs) == 5 and all(len(t) <= 3 for t in lp.top_logprobs)
    assert lp.text_offset[0] == 0
    streamed = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                                   max_tokens=5, logprobs=True, stream=True))
    assert sum(len(c.choices[0].logprobs.content) for c in streamed if c.choices and c.choices[0].logprobs) == 5


def test_member_pin_escalation_and_session(served, client):
    engine = served[0]
    pinned = client.chat.completions.create(model="tiny-m", messages=[{"role": "user", "content": "x"}], max_tokens=3)
    assert pinned.model == "tiny-m"
    assert engine.requests[-1].pinned_member == "tiny-m"
    engine.escalate_after = 2
    try:
        esc = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=5,
                                             extra_headers={"X-Session-ID": "sess-1"}, user="alice")
    finally:
        engine.escalate_after = None
    assert esc.model == "tiny-m"
    assert esc.model_extra["mfs"]["escalated"] is True
    assert esc.model_extra["mfs"]["members"] == [{"member": "tiny-s", "tokens": 2}, {"member": "tiny-m", "tokens": 3}]
    assert engine.requests[-1].session_id == session_digest("sess-1")     # the engine keeps a digest
    client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=1,
                                   user="bob", extra_body={"mfs_profile": "quality", "cache_salt": "tenant-a"})
    last = engine.requests[-1]
    assert last.session_id == session_digest("bob") and last.profile.value == "quality" and last.cache_salt == "tenant-a"


def test_models_list(client, family):
    ids = [m.id for m in client.models.list().data]
    assert ids == [family.name, *family.member_names]


def test_health_follows_readiness(served):
    engine, url = served
    assert httpx.get(url + "/health").status_code == 200
    engine.ready = False
    try:
        response = httpx.get(url + "/health")
        assert response.status_code == 503 and response.json()["status"] == "starting"
    finally:
        engine.ready = True
    assert httpx.get(url + "/health").status_code == 200


def test_metrics_exposition_parses_and_names(served, client):
    client.completions.create(model="tiny", prompt="metrics please", max_tokens=4)
    text = httpx.get(served[1] + "/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert SPEC_METRICS <= set(families), SPEC_METRICS - set(families)
    states = {s.labels["state"] for s in families["mfs_kv_pages"].samples}
    assert states == {"free", "used", "cached", "host", "disk"}
    ttft_count = [s for s in families["mfs_ttft_seconds"].samples if s.name == "mfs_ttft_seconds_count"]
    assert sum(s.value for s in ttft_count) >= 1
    finished = [s for s in families["mfs_requests"].samples
                if s.name == "mfs_requests_total" and s.labels["outcome"] == "finished"]
    assert sum(s.value for s in finished) >= 1


def test_stats_endpoint(served):
    stats = httpx.get(served[1] + "/v1/stats").json()
    assert stats["family"] == "tiny" and "counters" in stats and "pages" in stats


def test_client_disconnect_mid_stream_aborts(served):
    engine, url = served
    body = {"model": "tiny", "prompt": "long", "max_tokens": 500, "stream": True}
    with httpx.Client(timeout=10) as http, http.stream("POST", url + "/v1/completions", json=body) as response:
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        request_id = first.split('"id":"', 1)[1].split('"', 1)[0]
    deadline = time.monotonic() + 5
    while request_id not in engine.aborted and time.monotonic() < deadline:
        time.sleep(0.02)
    assert request_id in engine.aborted


def test_api_key_guards_v1_only(family, tokenizer):
    engine = make_engine(family, tokenizer)
    app = create_app(engine, tokenizer, family, ServerSettings(api_key="sekret"))
    with serve_in_thread(app) as url:
        denied = httpx.get(url + "/v1/models")
        assert denied.status_code == 401
        assert denied.json()["error"]["code"] == "invalid_api_key"
        wrong = openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
        good = openai.OpenAI(base_url=url + "/v1", api_key="sekret", max_retries=0)
        assert good.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                            max_tokens=2).usage.completion_tokens == 2
        assert httpx.get(url + "/health").status_code == 200
        assert httpx.get(url + "/metrics").status_code == 200
