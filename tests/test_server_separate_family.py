"""End to end: a real `mfs serve --family tiny-sep` (the shipped separate-weight family: three independent
networks, one tokenizer) answered through the `openai` client: chat and completions, streamed or not, routed
across the family or pinned to a member; greedy replies end with EOS ("stop") where the member emits it."""
from __future__ import annotations

import sys

import httpx
import openai
import pytest

from tests.fakes_serving import free_port, start_process, stop_process, wait_healthy

FAMILY = "tiny-sep"
MEMBERS = ("sep-s", "sep-m", "sep-l")
# Chat openings of the kind the members were trained on (ShareGPT first turns): a trained member closes most of
# its greedy replies with <|eot|> well inside the cap, so at least one of these ends with "stop" on sep-l.
QUESTIONS = ("What is the capital of France?", "Write a haiku about the sea.", "How do I boil an egg?",
             "Hello!", "Explain prefix caching.", "Give me three tips for a job interview.",
             "Tell me a joke about programmers.", "Why is the sky blue?")
REPLY_CAP = 96


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    """`mfs serve --family tiny-sep` in its own process (the default engine process), a small arena."""
    folder = tmp_path_factory.mktemp("serve-sep")
    config = folder / "config.yaml"
    config.write_text("pool:\n  num_pages: 1024\n  host_tier_mb: 0\nengine:\n  device: cpu\n  num_threads: 1\n")
    port = free_port()
    log_path = folder / "serve.log"
    proc = start_process([sys.executable, "-m", "orchestrator.serve.cli", "serve", "--family", FAMILY,
                          "--config", str(config), "--port", str(port), "--log-level", "warning"], log_path)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, proc, log_path)
        yield base
    finally:
        stop_process(proc)


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_models_and_stats_name_the_separate_family(url):
    models = [m.id for m in _client(url).models.list().data]
    assert FAMILY in models and set(MEMBERS) <= set(models)
    stats = httpx.get(url + "/v1/stats", timeout=10).json()
    assert stats["family"] == FAMILY and stats["members"] == list(MEMBERS)


def test_chat_and_completions_answer_streamed_or_not(url):
    client = _client(url)
    chat = client.chat.completions.create(model=FAMILY, messages=[{"role": "user", "content": QUESTIONS[0]}],
                                          max_tokens=16, temperature=0, extra_headers={"X-Session-ID": "sep-1"})
    assert chat.model in MEMBERS and chat.choices[0].finish_reason in ("stop", "length")
    assert 1 <= chat.usage.completion_tokens <= 16
    assert chat.choices[0].finish_reason == "stop" or chat.usage.completion_tokens == 16
    assert chat.model_extra["mfs"]["route"]["member"] in MEMBERS
    assert chat.model_extra["mfs"]["members"][-1]["member"] == chat.model     # the member that answered last
    chunks = list(client.chat.completions.create(model="sep-m", messages=[{"role": "user", "content": QUESTIONS[1]}],
                                                 max_tokens=12, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0] in ("stop", "length") and chunks[-1].usage.completion_tokens >= 1
    assert {c.model for c in chunks} == {"sep-m"} and (text or finals[0] == "stop")
    pieces = list(client.completions.create(model=FAMILY, prompt=QUESTIONS[2], max_tokens=12, stream=True,
                                            stream_options={"include_usage": True}))
    finals = [c.choices[0].finish_reason for c in pieces if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0] in ("stop", "length")
    assert 1 <= pieces[-1].usage.completion_tokens <= 12
    plain = client.completions.create(model="sep-s", prompt=QUESTIONS[3], max_tokens=8, temperature=0)
    assert plain.model == "sep-s" and plain.choices[0].finish_reason in ("stop", "length")


def test_greedy_replies_of_the_large_member_end_with_stop(url):
    """sep-l was trained to close its replies with <|eot|>: greedy, EOS honoured, every reply ends with stop or
    at the cap, and at least one of the questions ends with stop before the cap."""
    client = _client(url)
    reasons = []
    for question in QUESTIONS:
        reply = client.chat.completions.create(model="sep-l", messages=[{"role": "user", "content": question}],
                                               max_tokens=REPLY_CAP, temperature=0)
        reason = reply.choices[0].finish_reason
        assert reason in ("stop", "length") and reply.model == "sep-l"
        assert reason == "stop" or reply.usage.completion_tokens == REPLY_CAP
        reasons.append((reason, reply.usage.completion_tokens))
    assert any(reason == "stop" for reason, _ in reasons), reasons
