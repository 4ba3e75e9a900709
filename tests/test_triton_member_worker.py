"""The Triton python-backend model's MemberWorker without Triton: it runs the core's EngineCore loop over the
local executor and must answer exactly as LocalServing does (tokens, prefix-cache hits, errors, cancellation)."""
from __future__ import annotations

import asyncio
import importlib.util
import sys
import time
from concurrent.futures import Future

import pytest

from orchestrator.core.config import load_config
from tests.fakes_serving import REPO, family_dir
from tests.triton_helpers import collect, make_request

FAMILY = family_dir()
MEMBER = "tiny-s"
NUM_PAGES, PAGE_BYTES, DTYPE = 1024, 16384, "float32"


def load_model_module():
    path = REPO / "engines" / "triton" / "python_model" / "model.py"
    spec = importlib.util.spec_from_file_location("mfs_python_model_under_test", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module      # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


MODEL = load_model_module()


@pytest.fixture(scope="module")
def worker():
    w = MODEL.MemberWorker(str(FAMILY), MEMBER, NUM_PAGES, PAGE_BYTES, DTYPE)
    w.start()
    yield w
    w.stop()


def run(worker, token_ids, max_tokens, streaming=True, cancelled=lambda: False) -> tuple[list, Future]:
    chunks = []
    inputs = MODEL.GenerationInputs(token_ids=list(token_ids), max_tokens=max_tokens, end_id=-1, streaming=streaming)
    done = worker.submit(inputs, chunks.append, cancelled)
    done.result(timeout=120)
    return chunks, done


def prompt_ids(tokenizer, text="Tell me about rivers, lakes and the sea, and why the sea is salty but rivers are not."):
    return tokenizer.encode(text)


def local_greedy(prompt: list[int], max_tokens: int, family: str = str(FAMILY), member: str = MEMBER) -> list[int]:
    from orchestrator.serve.serving import LocalServing

    config = load_config(None, {"family": family, "pool.num_pages": NUM_PAGES, "pool.page_bytes": PAGE_BYTES,
                                "engine.dtype": DTYPE, "engine.device": "cpu", "engine.num_threads": 1,
                                "escalation.enabled": False, "pool.host_tier_mb": 0.0})

    async def go():
        local = LocalServing(config)
        await local.start()
        try:
            return (await collect(local, make_request("local", prompt, max_tokens, member)))[0]
        finally:
            await local.stop(1.0)
    return asyncio.run(go())


def test_worker_streams_the_local_engines_greedy_tokens_then_hits_its_cache(worker, tokenizer):
    prompt = prompt_ids(tokenizer)
    chunks, _ = run(worker, prompt, 8)
    tokens = [t for c in chunks for t in c.token_ids]
    assert tokens == local_greedy(prompt, 8)
    assert len(chunks) == 8 and chunks[-1].final and not any(c.final for c in chunks[:-1])
    assert all(c.error is None for c in chunks) and chunks[0].num_cached_prompt_tokens == 0
    # The same prompt again, non-streaming: one chunk, and every full block before the last prompt token
    # (always recomputed: its logits start decoding) comes from the cache.
    tpb = worker.kv.tokens_per_block
    again, _ = run(worker, prompt, 8, streaming=False)
    assert len(again) == 1 and again[0].final and again[0].token_ids == tokens
    assert again[0].num_cached_prompt_tokens == tpb * ((len(prompt) - 1) // tpb)
    assert worker.kv.reused_blocks_total == (len(prompt) - 1) // tpb
    metrics = worker.kv_metrics()
    assert metrics["used"] == 0 and metrics["max"] == NUM_PAGES // worker.family.member(MEMBER).num_layers


def test_worker_reports_invalid_requests_and_frees_cancelled_ones(worker, tokenizer):
    context = worker.family.member(MEMBER).context_tokens
    chunks, _ = run(worker, [5] * context, 4)
    assert len(chunks) == 1 and chunks[0].final and chunks[0].error.startswith("InvalidRequestError")
    seen = []
    chunks, done = run(worker, prompt_ids(tokenizer, "Cancel me after the first token."), 200,
                       cancelled=lambda: bool(seen.append(1) or len(seen) > 1))
    assert len(chunks) == 1 and not chunks[0].final          # nothing more after the client went away
    deadline = time.monotonic() + 30
    while worker.core.has_work() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not worker.core.has_work() and worker.kv_metrics()["used"] == 0


def test_a_separate_family_member_answers_as_the_local_engine_does(tokenizer):
    """A member of the separate-weight family (tiny-sep's sep-l: no layer shared with another member) in its own
    Triton model answers a chat prompt as LocalServing pinned to it does, ending where it emits EOS (end_id)."""
    worker = MODEL.MemberWorker("tiny-sep", "sep-l", NUM_PAGES, PAGE_BYTES, DTYPE)
    worker.start()
    try:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Why is the sea salty?"}])
        chunks = []
        inputs = MODEL.GenerationInputs(token_ids=prompt, max_tokens=24, streaming=True,
                                        end_id=worker.family.member("sep-l").eos_token_ids[0])
        worker.submit(inputs, chunks.append, lambda: False).result(timeout=120)
        assert [t for c in chunks for t in c.token_ids] == local_greedy(prompt, 24, "tiny-sep", "sep-l")
        assert chunks[-1].final and all(c.error is None for c in chunks)
    finally:
        worker.stop()
