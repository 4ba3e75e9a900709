"""Seeded ShareGPT workloads: determinism, the multi-turn prefix property, caps, arrivals, mix proportions."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from orchestrator.sharegpt import Conversation
from eval.workloads import MIXED_PROPORTIONS, WorkloadSpec, build_trace, kind_counts, poisson_arrivals
from orchestrator.core.family import SHIPPED_FAMILIES_DIR


def family_dir() -> Path:
    """The shipped tiny family."""
    return SHIPPED_FAMILIES_DIR / "tiny"


@pytest.fixture(scope="module")
def tokenizer():
    from orchestrator.serve.tokenizer import FamilyTokenizer

    return FamilyTokenizer(family_dir() / "tiny-s")


@pytest.fixture(scope="module")
def conversations() -> list[Conversation]:
    from orchestrator.sharegpt import iter_conversations

    return list(iter_conversations(limit=400))


def _spec(**kwargs) -> WorkloadSpec:
    base = dict(name="multiturn", num_sessions=12, rate_sessions_per_s=2.0, seed=3, max_prompt_tokens=512,
                max_output_tokens=64, max_turns=4)
    return WorkloadSpec(**{**base, **kwargs})


def _flat(trace):
    return [(s.session_id, s.kind, s.conversation_id, [(t.prompt_token_ids, t.max_tokens, t.think_time_s)
                                                       for t in s.turns]) for s in trace.sessions]


def test_same_seed_same_trace_other_seed_other_trace(tokenizer, conversations):
    a = build_trace(_spec(), tokenizer, conversations)
    b = build_trace(_spec(), tokenizer, conversations)
    c = build_trace(_spec(seed=4), tokenizer, conversations)
    assert _flat(a) == _flat(b) and a.arrival_times_s == b.arrival_times_s
    assert _flat(a) != _flat(c)


def test_turn_k_prompt_extends_turn_k_minus_1(tokenizer, conversations):
    trace = build_trace(_spec(), tokenizer, conversations)
    assert all(len(s.turns) >= 2 for s in trace.sessions)
    for session in trace.sessions:
        for prev, cur in zip(session.turns, session.turns[1:]):
            assert len(cur.prompt_token_ids) > len(prev.prompt_token_ids)
            assert cur.prompt_token_ids[: len(prev.prompt_token_ids)] == prev.prompt_token_ids
            assert cur.think_time_s > 0
        assert session.turns[0].think_time_s == 0.0


def test_caps_respected(tokenizer, conversations):
    spec = _spec(name="mixed", num_sessions=20, max_prompt_tokens=300, max_output_tokens=32, max_turns=3,
                 long_min_prompt_tokens=200)
    trace = build_trace(spec, tokenizer, conversations)
    assert trace.sessions
    for session in trace.sessions:
        assert 1 <= len(session.turns) <= 3
        for turn, sent in zip(session.turns, trace.prompt_lengths(session)):   # what the replay sends
            assert sent <= 300
            assert 1 <= turn.max_tokens <= 32
            assert sent + turn.max_tokens <= spec.context_tokens


def test_output_length_is_the_real_reply_length(tokenizer):
    reply = "one two three four five six seven"
    conv = Conversation("c0", ({"role": "user", "content": "hello there"}, {"role": "assistant", "content": reply}))
    trace = build_trace(_spec(name="single", num_sessions=1, max_output_tokens=1000), tokenizer, [conv])
    (turn,) = trace.sessions[0].turns
    assert turn.max_tokens == len(tokenizer.encode(reply, add_special_tokens=False))
    assert turn.prompt_token_ids == tokenizer.apply_chat_template([conv.messages[0]], add_generation_prompt=True)


def test_poisson_arrivals_ordered_with_the_right_rate():
    times = poisson_arrivals(4000, 2.0, random.Random(0))
    assert times[0] == 0.0 and times == sorted(times)
    mean_gap = times[-1] / (len(times) - 1)
    assert mean_gap == pytest.approx(0.5, rel=0.05)


def test_trace_arrivals_ordered(tokenizer, conversations):
    trace = build_trace(_spec(), tokenizer, conversations)
    assert len(trace.arrival_times_s) == len(trace.sessions)
    assert trace.arrival_times_s == sorted(trace.arrival_times_s)


@pytest.mark.parametrize("n", [1, 7, 10, 33])
def test_mixed_counts_have_the_proportions(n):
    counts = kind_counts("mixed", n)
    assert sum(counts.values()) == n
    for kind, share in MIXED_PROPORTIONS.items():
        assert abs(counts[kind] - share * n) < 1
    assert kind_counts("multiturn", n) == {"multiturn": n, "short": 0, "long": 0}
    assert kind_counts("single", n) == {"multiturn": 0, "short": n, "long": 0}


def test_three_mixes_on_sharegpt(tokenizer, conversations):
    mixed = build_trace(_spec(name="mixed", num_sessions=10), tokenizer, conversations)
    kinds = [s.kind for s in mixed.sessions]
    assert {k: kinds.count(k) for k in MIXED_PROPORTIONS} == {"short": 3, "long": 2, "multiturn": 5}
    for s in mixed.sessions:
        if s.kind == "short":
            assert len(s.turns) == 1 and len(s.turns[0].prompt_token_ids) <= 128
        if s.kind == "long":
            assert len(s.turns) == 1 and len(s.turns[0].prompt_token_ids) >= 256
    single = build_trace(_spec(name="single", num_sessions=10), tokenizer, conversations)
    assert all(len(s.turns) == 1 for s in single.sessions)
    assert len({s.conversation_id for s in single.sessions}) == 10     # every request new
    multi = build_trace(_spec(num_sessions=10), tokenizer, conversations)
    assert all(s.kind == "multiturn" and len(s.turns) >= 2 for s in multi.sessions)


def test_saved_trace_replays_exactly_and_refuses_other_tokenizers_and_formats(tokenizer, conversations, tmp_path):
    from eval.workloads import TraceFileError, load_trace, save_trace

    trace = build_trace(_spec(name="mixed"), tokenizer, conversations)
    path = tmp_path / "trace.json"
    save_trace(trace, path, tokenizer_hash="tok-a")
    back = load_trace(path, tokenizer_hash="tok-a")
    assert _flat(back) == _flat(trace) and back.arrival_times_s == trace.arrival_times_s
    assert back.spec == trace.spec and back.summary() == trace.summary()
    with pytest.raises(TraceFileError, match="tokeniser|tokenizer"):
        load_trace(path, tokenizer_hash="tok-b")            # token ids of another vocabulary: refused
    assert [t.user_token_ids for s in back.sessions for t in s.turns] == \
        [t.user_token_ids for s in trace.sessions for t in s.turns]
    (tmp_path / "other.json").write_text('{"format": "something-else"}')
    assert [t.reference_token_ids for s in back.sessions for t in s.turns] == \
        [t.reference_token_ids for s in trace.sessions for t in s.turns]
    with pytest.raises(TraceFileError, match="not an mfs-trace/3 file"):
        load_trace(tmp_path / "other.json", tokenizer_hash="tok-a")
    (tmp_path / "broken.json").write_text('{"format": "mfs-trace/2", "tokenizer_hash": "tok-a", "spec": {}}')
    with pytest.raises(TraceFileError, match="malformed"):
        load_trace(tmp_path / "broken.json", tokenizer_hash="tok-a")
    with pytest.raises(TraceFileError, match="cannot read"):
        load_trace(tmp_path / "missing.json", tokenizer_hash="tok-a")


def test_each_turn_carries_the_first_max_tokens_tokens_of_the_datasets_reply(tokenizer, conversations, tmp_path):
    import json

    from eval.workloads import load_trace, save_trace

    trace = build_trace(_spec(name="mixed", max_output_tokens=48), tokenizer, conversations)
    by_id = {c.conversation_id: c for c in conversations}
    checked = 0
    for session in trace.sessions:
        messages = by_id[session.conversation_id].messages
        replies = [m["content"] for m in messages[1::2]]
        for turn in session.turns:
            encoded = [tokenizer.encode(r, add_special_tokens=False)[: turn.max_tokens] for r in replies]
            assert turn.reference_token_ids in encoded and len(turn.reference_token_ids) == turn.max_tokens
            checked += 1
    assert checked >= 12
    # a format-2 file (no references) still loads, with empty references
    path = tmp_path / "t.json"
    save_trace(trace, path, tokenizer_hash="tok")
    data = json.loads(path.read_text())
    data["format"] = "mfs-trace/2"
    for s in data["sessions"]:
        for t in s["turns"]:
            del t["reference_token_ids"]
    path.write_text(json.dumps(data))
    old = load_trace(path, tokenizer_hash="tok")
    assert old.spec.history == trace.spec.history and all(not t.reference_token_ids for s in old.sessions for t in s.turns)


# ----------------------------------------------------------------------------- closed-loop history
def test_closed_history_appends_our_reply_then_the_user_part(tokenizer, conversations):
    """Turn k+1 = turn k's prompt + the reply the system generated + the next user message, via the template."""
    from eval.workloads import closed_prompt_lengths, next_prompt

    trace = build_trace(_spec(), tokenizer, conversations)
    assert trace.spec.history == "closed"
    session = next(s for s in trace.sessions if len(s.turns) >= 3)
    first = session.turns[0]
    assert first.user_token_ids == first.prompt_token_ids        # the first prompt is the whole first user turn
    prompt, lengths = None, []
    reply = None
    for k, turn in enumerate(session.turns):
        prompt = next_prompt(turn, prompt, reply, "closed")
        lengths.append(len(prompt))
        if k:
            text = tokenizer.decode(turn.user_token_ids, skip_special_tokens=False)
            # the previous reply is closed, the next user message follows, then the generation prompt
            assert text.startswith("<|eot|>") and "<|user|>" in text and text.endswith("<|assistant|>\n")
            assert prompt[-len(turn.user_token_ids):] == turn.user_token_ids
        reply = [1000 + k] * turn.max_tokens                    # what a system generated (any tokens)
    assert lengths == closed_prompt_lengths(session.turns) == trace.prompt_lengths(session)
    # the dataset history re-sends ShareGPT's reply: its prompts are the templated dataset conversation
    assert next_prompt(session.turns[1], prompt, reply, "dataset") == session.turns[1].prompt_token_ids


