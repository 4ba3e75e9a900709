"""Nested self-speculation: a greedy decode on a large member drafts with the smallest member nested in it and
checks the drafts in the step's own forward (engines/local/speculation.py, the scheduler's draft slots). The
tokens are the member's own greedy tokens whatever the drafts; accepted drafts save steps; every page returns."""
from __future__ import annotations

import pytest
import torch

from conftest_engine import llama_config, nested_family_on_disk, qwen2_config
from engines.local.executor import LocalExecutor
from engines.local.speculation import accepted
from orchestrator.core.complexity import ComplexityEstimator
from orchestrator.core.config import load_config
from orchestrator.core.engine_core import EngineCore
from orchestrator.core.family import load_family
from orchestrator.core.types import MemberName, Request, RequestId, SampledToken, SamplingParams
from tests.fakes import fake_config
from tests.test_scheduler import Harness

PAGE_BYTES = 1500          # 4 tokens per block (fp32, 2 kv heads x 16 dims); a residual block fits a page
DEPTHS = {"s": 2, "m": 3, "l": 5}


def _silent_upper_layers(large) -> None:
    """Layers from the smallest member's depth on add nothing to the residual stream, so every member's greedy
    token is the smallest one's: each draft is accepted."""
    with torch.no_grad():
        for layer in large.model.layers[DEPTHS["s"]:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()


def _core(root, drafts: int, **overrides) -> EngineCore:
    config = load_config(overrides={"family": str(root), "pool.page_bytes": PAGE_BYTES, "pool.num_pages": 512,
                                    "pool.host_tier_mb": 0, "pool.disk_tier_mb": 0,
                                    "scheduler.self_speculation_tokens": drafts, **overrides})
    family = load_family(root)
    core = EngineCore(config, family, ComplexityEstimator(()), lambda: 0.0)
    core.executor = LocalExecutor(family, config.num_arena_pages(), PAGE_BYTES)
    return core


def _generate(core: EngineCore, requests: dict[str, tuple[str, int]], temperature: float = 0.0) -> dict[str, list]:
    """requests: id -> (pinned member, new tokens); all submitted at once, stepped until idle."""
    got: dict[str, list] = {}
    for n, (rid, (member, max_tokens)) in enumerate(requests.items()):
        got[rid] = []
        prompt = [(7 * i + 3 * n + 5) % 250 + 3 for i in range(9 + 4 * n)]
        core.add_request(Request(request_id=RequestId(rid), prompt_token_ids=prompt,
                                 sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                         temperature=temperature, seed=1),
                                 arrival_s=0.0, pinned_member=MemberName(member)),
                         lambda out, rid=rid: got[rid].extend(out.new_token_ids))
    for _ in range(500):
        if not core.has_work():
            return got
        core.step()
    raise AssertionError("never idle")


@pytest.mark.parametrize("config_factory", [llama_config, qwen2_config], ids=["llama", "qwen2"])
def test_drafts_change_the_steps_never_the_tokens(tmp_path, config_factory):
    root = nested_family_on_disk(tmp_path, config_factory, DEPTHS)
    requests = {"a": ("l", 23), "b": ("m", 17), "c": ("l", 11), "d": ("s", 9)}
    plain = _generate(_core(root, 0), requests)
    for drafts in (1, 3):
        core = _core(root, drafts)
        assert _generate(core, requests) == plain        # random weights: most drafts are rejected, some not
        assert core.pool.counts()["used"] == 0
    assert [len(plain[r]) for r in requests] == [23, 17, 11, 9]


def test_accepted_drafts_save_steps_exactly(tmp_path):
    root = nested_family_on_disk(tmp_path, llama_config, DEPTHS, prepare=_silent_upper_layers)
    plain_core, core = _core(root, 0), _core(root, 2)
    plain = _generate(plain_core, {"a": ("l", 12)})
    assert _generate(core, {"a": ("l", 12)}) == plain
    # one prefill step gives the first token; then 3 tokens a step (2 drafts, both accepted) while 3 or more
    # remain, and the last step drafts one: 1 + 3 + 3 + 3 + 2 = 12 tokens in 5 steps instead of 12
    assert (plain_core.num_steps, core.num_steps) == (12, 5)
    assert core.pool.counts()["used"] == 0


