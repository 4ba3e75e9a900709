"""Where a simulated run's device time went (eval/simulate/step_profile.py): the executor's per-step accounting
against the cost model's own prices, the sums across nodes, and what eval.simulate.speculation_floor reads from it
(the floor at the run's own batch and context)."""
from __future__ import annotations

from pathlib import Path

import pytest

from eval.simulate.cost_model import BatchShape, plan_shapes
from eval.simulate.executor import SimExecutor
from eval.simulate.speculation_floor import at_measured_batch, family_of, floors
from eval.simulate.step_profile import StepProfile
from eval.simulate.step_table import load_table
from orchestrator.core.types import MemberBatch, RequestId, SamplingParams, SeqChunk, StepPlan
from tests.fakes import independent_family
from tests.test_simulate import library
from tests.test_simulate_speculation import _table_model, verify_chunk

LLAMA = Path(__file__).resolve().parent.parent / "eval" / "simulate" / "tables" / "llama3.1_h200_sxm_trtllm_tp2-2.json"


def _chunk(request: str, tokens: int, start: int) -> SeqChunk:
    return SeqChunk(request_id=RequestId(request), token_ids=[5] * tokens, start_pos=start, block_tables=[[0]],
                    sample=True, sampling=SamplingParams(temperature=0.0))


def test_a_step_with_a_verify_a_decode_and_a_prompt_is_split_at_the_cost_models_prices():
    model = _table_model()
    family = independent_family()
    executor = SimExecutor(family, 64, 1024, model, library(members=("s", "l")), vocab_size=50)
    plan = StepPlan(batches=[MemberBatch("l", [verify_chunk("a", 500, 3, 3), _chunk("d", 1, 300),
                                               _chunk("p", 100, 0)])])
    shapes = plan_shapes(plan, family)
    tokens = executor.execute(plan)
    decoded = [t for t in tokens if t.request_id != "p"]
    assert len(tokens) == len(decoded) + 1                 # the prompt's last chunk gives its first token
    entry = executor.profile.summary()["l"]
    assert (entry["steps"], entry["requests"], entry["verify_rows"], entry["prompt_tokens"]) == (1, 2, 4, 100)
    assert entry["decode_tokens"] == len(decoded) and entry["context_tokens"] == 800
    batch = next(s for s in shapes if not s.draft)
    without = BatchShape("l", batch.decode_contexts, (), verifies=batch.verifies)
    assert entry["forward_s"] == pytest.approx(model.batch_s(batch))
    assert entry["prompt_s"] == pytest.approx(model.batch_s(batch) - model.batch_s(without))
    assert entry["prompt_s"] > 0
    assert entry["draft_s"] == pytest.approx(sum(model.batch_s(s) for s in shapes if s.draft))
    assert entry["step_s"] == pytest.approx(executor.last_step_s)
    # both decoding requests waited the whole step; over the tokens they got
    assert entry["token_period_ms"] == pytest.approx(2 * executor.last_step_s / len(decoded) * 1e3, rel=1e-4)
    assert entry["token_period_without_prompts_ms"] == pytest.approx(
        2 * (executor.last_step_s - entry["prompt_s"]) / len(decoded) * 1e3, rel=1e-4)
    assert entry["batch"] == 2 and entry["mean_context"] == 400


def test_kinds_stay_apart_and_nodes_add_up():
    model = _table_model()
    family = independent_family()
    nodes = [SimExecutor(family, 64, 1024, model, library(members=("s", "l")), vocab_size=50) for _ in range(2)]
    nodes[0].execute(StepPlan(batches=[MemberBatch("s", [_chunk("x", 1, 40)])]))
    nodes[0].execute(StepPlan(batches=[MemberBatch("s", [_chunk("y", 1, 60), _chunk("z", 1, 80)]),
                                       MemberBatch("l", [_chunk("w", 1, 10)])]))
    nodes[1].execute(StepPlan(batches=[MemberBatch("s", [_chunk("x", 1, 41)])]))
    total = StepProfile()
    for node in nodes:
        total.merge(node.profile)
    summary = total.summary()
    assert set(summary) == {"s", "s+l"}
    assert summary["s"]["steps"] == 2 and summary["s"]["requests"] == 2 and summary["s"]["prompt_s"] == 0
    assert summary["s"]["batch"] == 1 and summary["s"]["tokens_per_request_step"] == 1
    assert summary["s+l"]["requests"] == 3 and summary["s+l"]["batch"] == 3
    assert nodes[0].profile.summary()["s"]["steps"] == 1          # merging copies, it does not alias


def _profile(batch: float, context: float, period: float) -> dict:
    return {"batch": batch, "mean_context": context, "tokens_per_request_step": 2.5, "token_period_ms": period,
            "token_period_without_prompts_ms": period - 1, "prompt_tokens": 10, "steps": 5}


def test_the_floor_is_read_at_the_systems_own_batch_and_context():
    table = load_table(LLAMA)
    family = family_of(LLAMA, table)
    result = {"systems": {"mfs": {"simulation": {"step_profile": {"llama3.1-70b": _profile(7.6, 900.4, 12.0)}}},
                          "baseline": {"simulation": {"step_profile": {"llama3.1-70b": _profile(20.0, 901, 25.0),
                                                                       "llama3.1-8b": _profile(3, 800, 5.0)}}}}}
    out = at_measured_batch(result, "llama3.1-70b", table, family, max_k=4)
    row = floors(table, family, (8,), 900, 4)[-1]
    assert out["floor"]["batch"] == 8 and out["floor"]["context"] == 900
    assert out["floor"]["best_k"] == row["best_k_on_path"]
    assert out["floor"]["drafts_on_path_ms"] == min(row["drafts_on_path_ms"])
    assert out["floor"]["no_speculation_ms"] == row["drafts_on_path_ms"][0]
    assert out["mfs"]["token_period_ms"] == 12.0 and out["baseline"]["batch"] == 20.0
    with pytest.raises(ValueError, match="alone"):
        at_measured_batch(result, "llama3.1-8b", table, family, max_k=4)
    with pytest.raises(ValueError, match="step profile"):
        at_measured_batch({"systems": {"mfs": {}, "baseline": {}}}, "llama3.1-70b", table, family, max_k=4)