def test_closed_history_user_part_matches_the_template(tokenizer):
    """Dataset prompt of turn 2 == turn 1's prompt + ShareGPT's reply (as the template renders it) + user part."""
    conv = Conversation("c0", ({"role": "user", "content": "hello there"},
                               {"role": "assistant", "content": "general kenobi"},
                               {"role": "user", "content": "what now"},
                               {"role": "assistant", "content": "we talk"}))
    trace = build_trace(_spec(num_sessions=1), tokenizer, [conv])
    t0, t1 = trace.sessions[0].turns
    reply = tokenizer.encode("general kenobi", add_special_tokens=False)
    assert t1.prompt_token_ids == [*t0.prompt_token_ids, *reply, *t1.user_token_ids]


def test_dataset_history_is_the_old_replay(tokenizer, conversations):
    trace = build_trace(_spec(history="dataset"), tokenizer, conversations)
    for session in trace.sessions:
        assert trace.prompt_lengths(session) == [len(t.prompt_token_ids) for t in session.turns]
    with pytest.raises(ValueError, match="history"):
        _spec(history="open")


def test_at_rate_scales_arrivals_and_keeps_sessions(tokenizer, conversations):
    trace = build_trace(_spec(rate_sessions_per_s=1.0), tokenizer, conversations)
    faster = trace.at_rate(4.0)
    assert faster.sessions is trace.sessions and faster.spec.rate_sessions_per_s == 4.0
    assert faster.arrival_times_s == pytest.approx([t / 4 for t in trace.arrival_times_s])
    assert faster.spec.seed == trace.spec.seed and faster.summary()["num_requests"] == trace.num_requests