def test_no_drafts_when_sampling_or_when_many_decode(tmp_path):
    root = nested_family_on_disk(tmp_path, llama_config, DEPTHS, prepare=_silent_upper_layers)
    sampled = _core(root, 2)
    _generate(sampled, {"a": ("l", 12)}, temperature=0.8)
    assert sampled.num_steps == 12                       # sampling: one token a step
    crowded = _core(root, 2, **{"scheduler.self_speculation_max_decodes": 1})
    _generate(crowded, {"a": ("l", 12), "b": ("l", 12)})
    assert crowded.num_steps == 12                       # two decode at once, above the limit of one


def test_accepted_keeps_the_tokens_while_the_drafts_were_right():
    def tokens(*ids):
        return [SampledToken(RequestId("r"), t, -0.1, 0.9) for t in ids]
    assert [t.token_id for t in accepted(tokens(5, 6, 7), [5, 6])] == [5, 6, 7]
    assert [t.token_id for t in accepted(tokens(5, 8, 7), [5, 6])] == [5, 8]     # 2nd draft wrong: row 2 read it
    assert [t.token_id for t in accepted(tokens(4, 6, 7), [5, 6])] == [4]        # 1st draft wrong
    assert [t.token_id for t in accepted(tokens(9), [])] == [9]


# ----------------------------------------------------------------------------- the scheduler's draft slots (fakes)
def _draft_plan(harness: Harness, rid: str) -> list:
    """draft_tokens and positions covered of the request's chunks, one entry per step until it finishes."""
    seen = []
    while harness.scheduler.has_work():
        plan = harness.step()
        for batch in plan.batches:
            for chunk in batch.chunks:
                if chunk.request_id == rid and len(chunk.token_ids) == 1:
                    covered = len(chunk.block_tables[0]) * 4
                    seen.append((chunk.draft_tokens, covered >= chunk.start_pos + 1 + chunk.draft_tokens))
    return seen


def test_scheduler_slots_drafts_only_within_max_tokens_and_only_where_a_member_nests():
    harness = Harness(**{"scheduler.self_speculation_tokens": 3})
    harness.submit("a", range(10, 22), max_tokens=6, pinned_member=MemberName("l"))
    # the fake engine returns one token a step: drafts shrink as max_tokens nears, slots always cover them
    assert _draft_plan(harness, "a") == [(3, True), (3, True), (2, True), (1, True), (0, True)]
    assert harness.pool.counts()["used"] == 0
    small = Harness(**{"scheduler.self_speculation_tokens": 3})
    small.submit("b", range(10, 22), max_tokens=4, pinned_member=MemberName("s"))
    assert [d for d, _ in _draft_plan(small, "b")] == [0, 0, 0]       # nothing nests in the smallest member


def test_draft_slots_under_page_pressure():
    """The tight pool of test_scheduler's preemption test: with the default peak reservation draft slots come
    out of each request's own reserved demand, so still nothing is preempted; with the overcommitting one-block
    reserve requests are preempted and resume with the same tokens. Every page returns."""
    prompt = list(range(10, 30))
    reference = Harness()
    for i in range(4):
        reference.submit(f"r{i}", [i + 3] + prompt, max_tokens=20, pinned_member=MemberName("l"))
    reference.run()
    for reservation in ("peak", "block"):
        tight = Harness(**{"pool.num_pages": 84, "scheduler.decode_reservation": reservation,
                           "scheduler.self_speculation_tokens": 3, "scheduler.self_speculation_max_decodes": 8})
        for i in range(4):
            tight.submit(f"r{i}", [i + 3] + prompt, max_tokens=20, pinned_member=MemberName("l"))
        tight.run(2000)
        preemptions = tight.scheduler.snapshot(tight.now)["counters"]["preemptions"]
        assert (preemptions > 0) is (reservation == "block")
        assert all(tight.tokens(f"r{i}") == reference.tokens(f"r{i}") for i in range(4))
        assert tight.pool.counts()["used"] == 0
    assert fake_config().scheduler.self_speculation_tokens == 0      # off by default
