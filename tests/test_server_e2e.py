"""End to end: the real LocalServing on the tiny family behind a real uvicorn server, via the `openai` client."""
from __future__ import annotations

import time

import httpx
import openai
import pytest

from orchestrator.core.config import load_config
from orchestrator.serve.server import ServerSettings, create_app
from tests.fakes_serving import family_dir, serve_in_thread

from orchestrator.serve.factory import build_serving_engine  # noqa: E402

FAMILY_DIR = family_dir()
QUESTION = ("I am planning a long walk along the river this weekend with two friends and a dog. "
            "What should we pack, how far can we go in a day, and where should we stop for lunch?")


@pytest.fixture(scope="module")
def served():
    config = load_config(None, {"family": str(FAMILY_DIR), "pool.num_pages": 1024, "pool.host_tier_mb": 0,
                                "engine.device": "cpu", "engine.num_threads": 1})
    engine = build_serving_engine(config)
    app = create_app(engine, engine.tokenizer, engine.family, ServerSettings(request_timeout_s=60))
    with serve_in_thread(app, timeout_s=120) as url:
        yield engine, url


def test_chat_answers_and_second_turn_hits_the_cache(served):
    engine, url = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": QUESTION}]
    started = time.monotonic()
    first = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0,
                                           extra_headers={"X-Session-ID": "e2e-1"})
    print(f"first turn: {time.monotonic() - started:.2f} s, model {first.model}, usage {first.usage}")
    assert first.model in engine.family.member_names
    assert first.choices[0].finish_reason in ("stop", "length")
    assert 1 <= first.usage.completion_tokens <= 16
    assert first.choices[0].finish_reason == "stop" or first.usage.completion_tokens == 16
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    prompt = engine.tokenizer.apply_chat_template(messages)
    # The same conversation again on the member that answered: its prompt is cached there, every whole block
    # short of the last token (always recomputed: its logits start decoding). 16 tokens per block here.
    again = client.chat.completions.create(model=first.model, messages=messages, max_tokens=1, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == 16 * ((len(prompt) - 1) // 16) > 0
    # The second turn on that member: the first turn's prompt blocks come from the cache at least (the answer's
    # own blocks too, as far as the answer's text re-tokenizes to the generated ids).
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And if it rains?"}]
    second = client.chat.completions.create(model=first.model, messages=messages, max_tokens=8, temperature=0)
    print(f"second turn: model {second.model}, usage {second.usage}, mfs {second.model_extra.get('mfs')}")
    assert engine.tokenizer.apply_chat_template(messages)[:len(prompt)] == prompt
    assert second.usage.prompt_tokens_details.cached_tokens >= 16 * (len(prompt) // 16)


def test_streaming_answer_and_pages_return(served):
    engine, url = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    chunks = list(client.completions.create(model="tiny", prompt=QUESTION, max_tokens=12, stream=True,
                                            stream_options={"include_usage": True}))
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0] in ("stop", "length")
    assert 1 <= chunks[-1].usage.completion_tokens <= 12
    assert finals[0] == "stop" or chunks[-1].usage.completion_tokens == 12
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        stats = httpx.get(url + "/v1/stats").json()
        if stats["pages"]["by_state"]["used"] == 0:
            break
        time.sleep(0.05)
    assert stats["pages"]["by_state"]["used"] == 0


def test_one_api_key_cannot_learn_what_another_cached():
    """With API keys, each key's prompts are hashed under its own salt: a prompt another key cached is a miss
    (`cached_tokens` 0), the same key's repeat a hit; a client's own cache_salt still splits within a key."""
    config = load_config(None, {"family": str(FAMILY_DIR), "pool.num_pages": 512, "pool.host_tier_mb": 0,
                                "engine.device": "cpu", "engine.num_threads": 1, "engine.process": "thread",
                                "escalation.enabled": False})
    engine = build_serving_engine(config)
    settings = ServerSettings(api_keys=("tenant-a-key", "tenant-b-key"), request_timeout_s=60)
    app = create_app(engine, engine.tokenizer, engine.family, settings)
    with serve_in_thread(app, timeout_s=120) as url:
        def cached(key: str, **extra) -> int:
            client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)
            answer = client.completions.create(model="tiny-s", prompt=QUESTION, max_tokens=1, temperature=0,
                                               extra_body=extra)
            return answer.usage.prompt_tokens_details.cached_tokens
        assert cached("tenant-a-key") == 0
        assert cached("tenant-a-key") > 0                  # the same key: its own cache
        assert cached("tenant-b-key") == 0                 # another key learns nothing of it
        assert cached("tenant-a-key", cache_salt="private") == 0