def test_format_1_trace_replays_with_dataset_history(tokenizer, conversations, tmp_path):
    import json

    from eval.workloads import TraceFileError, load_trace, save_trace, with_history

    trace = build_trace(_spec(history="dataset"), tokenizer, conversations)
    path = tmp_path / "old.json"
    save_trace(trace, path, tokenizer_hash="tok")
    data = json.loads(path.read_text())
    data["format"] = "mfs-trace/1"
    for s in data["sessions"]:
        for t in s["turns"]:
            del t["user_token_ids"]
    del data["spec"]["history"]
    path.write_text(json.dumps(data))
    old = load_trace(path, tokenizer_hash="tok")
    assert old.spec.history == "dataset" and any("format" in n or "mfs-trace/1" in n for n in old.notes)
    assert _flat(old) == _flat(trace)
    with pytest.raises(TraceFileError, match="--history dataset"):
        with_history(old, "closed")


class _EncodeEverything:
    """The tokenizer with no length bound: the trace builder then encodes every text it reads (the old way)."""

    def __init__(self, tokenizer):
        self._inner = tokenizer

    def max_token_bytes(self):
        return None

    def __getattr__(self, name):
        return getattr(self._inner, name)


@pytest.mark.parametrize("name,history", [("multiturn", "closed"), ("mixed", "closed"), ("multiturn", "dataset")])
def test_skipping_encodes_builds_the_same_trace(tokenizer, conversations, name, history):
    """Texts whose size alone decides are not encoded and turns past max_turns not tokenised: same trace exactly.
    Tight caps make the length bound decide often (long first messages, long replies)."""
    assert tokenizer.max_token_bytes() is not None and tokenizer.max_token_bytes() >= 13   # '<|assistant|>'
    for caps in (dict(max_prompt_tokens=256, max_output_tokens=16, max_turns=2),
                 dict(max_prompt_tokens=1024, max_output_tokens=128, max_turns=4)):
        spec = _spec(name=name, history=history, num_sessions=40, **caps)
        fast = build_trace(spec, tokenizer, conversations)
        slow = build_trace(spec, _EncodeEverything(tokenizer), conversations)
        assert _flat(fast) == _flat(slow)
        assert [[t.user_token_ids for t in s.turns] for s in fast.sessions] == \
               [[t.user_token_ids for t in s.turns] for s in slow.sessions]
        assert fast.notes == slow.notes


