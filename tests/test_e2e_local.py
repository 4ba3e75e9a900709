"""End to end on the shipped tiny family through the real local engine (LocalServing): a multi-turn
session hitting its own cache, an exact escalation handover mid-stream and a disk-tier hit after restart."""
from __future__ import annotations

import asyncio
import time

from eval.composition import core_parts, load_system_config
from orchestrator.serve.serving import LocalServing
from orchestrator.core.types import MemberName, Request, RequestId, SamplingParams

FAMILY = "tiny"
QUESTION = [{"role": "user", "content": "I am building a small key-value store for a web service. Explain how a hash "
             "map handles collisions, step by step, with an example in plain words, and say what happens to the "
             "lookup cost when the table gets full and why resizing helps."}]


def run(coro):
    return asyncio.run(coro)


async def generate(engine, rid, prompt, max_tokens=12, pinned=None, session=None):
    request = Request(request_id=RequestId(rid), prompt_token_ids=list(prompt),
                      sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True), arrival_s=time.monotonic(),
                      pinned_member=MemberName(pinned) if pinned else None, session_id=session)
    outputs = [out async for out in engine.generate(request)]
    return [t for out in outputs for t in out.new_token_ids], outputs[-1]


def engine_for(**overrides):
    base = {"family": FAMILY, "pool.num_pages": 600, "pool.host_tier_mb": 0, "comparison.warmup": False}
    base.update(overrides)
    config = load_system_config(base)          # without warm-ups: eval's composition of that switch
    return LocalServing(config, **core_parts(config))


def test_second_turn_of_a_session_hits_its_cache():
    async def scenario():
        engine = engine_for(**{"escalation.enabled": False})
        await engine.start()
        try:
            prompt = engine.tokenizer.apply_chat_template(QUESTION)
            first, final1 = await generate(engine, "t1", prompt, session="sess")
            turn2 = engine.tokenizer.apply_chat_template(
                QUESTION + [{"role": "assistant", "content": engine.tokenizer.decode(first)},
                            {"role": "user", "content": "And how does resizing work?"}])
            _, final2 = await generate(engine, "t2", turn2, session="sess")
            return prompt, first, turn2, final1, final2, engine.stats()
        finally:
            await engine.stop()

    prompt, first, turn2, final1, final2, stats = run(scenario())
    assert final1.num_cached_prompt_tokens == 0
    assert len(prompt) >= 48
    assert final2.member == final1.member                                 # affinity kept the session in place
    # Exactly what turn 1 left cached on that member: the whole blocks of its prompt + generated tokens (but the
    # last generated one, whose KV was never computed) that turn 2 repeats, short of turn 2's last token.
    cached = prompt + first[:-1]
    shared = 0
    while shared < min(len(cached), len(turn2) - 1) and cached[shared] == turn2[shared]:
        shared += 1
    assert shared >= len(prompt)
    assert final2.num_cached_prompt_tokens == 16 * (shared // 16)
    assert stats["pages"]["by_state"]["used"] == 0 and stats["pages"]["by_state"]["cached"] > 0


def test_escalation_hands_over_mid_stream_exactly():
    async def scenario():
        # threshold above 1: every window looks unconfident, so s -> m -> l after 4 tokens on each
        engine = engine_for(**{"escalation.threshold": 1.01, "escalation.min_tokens": 4,
                               "escalation.window_tokens": 4, "router.complexity_thresholds": [0.99, 0.995]})
        await engine.start()
        try:
            prompt = engine.tokenizer.apply_chat_template(QUESTION)
            tokens, final = await generate(engine, "esc", prompt, max_tokens=16)
            # reference: tiny-l alone continuing from what s and m produced
            reference, _ = await generate(engine, "ref", prompt + tokens[:8], max_tokens=8, pinned="tiny-l")
            stats = engine.stats()
            return tokens, final, reference, stats
        finally:
            await engine.stop()

    tokens, final, reference, stats = run(scenario())
    assert [(s.member, s.num_tokens) for s in final.spans] == [("tiny-s", 4), ("tiny-m", 4), ("tiny-l", 8)]
    assert final.member == "tiny-l" and len(tokens) == 16
    assert tokens[8:] == reference       # the handover (shared layers + residuals) changed nothing
    assert stats["counters"]["escalations"]["tiny-s->tiny-m"] == 1
    assert stats["counters"]["escalations"]["tiny-m->tiny-l"] == 1


def test_disk_tier_answers_after_restart(tmp_path):
    disk = {"pool.disk_tier_mb": 64, "pool.disk_dir": str(tmp_path), "pool.num_pages": 200,
            "escalation.enabled": False}

    async def first_life():
        engine = engine_for(**disk)
        await engine.start()
        try:
            prompt = engine.tokenizer.apply_chat_template(QUESTION * 3)
            tokens, _ = await generate(engine, "long", prompt, pinned="tiny-m")
            for i in range(6):   # push the long prompt's pages out of the small arena, onto disk
                other = engine.tokenizer.apply_chat_template([{"role": "user", "content": f"unrelated {i} " * 40}])
                await generate(engine, f"other{i}", other, pinned="tiny-m")
            return prompt, tokens, engine.stats()
        finally:
            await engine.stop()

    async def second_life(prompt):
        engine = engine_for(**disk)
        await engine.start()
        try:
            tokens, final = await generate(engine, "again", prompt, pinned="tiny-m")
            return tokens, final, engine.stats()
        finally:
            await engine.stop()

    prompt, tokens, stats1 = run(first_life())
    assert stats1["pages"]["by_state"]["disk"] > 0
    tokens2, final, stats2 = run(second_life(prompt))
    assert tokens2 == tokens
    assert final.num_cached_prompt_tokens >= 16
    # A fresh arena: every hit of the second life came off the disk.
    assert stats2["counters"]["prefix_hit_tokens"]["tiny-m"] == {"arena": 0, "host": 0,
                                                                 "disk": final.num_cached_prompt_tokens}


