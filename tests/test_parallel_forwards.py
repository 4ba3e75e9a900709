"""developer.parallel_forwards: a step's forward split in two halves on two threads gives the tokens of one forward,
in chunk order, and a failing half fails the step instead of hanging it."""
from __future__ import annotations

import pytest

from engines.local.executor import LocalExecutor, split_point
from orchestrator.core.family import SHIPPED_FAMILIES_DIR, load_family
from orchestrator.core.types import MemberBatch, PageId, RequestId, SamplingParams, SeqChunk, StepPlan

GREEDY = SamplingParams(max_tokens=8)
BLOCK_TOKENS = 16
BLOCKS = 12


def _chunk(request: str, tokens: list[int], start: int, table: list[list[PageId]]) -> SeqChunk:
    return SeqChunk(request_id=RequestId(request), token_ids=tokens, start_pos=start, block_tables=table,
                    sample=True, sampling=GREEDY)


def test_split_point_balances_rows_and_keys():
    decode = lambda: _chunk("d", [5], 160, [])
    assert split_point([decode()]) == 0                                     # one chunk: nothing to split
    assert split_point([decode() for _ in range(32)]) == 16
    prefill = _chunk("p", list(range(128)), 0, [])
    assert split_point([decode() for _ in range(32)] + [prefill]) == 32     # the prefill chunk alone
    assert split_point([prefill] + [decode() for _ in range(32)]) == 1
    assert split_point([decode(), decode()]) == 1


@pytest.fixture(scope="module")
def family():
    return load_family(SHIPPED_FAMILIES_DIR / "tiny")


def _executors(family, member):
    page_bytes = BLOCK_TOKENS * member.kv_bytes_per_token_per_layer(4)
    return [LocalExecutor(family, num_pages=12 * member.num_layers * BLOCKS, page_bytes=page_bytes, num_threads=1,
                          parallel_forwards=n) for n in (1, 2)]


def test_two_halves_give_the_tokens_of_one_forward(family):
    member = family.members[-1]
    tables = [[[PageId(s * member.num_layers * BLOCKS + l * BLOCKS + b) for b in range(BLOCKS)]
               for l in range(member.num_layers)] for s in range(12)]
    prompts = [[(13 * i + 7 * s) % 4000 + 3 for i in range(24 + 5 * s)] for s in range(6)]
    results = []
    for executor in _executors(family, member):
        tokens = {s: [] for s in range(len(prompts))}
        # steps that mix prefill chunks and decodes, as the scheduler's do: three prompts first, the rest join
        pending = {s: (prompts[s], 0) for s in range(3)}
        for step in range(8):
            if step == 2:
                pending.update({s: (prompts[s], 0) for s in range(3, 6)})
            chunks = [_chunk(f"r{s}", toks, start, tables[s]) for s, (toks, start) in pending.items()]
            out = executor.execute(StepPlan(batches=[MemberBatch(member.name, chunks)]))
            assert [o.request_id for o in out] == [c.request_id for c in chunks]   # chunk order kept
            for (s, (toks, start)), o in zip(list(pending.items()), out):
                tokens[s].append(o.token_id)
                pending[s] = ([o.token_id], start + len(toks))
        results.append(tokens)
    assert results[0] == results[1]
    assert len({t for toks in results[0].values() for t in toks}) > 1


def test_a_failing_half_fails_the_step(family, monkeypatch):
    member = family.members[-1]
    executor = _executors(family, member)[1]
    tables = [[[PageId(s * member.num_layers * BLOCKS + l * BLOCKS + b) for b in range(BLOCKS)]
               for l in range(member.num_layers)] for s in range(2)]
    model = executor.model(member.name)
    original = model.forward

    def forward(arena, chunks, all_logits=False, exits=None):
        if any(c.request_id == "bad" for c in chunks):
            raise RuntimeError("half failed")
        return original(arena, chunks, all_logits=all_logits, exits=exits)
    monkeypatch.setattr(model, "forward", forward)
    chunks = [_chunk("good", [5, 6, 7], 0, tables[0]), _chunk("bad", [8, 9, 10], 0, tables[1])]
    with pytest.raises(RuntimeError, match="half failed"):
        executor.execute(StepPlan(batches=[MemberBatch(member.name, chunks)]))
    # the executor still works afterwards (the helper thread is not stuck)
    monkeypatch.setattr(model, "forward", original)
    out = executor.execute(StepPlan(batches=[MemberBatch(member.name, chunks)]))
    assert [o.request_id for o in out] == ["good", "bad"]


def test_bad_setting_is_refused(family):
    member = family.members[-1]
    with pytest.raises(ValueError, match="parallel_forwards must be 1 or 2"):
        LocalExecutor(family, num_pages=64, page_bytes=BLOCK_TOKENS * member.kv_bytes_per_token_per_layer(4),
                      parallel_forwards=3)


def test_default_is_two_only_for_a_one_thread_cpu_engine_in_its_own_process(monkeypatch):
    from orchestrator.serve import local_engine

    monkeypatch.setattr(local_engine.os, "sched_getaffinity", lambda pid: {0, 1})
    assert local_engine.parallel_forwards(None, "cpu", 1, own_process=True) == 2
    assert local_engine.parallel_forwards(None, "cpu", 1, own_process=False) == 1     # beside the event loop
    assert local_engine.parallel_forwards(None, "cuda", 1, own_process=True) == 1
    assert local_engine.parallel_forwards(None, "cpu", 3, own_process=True) == 1      # intra-op threads already
    assert local_engine.parallel_forwards(1, "cpu", 1, own_process=True) == 1         # configured wins
    assert local_engine.parallel_forwards(2, "cpu", 1, own_process=False) == 2
    monkeypatch.setattr(local_engine.os, "sched_getaffinity", lambda pid: {0})
    assert local_engine.parallel_forwards(None, "cpu", 1, own_process=True) == 1      # no second core