def test_saved_trace_is_asdict_of_the_trace(tokenizer, conversations, tmp_path):
    import json
    from dataclasses import asdict

    from eval.workloads import save_trace

    trace = build_trace(_spec(num_sessions=6), tokenizer, conversations)
    save_trace(trace, tmp_path / "t.json", "h")
    data = json.loads((tmp_path / "t.json").read_text())

    def saved(session):         # an unset complexity is left out (a trace without one keeps its bytes)
        return {k: v for k, v in asdict(session).items() if not (k == "complexity" and v is None)}

    assert data["sessions"] == [saved(s) for s in trace.sessions]
    assert list(data["sessions"][0]) == list(saved(trace.sessions[0]))          # same key order
    assert list(data["sessions"][0]["turns"][0]) == list(asdict(trace.sessions[0].turns[0]))


def test_a_traces_digest_is_the_sha256_of_its_saved_file(tokenizer, conversations, tmp_path):
    import hashlib

    from eval.workloads import save_trace, trace_digest

    trace = build_trace(_spec(name="mixed"), tokenizer, conversations)
    again = build_trace(_spec(name="mixed"), tokenizer, conversations)
    save_trace(trace, tmp_path / "a.json", tokenizer_hash="tok")
    save_trace(again, tmp_path / "b.json", tokenizer_hash="tok")
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()     # rebuilt byte for byte
    assert trace_digest(trace, "tok") == hashlib.sha256((tmp_path / "a.json").read_bytes()).hexdigest()
    assert trace_digest(build_trace(_spec(name="mixed", seed=4), tokenizer, conversations), "tok") != \
        trace_digest(trace, "tok")


def test_mix_phases_shift_the_share_of_the_largest_member_and_survive_a_save(tokenizer, conversations, tmp_path):
    from eval.workloads import load_trace, save_trace, trace_digest, with_mix_phases

    trace = build_trace(_spec(num_sessions=40, name="single"), tokenizer, conversations)
    mixed = with_mix_phases(trace, (0.9, 0.1), top_threshold=0.7, seed=3)
    assert all(s.complexity is None for s in trace.sessions)            # the input is left alone
    by_arrival = sorted(range(40), key=lambda i: mixed.arrival_times_s[i])
    first = [mixed.sessions[i].complexity >= 0.7 for i in by_arrival[:20]]
    second = [mixed.sessions[i].complexity >= 0.7 for i in by_arrival[20:]]
    assert sum(first) >= 14 and sum(second) <= 6                       # 0.9 and 0.1 of 20 sessions, seeded
    assert all(0.0 <= s.complexity < 1.0 for s in mixed.sessions)
    assert with_mix_phases(trace, (0.9, 0.1), 0.7, seed=3).sessions == mixed.sessions     # deterministic
    assert trace_digest(mixed, "h") != trace_digest(trace, "h")
    save_trace(mixed, tmp_path / "m.json", "h")
    assert [s.complexity for s in load_trace(tmp_path / "m.json", "h").sessions] == \
        [s.complexity for s in mixed.sessions]
    with pytest.raises(ValueError, match="between 0 and 1"):
        with_mix_phases(trace, (1.5,), 0.7, seed=3)


def test_a_sessions_complexity_goes_to_its_requests_as_the_hint(tokenizer, conversations):
    from eval.bench.sessions import ClosedLoopSessions
    from eval.workloads import with_mix_phases

    trace = with_mix_phases(build_trace(_spec(num_sessions=4), tokenizer, conversations), (1.0,), 0.7, seed=0)
    _, request = ClosedLoopSessions(trace, "t").start_turn(0, 0, 0.0, 0.0)
    assert request.complexity_hint == trace.sessions[0].complexity >= 0.7
    plain = build_trace(_spec(num_sessions=4), tokenizer, conversations)
    assert ClosedLoopSessions(plain, "t").start_turn(0, 0, 0.0, 0.0)[1].complexity_hint is None
