"""mfs simulate: the virtual clock, the cost-model interface, the simulated executor, and the real core driven
by them. A fake cost model (fixed seconds per decode row / prefill batch) gives timelines computed by hand."""
from __future__ import annotations

import json
import math
import zlib
from dataclasses import replace

import pytest

from eval.simulate.clock import EventQueue, VirtualClock
from eval.simulate.confidence import ConfidenceLibrary
from eval.simulate.cost_model import (BatchShape, LinearCostModel, TableCostModel, after_idle_term,
                                      after_prefill_term, features, fit_steps, plan_shapes,
                                      prefill_tokens_of, step_histories)
from eval.simulate.executor import SimExecutor
from eval.simulate.fleet import FrontRouter, PlacementError, parse_placement
from eval.simulate.step_table import Grid2D, MemberCosts, StepTable, StepTableError, load_table, save_table
from orchestrator.core.types import MemberBatch, RequestId, SamplingParams, SeqChunk, StepPlan
from tests.fakes import nested_family

PREFILL_S = 0.5
DECODE_S = 0.1
OVERHEAD_S = 0.01


class FakeCost:
    """Exactly predictable: a member batch with any prefill costs PREFILL_S, a decode-only batch DECODE_S."""

    name = "fake"
    saves_overlap = False

    def batch_s(self, shape: BatchShape) -> float:
        return PREFILL_S if shape.prefills else DECODE_S

    def step_overhead_s(self) -> float:
        return OVERHEAD_S

    def copy_s(self, num_bytes: int) -> float:
        return num_bytes * 1e-9

    def describe(self) -> dict:
        return {"name": self.name, "source": "test"}


def hf_config(layers: int, hidden: int) -> dict:
    """A small dense decoder's HF config (paper-scale members in tests)."""
    return {"hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": 16, "num_key_value_heads": 8,
            "head_dim": 128, "vocab_size": 1000, "intermediate_size": 3 * hidden, "max_position_embeddings": 8192}


def small_qwen3_table(tmp_path) -> str:
    """A saved step table for the qwen3 preset's members, each a small decoder costing 1-2 s a batch."""
    g = Grid2D((1.0, 2.0), (0.0, 1.0), ((1.0, 1.0), (2.0, 2.0)))
    table = StepTable(source="test", gpu="test_gpu", gpu_memory_bytes=10 * 2**30,
                      members={n: MemberCosts(g, g, hf_config=hf_config(4, 512)) for n in ("qwen3-0.6b", "qwen3-1.7b", "qwen3-8b")})
    save_table(table, tmp_path / "t.json")
    return str(tmp_path / "t.json")


def library(values=(0.9,), members=("tiny-s", "tiny-m", "tiny-l"), by_request=None) -> ConfidenceLibrary:
    lib = ConfidenceLibrary(family="tiny", source="test", members={m: [list(values)] for m in members},
                            by_request=by_request or {})
    lib.map_members(list(members), list(members))
    return lib


def chunk(request: str, start: int, n: int, sample: bool = True, start_layer: int = 0, generated: int = 0) -> SeqChunk:
    return SeqChunk(request_id=RequestId(request), token_ids=[5] * n, start_pos=start, block_tables=[[0]], sample=sample,
                    sampling=SamplingParams(), start_layer=start_layer, num_generated=generated)


# ----------------------------------------------------------------------------- virtual clock
def test_event_queue_runs_in_time_order_then_push_order_and_moves_the_clock():
    clock = VirtualClock()
    events = EventQueue(clock)
    seen = []
    events.push(2.0, lambda: seen.append(("b", clock())))
    events.push(1.0, lambda: seen.append(("a", clock())))
    events.push(2.0, lambda: seen.append(("c", clock())))
    events.push(1.0, lambda: events.push(clock() + 0.5, lambda: seen.append(("d", clock()))))
    events.run()
    assert seen == [("a", 1.0), ("d", 1.5), ("b", 2.0), ("c", 2.0)]
    assert clock() == 2.0 and events.num_events == 5


def test_event_queue_stops_at_until_and_refuses_the_past():
    clock = VirtualClock()
    events = EventQueue(clock)
    seen = []
    for t in (1.0, 3.0):
        events.push(t, lambda t=t: seen.append(t))
    events.run(until_s=2.0)
    assert seen == [1.0] and len(events) == 1 and clock() == 1.0
    with pytest.raises(ValueError):
        events.push(0.5, lambda: None)
    with pytest.raises(ValueError):
        clock.advance_to(0.0)


# ----------------------------------------------------------------------------- step tables and cost models
def grid() -> Grid2D:
    return Grid2D((1.0, 3.0), (0.0, 10.0), ((1.0, 2.0), (3.0, 6.0)))


def test_grid_is_exact_on_points_linear_between_clamped_below_extrapolated_above():
    g = grid()
    assert g(1, 0) == 1.0 and g(3, 10) == 6.0
    assert g(2, 5) == pytest.approx((1.5 + 4.5) / 2)
    assert g(0, -5) == 1.0                       # clamped below on both axes
    assert g(5, 10) == pytest.approx(10.0)       # extrapolated: 2 -> 6 over x 1 -> 3, so x=5 gives 10
    with pytest.raises(StepTableError):
        Grid2D((1.0, 2.0), (0.0,), ((1.0,),))


def test_table_cost_model_combines_decode_and_prefill_with_the_overlap(tmp_path):
    member = MemberCosts(decode_ms=Grid2D((1.0, 2.0), (0.0, 100.0), ((1.0, 1.0), (2.0, 2.0))),
                         prefill_ms=Grid2D((10.0, 20.0), (0.0, 100.0), ((10.0, 10.0), (20.0, 20.0))), mix_overlap=0.5)
    table = StepTable(source="test", members={"m": member}, step_overhead_ms=0.5, copy_gb_s=1.0)
    save_table(table, tmp_path / "t.json")
    model = TableCostModel(load_table(tmp_path / "t.json"))
    assert model.batch_s(BatchShape("m", (50, 50), ())) == pytest.approx(2e-3)
    assert model.batch_s(BatchShape("m", (), ((20, 0),))) == pytest.approx(20e-3)
    assert model.batch_s(BatchShape("m", (50,), ((10, 0),))) == pytest.approx((10 + 0.5 * 1) / 1e3)
    assert model.batch_s(BatchShape("m", (50,), (), layer_fraction=0.5)) == pytest.approx(0.5e-3)
    assert model.step_overhead_s() == pytest.approx(5e-4) and model.copy_s(10**9) == pytest.approx(1.0)
    with pytest.raises(StepTableError, match="no member"):
        model.batch_s(BatchShape("other", (1,), ()))
    (tmp_path / "bad.json").write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(StepTableError, match="not an mfs-step-table/1"):
        load_table(tmp_path / "bad.json")


def test_the_mixed_step_grid_prices_what_a_prompt_chunk_adds_beside_the_decodes(tmp_path):
    """--mixed-steps grid: a step with decodes and a prefill chunk costs the decodes plus the grid's figure for that
    chunk beside that batch, plus what its cached prefix adds; steps of one kind and the overlap default as before;
    a table without the grid is refused for it, and the grid survives a save and a scaling."""
    member = MemberCosts(decode_ms=Grid2D((1.0, 2.0), (0.0, 100.0), ((1.0, 1.0), (2.0, 2.0))),
                         prefill_ms=Grid2D((10.0, 20.0), (0.0, 100.0), ((10.0, 14.0), (20.0, 24.0))), mix_overlap=0.5,
                         mixed_extra_ms=Grid2D((10.0, 20.0), (1.0, 2.0), ((0.2, 0.4), (0.6, 0.8))))
    save_table(StepTable(source="test", members={"m": member}), tmp_path / "t.json")
    table = load_table(tmp_path / "t.json")
    assert table.member("m").mixed_extra_ms == member.mixed_extra_ms
    grid, overlap = TableCostModel(table, mixed_steps="grid"), TableCostModel(table)
    assert grid.batch_s(BatchShape("m", (50,), ((10, 0),))) == pytest.approx((1 + 0.2) / 1e3)
    assert grid.batch_s(BatchShape("m", (50, 50), ((20, 0),))) == pytest.approx((2 + 0.8) / 1e3)
    # a chunk after a cached prefix: its attention over the prefix on top (14 - 10 ms at 100 tokens before it)
    assert grid.batch_s(BatchShape("m", (50,), ((10, 100),))) == pytest.approx((1 + 0.2 + 4) / 1e3)
    assert overlap.batch_s(BatchShape("m", (50,), ((10, 0),))) == pytest.approx((10 + 0.5 * 1) / 1e3)
    for shape in (BatchShape("m", (50, 50), ()), BatchShape("m", (), ((20, 0),))):
        assert grid.batch_s(shape) == overlap.batch_s(shape)
    assert table.scaled(2.0, "slower").member("m").mixed_extra_ms(10, 1) == pytest.approx(0.4)
    bare = StepTable(source="old", members={"m": MemberCosts(decode_ms=member.decode_ms, prefill_ms=member.prefill_ms)})
    assert "mixed_extra_ms" not in bare.to_dict()["members"]["m"]
    with pytest.raises(StepTableError, match="no mixed-step grid for m"):
        TableCostModel(bare, mixed_steps="grid")
    with pytest.raises(ValueError, match="mixed_steps"):
        TableCostModel(table, mixed_steps="other")


def test_a_plans_shape_tells_decodes_from_prefill_chunks_and_counts_layers():
    batch = MemberBatch("m", [chunk("a", 40, 1), chunk("b", 0, 16), chunk("c", 8, 8, start_layer=2)])
    shape, = plan_shapes(StepPlan(batches=[batch]), nested_family())          # m: 4 layers
    assert shape.decode_contexts == (40,) and shape.prefills == ((16, 0), (8, 8))
    assert shape.layer_fraction == pytest.approx((4 * 1 + 4 * 16 + 2 * 8) / (4 * 25))


def test_plan_shapes_merge_a_nested_member_into_the_larger_forward():
    family = nested_family()
    plan = StepPlan(batches=[MemberBatch("s", [chunk("a", 9, 1)]), MemberBatch("l", [chunk("b", 9, 1)])])
    assert [s.own_forward for s in plan_shapes(plan, family)] == [False, True]
    alone = StepPlan(batches=[MemberBatch("s", [chunk("a", 9, 1)])])
    assert [s.own_forward for s in plan_shapes(alone, family)] == [True]


def test_a_batch_riding_in_a_larger_forward_costs_its_ride_overlap_share(tmp_path):
    """The table prices a nested member's batch merged into a larger member's forward at ride_overlap times its
    own cost; a table written before the field existed (no ride_overlap) keeps pricing it as its own forward."""
    grid = Grid2D((1.0, 2.0), (0.0, 100.0), ((1.0, 1.0), (2.0, 2.0)))
    prefill = Grid2D((10.0, 20.0), (0.0, 100.0), ((10.0, 10.0), (20.0, 20.0)))
    table = StepTable(source="test", members={"s": MemberCosts(grid, prefill, ride_overlap=0.25),
                                              "l": MemberCosts(grid, prefill, ride_overlap=0.25)})
    save_table(table, tmp_path / "t.json")
    model = TableCostModel(load_table(tmp_path / "t.json"))
    family = nested_family()
    merged = StepPlan(batches=[MemberBatch("s", [chunk("a", 9, 1), chunk("b", 9, 1)]),
                               MemberBatch("l", [chunk("c", 9, 1)])])
    assert [model.batch_s(s) for s in plan_shapes(merged, family)] == pytest.approx([0.25 * 2e-3, 1e-3])
    alone = StepPlan(batches=[MemberBatch("s", [chunk("a", 9, 1), chunk("b", 9, 1)])])
    assert [model.batch_s(s) for s in plan_shapes(alone, family)] == pytest.approx([2e-3])
    old = json.loads((tmp_path / "t.json").read_text())
    for member in old["members"].values():
        del member["ride_overlap"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    old_model = TableCostModel(load_table(tmp_path / "old.json"))
    assert [old_model.batch_s(s) for s in plan_shapes(merged, family)] == pytest.approx([2e-3, 1e-3])


def known_steps(truth: dict) -> list:
    observations = []
    for member in ("s", "l"):
        for rows in (1, 2, 4, 8):
            for context in (10, 100, 500):
                for prefill in (0, 32, 128, (32, 64)):
                    chunks = ((prefill, 0),) if isinstance(prefill, int) and prefill else \
                        tuple((n, 0) for n in prefill) if prefill else ()
                    shape = BatchShape(member, (context,) * rows, chunks)
                    observations.append(([shape], sum(c * f for c, f in zip(truth[member], features(shape)))))
    return observations


def test_linear_fit_recovers_known_coefficients():
    truth = {"s": (0.002, 0.001, 0.0005, 0.0001, 0.0, 0.0007), "l": (0.004, 0.002, 0.001, 0.0002, 0.0, 0.0011)}
    fitted, _ = fit_steps(known_steps(truth), ["s", "l"])
    for member in truth:
        assert fitted[member] == pytest.approx(truth[member], abs=1e-9)
    model = LinearCostModel(fitted, 0.001, "test")
    assert LinearCostModel.from_dict(model.to_dict()).batch_s(BatchShape("l", (100,), ())) == pytest.approx(0.0061)
    # a prefill chunk pays its fixed cost once per chunk; a fit from before the term (five coefficients) prices it 0
    two_chunks = BatchShape("l", (), ((32, 0), (64, 0)))
    assert model.batch_s(two_chunks) == pytest.approx(0.004 + 96 * 0.0002 + 2 * 0.0011)
    assert LinearCostModel({"l": truth["l"][:5]}, 0.0, "old").batch_s(two_chunks) == pytest.approx(0.004 + 96 * 0.0002)


def test_history_terms_are_fitted_and_priced_by_the_executor():
    truth = {"s": (0.002, 0.001, 0.0005, 0.0001, 0.0, 0.0007), "l": (0.004, 0.002, 0.001, 0.0002, 0.0, 0.0011)}
    observations = known_steps(truth)
    # one engine's timeline: steps back to back, with an idle gap of 0.2 s before every sixth one
    starts, t = [], 0.0
    for i, (_, seconds) in enumerate(observations):
        t += 0.2 if i % 6 == 0 else 0.0001
        starts.append(t)
        t += seconds
    histories = step_histories(starts, observations)
    assert histories[0][:2] == (math.inf, 0) and histories[1][:2] == (math.inf, 1) and histories[6][1] == 0
    assert histories[6][0] == pytest.approx(0.2)
    for i, (idle, since_wake, since_prefill, tokens) in enumerate(histories):
        # the prefill this step looks back on: the latest earlier step of its busy period that held one
        earlier = [j for j in range(i - since_wake, i) if prefill_tokens_of(observations[j][0])]
        assert since_prefill == (i - earlier[-1] if earlier else 0)
        assert tokens == (prefill_tokens_of(observations[earlier[-1]][0]) if earlier else 0)
    idle_shape, prefill_shape = (0.5, 0.02), 0.45                  # on the fit's grids
    slowed = [(shapes, seconds + 0.003 * after_idle_term(h[0], h[1], *idle_shape)
               + 2e-6 * after_prefill_term(h[2], h[3], prefill_shape))
              for (shapes, seconds), h in zip(observations, histories)]
    coefficients, (after_idle, after_prefill) = fit_steps(slowed, ["s", "l"], histories)
    assert after_idle == pytest.approx((0.003, *idle_shape)) and after_prefill == pytest.approx((2e-6, prefill_shape))
    assert coefficients["l"] == pytest.approx(truth["l"], abs=1e-9)
    assert fit_steps(observations, ["s", "l"], histories)[1] == (None, None)      # no such costs: no terms
    model = LinearCostModel(coefficients, 0.0, "test", after_idle=after_idle, after_prefill=after_prefill)
    again = LinearCostModel.from_dict(model.to_dict())
    assert again.after_idle == pytest.approx(after_idle) and again.after_prefill == pytest.approx(after_prefill)

    # the executor adds them by the gaps its clock shows: the first step counts as after a long idle
    family = nested_family()
    clock = VirtualClock()
    executor = SimExecutor(family, 64, 1024, model, library(members=("s", "m", "l")), vocab_size=50)
    executor.attach_clock(clock)
    decode = StepPlan(batches=[MemberBatch("l", [chunk("a", 9, 1)])])
    prefill = StepPlan(batches=[MemberBatch("l", [chunk("b", 0, 8)])])
    plain = executor.step_s(decode)
    for plan, extra in ((decode, 0.003), (decode, 0.0015), (prefill, 0.00075), (decode, 0.000375 + 8 * 2e-6),
                        (decode, 0.0001875 + 8 * 2e-6 * 0.45)):
        executor.execute(plan)
        assert executor.last_step_s == pytest.approx(executor.step_s(plan) + extra)
        clock.advance_to(clock() + executor.last_step_s)              # back to back
    clock.advance_to(clock() + 0.02)                                   # 20 ms idle: 1 - e^-1 of the full term
    executor.execute(decode)
    assert executor.last_step_s == pytest.approx(plain + 0.003 * (1 - math.exp(-1)))


# ----------------------------------------------------------------------------- simulated executor
def test_sim_executor_steps_cost_the_sum_on_one_device_and_the_max_side_by_side():
    family = nested_family()
    lib = library(members=("s", "m", "l"))
    plan = StepPlan(batches=[MemberBatch("s", [chunk("a", 9, 1)]), MemberBatch("m", [chunk("b", 0, 8)])])
    serial = SimExecutor(family, 64, 1024, FakeCost(), lib, vocab_size=50)
    assert serial.step_s(plan) == pytest.approx(OVERHEAD_S + DECODE_S + PREFILL_S)
    parallel = SimExecutor(family, 64, 1024, FakeCost(), lib, vocab_size=50, members_in_parallel=True)
    assert parallel.step_s(plan) == pytest.approx(OVERHEAD_S + PREFILL_S)
    data = serial.read_page(3)                                     # tier copies add to the next step
    serial.write_page(4, data)
    assert len(data) == 1024 and serial.step_s(plan) == pytest.approx(OVERHEAD_S + DECODE_S + PREFILL_S + 2048e-9)
    serial.execute(plan)                                           # the copies went with that step
    assert serial.step_s(plan) == pytest.approx(OVERHEAD_S + DECODE_S + PREFILL_S)


def test_with_saves_overlapping_only_what_outlasts_the_compute_adds_and_loads_always_do():
    """A GPU engine offloads evicted pages on its own copy stream: step = overhead + max(compute, saves) + loads."""
    class OverlapCost(FakeCost):
        saves_overlap = True

    family = nested_family()
    plan = StepPlan(batches=[MemberBatch("s", [chunk("a", 9, 1)])])
    gpu = SimExecutor(family, 64, 1000, OverlapCost(), library(members=("s", "m", "l")), vocab_size=50)
    compute = DECODE_S
    few = int(compute * 1e9) // 2000                               # pages whose save takes half the compute
    for page in range(few):
        gpu.read_page(page)
    assert gpu.step_s(plan) == pytest.approx(OVERHEAD_S + compute)          # hidden behind the compute
    gpu.write_page(0, bytes(1000))
    assert gpu.step_s(plan) == pytest.approx(OVERHEAD_S + compute + 1000e-9)  # a load is on the path
    for page in range(few, 4 * few):                               # saves now take twice the compute
        gpu.read_page(page)
    assert gpu.step_s(plan) == pytest.approx(OVERHEAD_S + 4 * few * 1000e-9 + 1000e-9)
    gpu.execute(plan)
    assert gpu.step_s(plan) == pytest.approx(OVERHEAD_S + compute)


def test_paper_setup_overlaps_saves_unless_told_not_to(tmp_path):
    from eval.simulate.setup import paper_setup

    path = small_qwen3_table(tmp_path)
    overlapped = paper_setup("qwen3", "test_gpu", "trtllm", parse_placement("colocated"), path)
    serial = paper_setup("qwen3", "test_gpu", "trtllm", parse_placement("colocated"), path, saves_overlap=False)
    assert overlapped.cost.saves_overlap and overlapped.cost.describe()["saves_overlap"]
    assert not serial.cost.saves_overlap


def test_sim_executor_tokens_and_confidences_depend_only_on_request_member_and_position():
    family = nested_family()
    lib = ConfidenceLibrary(family="x", source="t", members={"s": [[0.1, 0.2, 0.3]], "l": [[0.7, 0.8]]})
    lib.map_members(["s", "m", "l"], ["s", "l"])                   # m (middle) borrows the larger recorded member
    one = SimExecutor(family, 64, 1024, FakeCost(), lib, vocab_size=50, request_keys={"sysA-x": "x"})
    two = SimExecutor(family, 64, 1024, FakeCost(), lib, vocab_size=50, request_keys={"sysB-x": "x"})
    a = one.execute(StepPlan(batches=[MemberBatch("s", [chunk("sysA-x", 5, 1, generated=4)])]))
    b = two.execute(StepPlan(batches=[MemberBatch("s", [chunk("sysB-x", 7, 1, generated=4)])]))
    assert a[0].token_id == b[0].token_id and 3 <= a[0].token_id < 50
    assert a[0].top1_prob == b[0].top1_prob == 0.2                 # position 4 of a 3-long sequence wraps to 1
    assert math.exp(a[0].logprob) == pytest.approx(0.2)
    m = one.execute(StepPlan(batches=[MemberBatch("m", [chunk("sysA-x", 5, 1, generated=0)])]))
    assert m[0].top1_prob == 0.7
    assert one.execute(StepPlan(batches=[MemberBatch("s", [chunk("sysA-x", 0, 5, sample=False)])])) == []
    # the running CRC gives what the whole "key:position" string gives (the token stream every system shares)
    assert [one.token_id("x", p) for p in (0, 4, 1000)] == [3 + zlib.crc32(f"x:{p}".encode()) % 47 for p in (0, 4, 1000)]
    one.release(["sysA-x"])
    assert one.request_keys == {} and one._key_crc == {} and one.token_id("x", 4) == a[0].token_id


def test_sim_executor_replays_a_real_reply_where_it_has_one_and_the_stream_beyond():
    """The validation's --token-stream replay: a request's recorded reply gives the token at each of its positions
    (so the next closed-loop prompt is the real one); past its end, and for other requests, the seeded stream."""
    family = nested_family()
    lib = library(members=("s", "m", "l"))
    plain = SimExecutor(family, 64, 1024, FakeCost(), lib, vocab_size=50)
    replay = SimExecutor(family, 64, 1024, FakeCost(), lib, vocab_size=50, request_keys={"r": "x"},
                         replies={"x": [11, 12, 13]})
    out = replay.execute(StepPlan(batches=[MemberBatch("s", [chunk("r", 9, 1, generated=1)])]))
    assert out[0].token_id == 12
    assert [replay.token_id("x", p) for p in (0, 2, 3, 7)] == [11, 13, plain.token_id("x", 3), plain.token_id("x", 7)]
    assert replay.token_id("y", 0) == plain.token_id("y", 0)


def test_confidence_library_prefers_the_requests_own_recorded_sequence():
    lib = ConfidenceLibrary(family="tiny", source="t", members={"tiny-s": [[0.1], [0.2], [0.3]]},
                            by_request={"s1-t0|tiny-s": 2})
    lib.map_members(["tiny-s"], ["tiny-s"])
    assert lib.value("s1-t0", "tiny-s", 0) == 0.3
    drawn = {lib.value(f"s{i}-t0", "tiny-s", 0) for i in range(2, 40)}
    assert drawn <= {0.1, 0.2, 0.3} and len(drawn) > 1
    assert lib.value("s9-t0", "tiny-s", 0) == lib.value("s9-t0", "tiny-s", 0)


# ----------------------------------------------------------------------------- front router and placements
def test_front_router_sticks_sessions_follows_prefixes_and_balances():
    router = FrontRouter(3)
    prompt = list(range(200))
    first = router.route("a", prompt, [0, 0, 0])
    assert first == 0 and router.decisions["load"] == 1
    assert router.route("a", prompt, [1, 0, 0]) == 0                     # session affinity
    assert router.route("b", prompt + [7] * 64, [1, 0, 0]) == 0          # shares 3 of 4 blocks with node 0's prompts
    assert router.route("c", [9] * 200, [2, 0, 1]) == 1                  # no match: least loaded
    assert router.route("a", prompt, [40, 0, 2]) == 1                    # imbalanced and node 0 is the busiest
    assert router.decisions == {"session": 1, "prefix": 1, "load": 3}


def test_member_tp_shards_a_deployment_wider_and_refuses_what_cannot_hold_it():
    from eval.simulate.setup import paper_setup, pooled_setups

    family, separate = pooled_setups("llama3.1", "h200_sxm", "trtllm", 4, None, member_tp={"llama3.1-8b": 2})
    assert {n: separate.cost.table.member(n).tp for n in separate.member_names} == {"llama3.1-8b": 2,
                                                                                     "llama3.1-70b": 2}
    assert family.member_homes == [("llama3.1-8b",), ("llama3.1-70b",)]     # 2 GPUs each: one node each
    for bad in ({"llama3.1-70b": 1}, {"llama3.1-8b": 3}, {"llama3.1-405b": 2}):
        with pytest.raises(PlacementError):
            pooled_setups("llama3.1", "h200_sxm", "trtllm", 4, None, member_tp=bad)
    with pytest.raises(PlacementError, match="per-member or pooled"):
        paper_setup("llama3.1", "h200_sxm", "trtllm", parse_placement("colocated"), None,
                    member_tp={"llama3.1-8b": 2})


def test_member_homes_share_the_nodes_as_the_deployments_share_the_gpus():
    from eval.simulate.fleet import member_homes

    assert member_homes(3, {"s": 1, "m": 1, "l": 1}) == [("s",), ("m",), ("l",)]
    assert member_homes(3, {"8b": 1, "70b": 2}) == [("8b",), ("70b",), ("70b",)]       # llama: 8B on 1, 70B on 2
    assert member_homes(6, {"8b": 1, "70b": 2}) == [("8b",), ("8b",), ("70b",)] + [("70b",)] * 3
    assert member_homes(2, {"s": 1, "m": 1, "l": 1}) == [("s", "l"), ("m",)]               # fewer nodes: shared


def test_front_router_sends_a_member_home_and_spills_when_its_home_is_congested():
    from eval.simulate.fleet import SPILL_WAITING

    router = FrontRouter(3, homes=[("s",), ("m",), ("l",)])
    prompt, idle, congested = list(range(200)), [0, 0, 0], [0, SPILL_WAITING + 1, 0]
    assert router.route("a", prompt, [5, 90, 0], "m", idle) == 1          # home, however many it runs
    assert router.route("a", prompt, [5, 90, 0], "m", idle) == 1          # the session stays
    assert router.route("b", [3] * 200, [5, 9, 0], "m", congested) == 2   # home congested: least loaded of the rest
    assert router.route("b", [3] * 200, [5, 9, 0], "m", idle) == 2        # and the spilled session stays there
    assert router.route("a", prompt, [5, 9, 0], "m", congested) == 2      # its node congested: it leaves too
    assert router.route("d", [5] * 200, [5, 9, 0]) == 2                   # member unknown: least load
    assert router.move("l", 0, [5, 9, 0], idle) == 2                      # an escalation to l: l's home
    assert router.move("l", 0, [5, 9, 0], [0, 0, SPILL_WAITING + 1]) == 0 # l's home congested: stays at the source
    assert router.decisions == {"session": 2, "prefix": 0, "load": 1, "home": 1, "spill": 2, "moved": 1}


def test_parse_placement():
    assert parse_placement("colocated").label == "colocated"
    fleet = parse_placement("fleet:8", "per-member")
    assert (fleet.kind, fleet.num_nodes, fleet.label) == ("per-member", 8, "fleet:8")
    pooled = parse_placement("pooled:6")
    assert (pooled.kind, pooled.num_nodes, pooled.label) == ("pooled", 6, "pooled:6")
    for bad in ("fleet:0", "fleet:x", "ring", "pooled:0", "pooled:x"):
        with pytest.raises(PlacementError):
            parse_placement(bad)


def test_pooled_placement_gives_the_family_every_gpu_group_and_the_deployments_their_own_gpus(tmp_path):
    """pooled:N: MFS on N/G colocated nodes, the separate deployments on per-member GPUs, the same N GPUs; a GPU
    count that leaves either with a spare GPU is refused with the count that works."""
    import json

    from eval.simulate.setup import pooled_setups
    from orchestrator.serve.cli import main

    with pytest.raises(PlacementError, match="pooled:6"):
        pooled_setups("llama3.1", "h200_sxm", "trtllm", 3, None)    # 8B on 1 GPU + 70B on 2; the pair needs 2
    family, separate = pooled_setups("llama3.1", "h200_sxm", "trtllm", 6, None)
    assert (family.placement.kind, family.placement.num_nodes) == ("colocated", 3)
    assert (separate.placement.kind, separate.placement.num_nodes) == ("per-member", 2)
    assert family.host_tier_mb * 3 == separate.host_tier_mb * 2          # the same host memory per GPU
    out = tmp_path / "pooled.json"
    assert main(["simulate", "--family", "qwen3-large", "--gpu", "h200_sxm", "--placement", "pooled:3",
                 "--sessions", "12", "--rates", "2", "--systems", "mfs,baseline_spec", "--no-progress",
                 "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    sim = result["simulated"]
    assert (sim["placement"], sim["num_nodes"], sim["node_placement"]) == ("pooled:3", 3, "colocated")
    assert sim["member_homes"] == [["qwen3-1.7b"], ["qwen3-8b"], ["qwen3-32b"]]
    assert sim["separate_deployments"]["placement"] == "per-member"
    assert sim["separate_deployments"]["systems"] == ["baseline_spec"]
    mfs, deployed = (result["curve"][0]["systems"][name] for name in ("mfs", "baseline_spec"))
    routed = mfs["simulation"]["front_router"]
    assert routed["home"] == 12 and routed["spill"] == 0            # every session's first turn went home
    # every escalated request continued on its new member's home, and the members served what the deployments did
    assert routed["moved"] == sum(mfs["escalations"].values()) > 0
    assert mfs["member_token_share"] == deployed["member_token_share"]
    with pytest.raises(SystemExit, match="--no-member-homes is an option of --placement pooled:N"):
        main(["simulate", "--family", "qwen3-large", "--gpu", "h200_sxm", "--no-member-homes", "--sessions", "6",
              "--rates", "2", "--systems", "mfs", "--no-progress", "--out", str(tmp_path / "x.json")])


# ----------------------------------------------------------------------------- the real core in virtual time
def tiny_config(**overrides):
    from orchestrator.core.config import load_config
    from tests.fakes_serving import family_dir

    return load_config(overrides={"family": str(family_dir()), "pool.num_pages": 512, "pool.host_tier_mb": 0,
                                  "escalation.enabled": False, **overrides})


def trace_of(sessions, arrivals, history="dataset"):
    """turns = (prompt, max_tokens, think_s): with `dataset` history the prompt is sent as it is; with `closed`
    history it is the user part that follows the previous prompt and the reply this system generated."""
    from eval.workloads import Session, Trace, Turn, WorkloadSpec

    return Trace(spec=WorkloadSpec(history=history, lengths="exact"), arrival_times_s=list(arrivals),
                 sessions=[Session(f"s{i}", "multiturn", f"c{i}",
                                   [Turn(list(p), n, think, user_token_ids=list(p)) for p, n, think in turns])
                           for i, turns in enumerate(sessions)])


def run_nodes(trace, num_nodes=1, config=None):
    from eval.simulate.driver import simulate
    from eval.simulate.node import SimNode

    config = config or tiny_config()

    def make_nodes(clock, events, on_output):
        def make_executor(family, num_pages, page_bytes):
            return SimExecutor(family, num_pages, page_bytes, FakeCost(), library(), vocab_size=4096)
        return [SimNode(f"n{i}", config, None, clock, events, make_executor, on_output) for i in range(num_nodes)]
    return simulate("t", make_nodes, trace)


PROMPT = list(range(3, 23))                       # 20 tokens: one full 16-token block on every tiny member


def test_one_session_timeline_is_exactly_the_fake_costs():
    turns = [(PROMPT, 3, 0.0), (PROMPT + list(range(30, 40)), 2, 2.0)]
    # thresholds at 1: every request is adequate for tiny-s, so both turns run there and the second finds the first
    run = run_nodes(trace_of([turns], [1.0]), config=tiny_config(**{"router.complexity_thresholds": [1.0, 1.0]}))
    first, second = run.records
    step_prefill, step_decode = OVERHEAD_S + PREFILL_S, OVERHEAD_S + DECODE_S
    assert first.send_s == 1.0
    assert first.ttft_s == pytest.approx(step_prefill)                  # the prefill step samples the first token
    assert first.e2e_s == pytest.approx(step_prefill + 2 * step_decode)
    assert first.tpot_s == pytest.approx(step_decode)
    assert first.output_tokens == 3 and first.cached_tokens == 0
    assert second.send_s == pytest.approx(first.finish_s + 2.0)         # think time after the reply
    assert second.cached_tokens == 16                                   # the first turn's full block, from the pool
    assert second.e2e_s == pytest.approx(step_prefill + step_decode)
    assert run.num_steps == 5 and run.duration_s == pytest.approx(second.finish_s)
    assert first.members == second.members == ["tiny-s"]
    assert run.counters["requests"]["tiny-s"]["finished"] == 2


class EdgeCost(FakeCost):
    """FakeCost with a serving edge: IN_S from the client to the scheduler, OUT_S from a step to the client."""

    def request_path_s(self) -> tuple[float, float]:
        return IN_S, OUT_S


IN_S, OUT_S = 0.003, 0.002


def test_the_serving_edge_delays_the_way_in_and_every_output_on_the_way_out():
    from eval.simulate.driver import simulate
    from eval.simulate.node import SimNode

    config = tiny_config(**{"router.complexity_thresholds": [1.0, 1.0]})

    def make_nodes(clock, events, on_output):
        def make_executor(family, num_pages, page_bytes):
            return SimExecutor(family, num_pages, page_bytes, EdgeCost(), library(), vocab_size=4096)
        return [SimNode("n0", config, None, clock, events, make_executor, on_output)]
    turns = [(PROMPT, 3, 0.0), (PROMPT + list(range(30, 40)), 2, 2.0)]
    first, second = simulate("t", make_nodes, trace_of([turns], [1.0])).records
    step_prefill, step_decode = OVERHEAD_S + PREFILL_S, OVERHEAD_S + DECODE_S
    assert first.send_s == 1.0
    assert first.ttft_s == pytest.approx(IN_S + step_prefill + OUT_S)
    assert first.e2e_s == pytest.approx(IN_S + step_prefill + 2 * step_decode + OUT_S)
    assert first.tpot_s == pytest.approx(step_decode)                   # every output is late by the same
    assert second.send_s == pytest.approx(first.finish_s + 2.0)         # the client's think time starts on receipt
    assert second.e2e_s == pytest.approx(IN_S + step_prefill + step_decode + OUT_S)


def test_a_replay_leaves_no_cyclic_garbage_and_restores_the_collector():
    """The replay runs with the cyclic collector off (driver.no_full_collections): sound only if what its
    steps and requests create is freed by reference counting alone. With the collector off, nothing of the
    replay's per-step and per-request objects may be left for it to find (the nodes' own assembly may hold
    cycles: one per node, whatever the trace)."""
    import gc

    from eval.bench.metrics import RequestRecord
    from eval.workloads import Session, Turn
    from orchestrator.core.types import RequestOutput, StepPlan

    turns = [(PROMPT, 3, 0.0), (PROMPT + list(range(30, 40)), 2, 2.0)]
    too_long = list(range(3, 3 + 1100))                                 # a refusal (an exception) as well
    thresholds = gc.get_threshold()
    gc.collect()
    gc.disable()
    try:
        run = run_nodes(trace_of([turns] * 6 + [[(too_long, 2, 0.0), (PROMPT, 2, 1.0)]], [0.5 * i for i in range(7)]))
        assert len(run.records) == 14 and gc.get_threshold() == thresholds and gc.get_freeze_count() == 0
        del run
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        left = [type(o).__name__ for o in gc.garbage
                if isinstance(o, (RequestRecord, Session, Turn, RequestOutput, StepPlan, SeqChunk))]
        assert left == []
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


def test_the_replay_turns_the_collector_off_and_restores_it():
    import gc

    from eval.simulate.driver import no_full_collections

    was = gc.isenabled()
    try:
        for before in (True, False):
            (gc.enable if before else gc.disable)()
            with no_full_collections():
                during = (gc.isenabled(), gc.get_freeze_count() > 0)
            assert during == (False, True) and gc.isenabled() is before and gc.get_freeze_count() == 0
    finally:
        (gc.enable if was else gc.disable)()


def test_a_refused_request_is_recorded_and_the_session_goes_on():
    too_long = list(range(3, 3 + 1100))                                 # the tiny members hold 1024 tokens
    run = run_nodes(trace_of([[(too_long, 2, 0.0), (PROMPT, 2, 1.0)]], [0.0]))
    refused, served = run.records
    assert refused.error and "InvalidRequestError" in refused.error and refused.finish_s is None
    assert served.send_s == pytest.approx(1.0) and served.ok


def test_a_fleet_serves_simultaneous_sessions_side_by_side():
    sessions = [[(PROMPT, 2, 0.0)], [([7] * 40, 2, 0.0)]]
    one = run_nodes(trace_of(sessions, [0.0, 0.0]), num_nodes=1)
    two = run_nodes(trace_of(sessions, [0.0, 0.0]), num_nodes=2)
    assert [r.ttft_s for r in two.records] == pytest.approx([OVERHEAD_S + PREFILL_S] * 2)
    assert two.router_decisions["load"] == 2
    # on one node both prefills share the first step: it costs one or two prefill batches (same or two members)
    assert all(r.ttft_s >= OVERHEAD_S + PREFILL_S - 1e-12 for r in one.records)


def test_paper_setup_sizes_pages_from_gpu_memory_minus_weights(tmp_path):
    from eval.simulate.families import page_bytes_for
    from eval.weights import weight_bytes
    from eval.simulate.setup import paper_setup

    configs = {"qwen3-0.6b": hf_config(4, 512), "qwen3-1.7b": hf_config(6, 1024), "qwen3-8b": hf_config(8, 2048)}
    g = Grid2D((1.0, 2.0), (0.0, 1.0), ((1.0, 1.0), (2.0, 2.0)))
    table = StepTable(source="test", gpu="test_gpu", gpu_memory_bytes=10 * 2**30,
                      members={n: MemberCosts(g, g, hf_config=c) for n, c in configs.items()})
    save_table(table, tmp_path / "t.json")
    setup = paper_setup("qwen3", "test_gpu", "trtllm", parse_placement("colocated"), str(tmp_path / "t.json"))
    page = page_bytes_for(list(configs.values()), 32)
    assert page == 32 * 2 * 8 * 128 * 2
    weights = sum(weight_bytes(c) for c in configs.values())
    assert setup.num_pages == int((10 * 2**30 - weights) * 0.9) // page
    assert [m.num_layers for m in setup.family.members] == [4, 6, 8]
    assert setup.family.shared_depth("qwen3-0.6b", "qwen3-8b") == 0     # separately trained members share no page
    per_member = paper_setup("qwen3", "test_gpu", "trtllm", parse_placement("per-member"), str(tmp_path / "t.json"))
    assert per_member.num_pages == sum(int((10 * 2**30 - weight_bytes(c)) * 0.9) // page for c in configs.values())
    assert per_member.split["qwen3-8b"] < per_member.split["qwen3-0.6b"]


def test_closed_history_sends_back_the_generated_reply_and_hits_it_in_the_cache():
    user = list(range(40, 52))
    config = tiny_config(**{"router.complexity_thresholds": [1.0, 1.0]})
    run = run_nodes(trace_of([[(PROMPT, 20, 0.0), (user, 2, 1.0)]], [0.0], history="closed"), config=config)
    first, second = run.records
    assert second.prompt_token_ids == PROMPT + first.output_token_ids + user
    assert second.prompt_tokens == 20 + 20 + 12
    # positions 0..38 were computed (the last generated token never is): two full 16-token blocks are cached
    assert second.cached_tokens == 32
    again = run_nodes(trace_of([[(PROMPT, 20, 0.0), (user, 2, 1.0)]], [0.0], history="closed"), config=config)
    assert [r.output_token_ids for r in again.records] == [r.output_token_ids for r in run.records]


def test_a_refused_turn_ends_a_closed_loop_session():
    too_long = list(range(3, 3 + 1100))
    run = run_nodes(trace_of([[(too_long, 2, 0.0), (PROMPT, 2, 1.0)]], [0.0], history="closed"))
    assert run.records[1].error == "session ended: turn 0 failed"


def test_the_simulated_baseline_gets_the_split_the_core_finds_fastest_on_a_pilot():
    from dataclasses import replace

    from eval.bench.cli import BenchSettings, static_split_for
    from eval.simulate.cli import search_baseline_split, system_configs
    from eval.simulate.fleet import Placement
    from eval.simulate.setup import SimSetup
    from orchestrator.core.family import load_family
    from orchestrator.serve.tokenizer import FamilyTokenizer
    from tests.fakes_serving import family_dir

    family = load_family(str(family_dir()))
    tokenizer = FamilyTokenizer(family.members[0].checkpoint_dir)
    settings = replace(BenchSettings.quick_defaults(), family=str(family_dir()), systems=("mfs", "baseline"),
                       kv_pages=512, score_quality=False, extra_overrides={"escalation.enabled": False})
    setup = SimSetup(family_name="tiny", family=None, member_names=family.member_names, cost=FakeCost(),
                     placement=Placement("colocated"), num_pages=512, page_bytes=0, split=None)
    sessions = [[(PROMPT, 4, 0.0), (PROMPT + [9] * 30, 3, 1.0)], [(list(range(100, 160)), 5, 0.0)]]
    trace = trace_of(sessions, [0.0, 0.5])
    configs, split = system_configs(setup, settings, trace, tokenizer)
    traffic = dict(configs["baseline"].comparison.static_split)
    about = search_baseline_split(setup, settings, trace, [1.0, 2.0], split, configs, library(), tokenizer)
    assert about["baseline_split_mode"] == "search"
    assert configs["baseline"].comparison.static_split == about["baseline_split"]     # the baseline runs the chosen split
    rescore = about["baseline_split_rescore"]
    assert rescore["winner"]["fractions"] == about["baseline_split"]
    assert rescore["pilot"]["rates"] == [1.0, 2.0] and rescore["pilot"]["sessions"] == 2
    for entry in (rescore["default"], *rescore["candidates"]):           # the pilot ran, simulated, at both rates
        assert [f["num_requests"] for f in entry["by_rate"].values()] == [3, 3]
    scores = [e["score_s"] for e in (rescore["default"], *rescore["candidates"]) if e["eligible"]]
    assert rescore["winner"]["score_s"] == min(scores)
    assert about["baseline_split_search"]["num_candidates"] > 100
    assert traffic == split.fractions                                          # before the search: the traffic split
    # a split given on the command line: the baseline runs it, nothing is replayed before the curve
    given = {"tiny-s": 0.15, "tiny-m": 0.25, "tiny-l": 0.6}
    fixed = replace(settings, baseline_split=",".join(f"{m}={f}" for m, f in given.items()))
    about = search_baseline_split(setup, fixed, trace, [1.0, 2.0], split, configs, library(), tokenizer)
    assert about == {"baseline_split_mode": "fixed", "baseline_split": given,
                     "baseline_fixed": {"fractions": given, "rule": "given with --baseline-split"}}
    assert configs["baseline"].comparison.static_split == given


def test_a_gpu_familys_one_engine_may_run_as_many_sequences_as_the_independent_deployments_together(tmp_path):
    from eval.bench.cli import BenchSettings
    from eval.simulate.cli import system_configs
    from eval.simulate.setup import GPU_SCHEDULER, paper_setup

    path = small_qwen3_table(tmp_path)
    setup = paper_setup("qwen3", "test_gpu", "trtllm", parse_placement("colocated"), path)
    settings = BenchSettings(family="qwen3", systems=("mfs", "baseline"), baseline_split="traffic")
    configs, _ = system_configs(setup, settings, trace_of([[(PROMPT, 4, 0.0)]], [0.0]), tokenizer=_tokenizer())
    per_engine = GPU_SCHEDULER["scheduler.max_running_requests"]
    assert configs["mfs"].scheduler.max_running_requests == 3 * per_engine
    assert configs["baseline"].scheduler.max_running_requests == per_engine     # per deployment (eval/baseline)
    # GPU families: no wait-avoiding downgrade into a member that escalates most of its requests back out
    assert configs["mfs"].router.downgrade_max_escalation_rate == 0.5
    assert not configs["baseline"].comparison.use_load          # the baseline never downgrades
    # Both systems' steps are capped by the same token budget (the CPU's stall-aware 512 starved GPU prefill)
    for name in ("mfs", "baseline"):
        sched = configs[name].scheduler
        assert sched.decode_step_token_budget is None and sched.max_batch_tokens == GPU_SCHEDULER["scheduler.max_batch_tokens"]
    # The host tier is the node's (128 GiB per GPU by default, one GPU here), not the tiny config's 256 MB; the
    # fair baseline has the same; baseline_legacy's servers have none unless asked, then the same
    assert setup.host_tier_mb == 128 * 1024 and setup.memory["host_tier_gib"] == 128
    assert configs["mfs"].pool.host_tier_mb == configs["baseline"].pool.host_tier_mb == 128 * 1024
    legacy = replace(settings, systems=("mfs", "baseline_legacy"))
    plain, _ = system_configs(setup, legacy, trace_of([[(PROMPT, 4, 0.0)]], [0.0]), tokenizer=_tokenizer())
    assert plain["baseline_legacy"].pool.host_tier_mb == 0
    both, _ = system_configs(setup, replace(legacy, baseline_host_tier=True), trace_of([[(PROMPT, 4, 0.0)]], [0.0]),
                             tokenizer=_tokenizer())
    assert both["baseline_legacy"].pool.host_tier_mb == both["mfs"].pool.host_tier_mb == 128 * 1024
    assert both["baseline_legacy"].pool.disk_tier_mb == 0
    none = paper_setup("qwen3", "test_gpu", "trtllm", parse_placement("per-member"), str(tmp_path / "t.json"),
                       host_tier_gib_per_gpu=0)
    assert none.host_tier_mb == 0
    per_member = paper_setup("qwen3", "test_gpu", "trtllm", parse_placement("per-member"), str(tmp_path / "t.json"))
    assert per_member.host_tier_mb == 3 * 128 * 1024          # one GPU per member: three GPUs' host memory


def _tokenizer():
    from orchestrator.core.family import load_family
    from orchestrator.serve.tokenizer import FamilyTokenizer

    return FamilyTokenizer(load_family("tiny").members[0].checkpoint_dir)


def test_ride_overlap_is_measured_on_the_real_engine_and_written_into_a_table_keeping_its_grid(tmp_path, monkeypatch):
    """`python -m eval.simulate.measure --ride-overlap-into TABLE`: the local engine's merged steps, timed; the
    members nested in a larger one get a ratio, the largest keeps 1.0; the table's grid is left as it was."""
    from eval.simulate import measure

    monkeypatch.setattr(measure, "RIDE_POINTS", ((1, 1),))
    monkeypatch.setattr(measure, "RIDE_REPEATS", 1)
    monkeypatch.setattr(measure, "RIDE_ROUNDS", 1)
    grid = Grid2D((1.0, 2.0), (0.0, 100.0), ((1.0, 1.0), (2.0, 2.0)))
    prefill = Grid2D((10.0, 20.0), (0.0, 100.0), ((10.0, 10.0), (20.0, 20.0)))
    table = StepTable(source="test", members={m: MemberCosts(grid, prefill, mix_overlap=0.3)
                                              for m in ("tiny-s", "tiny-m", "tiny-l")}, notes=["kept"])
    path = tmp_path / "t.json"
    save_table(table, path)
    assert measure.main(["--ride-overlap-into", str(path)]) == 0
    written = load_table(path)
    assert written.members["tiny-l"].ride_overlap == 1.0           # nests in nothing larger
    for name in ("tiny-s", "tiny-m"):
        member = written.members[name]
        assert member.ride_overlap != 1.0 and member.ride_overlap >= 0.0
        assert member.decode_ms == grid and member.prefill_ms == prefill and member.mix_overlap == 0.3
    assert written.notes[0] == "kept" and written.notes[1].startswith("ride_overlap:")


def test_step_check_recovers_the_ride_overlap_real_merged_steps_imply():
    """eval.validate.step_check: real steps that run k times the grid, with riders at r of their own cost, read
    k for every kind with ride_overlap r in the table, less than k for merged kinds without it, and imply r."""
    from eval.validate.step_check import check

    grid = Grid2D((1.0, 8.0), (0.0, 1000.0), ((2.0, 4.0), (9.0, 11.0)))
    prefill = Grid2D((10.0, 20.0), (0.0, 100.0), ((10.0, 10.0), (20.0, 20.0)))
    table = StepTable(source="test", members={m: MemberCosts(grid, prefill, ride_overlap=0.4) for m in ("s", "m", "l")})
    truth = TableCostModel(table)
    steps = []
    for rows in (1, 2, 3):
        for member in ("m", "l"):
            shapes = [BatchShape(member, (100,) * rows, ())]
            steps.append((shapes, 2.5 * truth.batch_s(shapes[0])))
        merged = [BatchShape("m", (300,) * rows, (), own_forward=False), BatchShape("l", (200,), ())]
        steps.append((merged, 2.5 * sum(truth.batch_s(s) for s in merged)))
    steps.append(([BatchShape("l", (), ((16, 0),))], 99.0))                     # prefill steps are left out
    result = check(steps, table)
    assert result["k"]["with"] == pytest.approx(2.5)
    assert result["merged l+m"]["with"] == pytest.approx(2.5) and result["merged l+m"]["without"] < 2.4
    assert result["merged l+m"]["implied_ride_overlap"] == pytest.approx(0.4)
    assert result["alone l"]["steps"] == 3 and not any("16" in kind for kind in result)


def test_serial_saves_is_refused_for_the_tiny_family_whose_model_already_charges_every_copy():
    import argparse

    from eval.simulate.cli import add_arguments, build_setup, sim_settings

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--family", "tiny", "--quick", "--serial-saves"])
    with pytest.raises(PlacementError, match="--serial-saves is for paper-scale families"):
        build_setup(args, sim_settings(args))


def test_a_paper_familys_operator_split_follows_its_members_weights_not_the_tokenizer_checkpoint():
    """paper-scale members borrow the shipped tokenizer's checkpoint_dir; the baseline's proportional split (and the
    search's pilot) must read their real weight bytes, not that directory's (equal thirds before the fix)."""
    from eval.simulate.families import paper_family
    from eval.weights import weight_bytes
    from eval.baseline.static_split import proportional_split

    configs = [("a", hf_config(4, 512)), ("b", hf_config(8, 1024)), ("c", hf_config(16, 2048))]
    split = proportional_split(paper_family("test", configs))
    total = sum(weight_bytes(c) for _, c in configs)
    assert split == pytest.approx({n: weight_bytes(c) / total for n, c in configs})
    assert split["a"] < split["b"] < split["c"]


def test_a_paper_scale_trace_is_rebuilt_byte_for_byte_by_its_command_and_named_in_the_result(tmp_path):
    """The published traces name their sha256; the same command rebuilds the same bytes."""
    import hashlib
    import json

    from orchestrator.serve.cli import main

    digests = []
    for name in ("a", "b"):
        out, trace = tmp_path / f"{name}.json", tmp_path / f"{name}_trace.json"
        assert main(["simulate", "--family", "qwen3-large", "--gpu", "h200_sxm", "--sessions", "6", "--rates", "2",
                     "--seed", "3", "--systems", "mfs", "--no-progress", "--save-trace", str(trace),
                     "--out", str(out)]) == 0
        result = json.loads(out.read_text())
        digests.append(result["workload"]["trace_sha256"])
        assert digests[-1] == hashlib.sha256(trace.read_bytes()).hexdigest()
        # the quality its token placement gets from the published table, labelled, beside the token shares
        mfs = result["systems"]["mfs"]
        table = mfs["quality_from_table"]
        assert table["score"] == pytest.approx(sum(share * table["member_scores"][m]
                                                   for m, share in mfs["member_token_share"].items()))
        assert "published table" in table["label"] and table["sources"]
    assert digests[0] == digests[1]
    assert (tmp_path / "a_trace.json").read_bytes() == (tmp_path / "b_trace.json").read_bytes()


def test_natural_lengths_end_each_simulated_reply_where_the_datasets_did_and_send_the_cap():
    """No length oracle: a natural-length request carries the trace's cap and no ignore_eos; the simulated
    engine ends it with EOS after the dataset reply's length (turns that reached the cap end at the cap)."""
    from eval.bench.sessions import ClosedLoopSessions
    from eval.workloads import Session, Trace, Turn, WorkloadSpec, natural_lengths, with_lengths
    from eval.bench.confidence_file import request_key

    spec = WorkloadSpec(num_sessions=1, max_output_tokens=8)
    trace = Trace(spec, [Session("s0", "multiturn", "c0", [Turn([1, 2, 3], 5, 0.0, [1, 2, 3]),
                                                           Turn([1, 2, 3, 9], 8, 0.0, [9])])], [0.0])
    assert trace.spec.lengths == "natural"
    assert natural_lengths(trace, request_key) == {"s0-t0": 5}          # the second reply reached the cap
    record, request = ClosedLoopSessions(trace, "x").start_turn(0, 0, 0.0, 0.0)
    assert request.sampling.max_tokens == 8 and not request.sampling.ignore_eos
    exact = with_lengths(trace, "exact")
    assert natural_lengths(exact, request_key) == {}
    _, request = ClosedLoopSessions(exact, "x").start_turn(0, 0, 0.0, 0.0)
    assert request.sampling.max_tokens == 5 and request.sampling.ignore_eos

    family = nested_family()
    executor = SimExecutor(family, 64, 1024, FakeCost(), library(members=("s", "m", "l")), vocab_size=50,
                           request_keys={"r": "s0-t0"}, natural_lengths={"s0-t0": 5})
    eos = family.member("s").eos_token_ids[0]
    tokens = [executor.execute(StepPlan(batches=[MemberBatch("s", [chunk("r", 9 + p, 1, generated=p)])]))[0].token_id
              for p in range(7)]
    assert tokens[5] == eos and eos not in tokens[:5] and tokens[6] != eos


def test_mixed_steps_grid_is_refused_for_the_tiny_family_whose_engine_was_timed():
    import argparse

    from eval.simulate.cli import add_arguments, build_setup, sim_settings

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--family", "tiny", "--quick", "--mixed-steps", "grid"])
    with pytest.raises(PlacementError, match="--mixed-steps prices paper-scale"):
        build_setup(args, sim_settings(args))


def test_a_family_without_its_measured_table_is_refused_naming_the_command_that_measures_it(tmp_path, monkeypatch,
                                                                                             capsys):
    """Each family run on this machine has its own measured cost model (eval/simulate/paths.py); where it is
    missing, `mfs simulate` stops in one line naming the command that measures it (it never times the engine in
    the middle of a run)."""
    import argparse

    from eval.simulate import paths
    from eval.simulate.cli import add_arguments, main_one

    monkeypatch.setattr(paths, "TABLES_DIR", tmp_path)           # no family has a table here
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--family", "tiny-sep", "--cost-model", "measured", "--quick",
                              "--out", str(tmp_path / "sim.json")])
    with pytest.raises(SystemExit) as stopped:
        main_one(args)
    message = str(stopped.value)
    assert message.count("\n") == 0 and message.startswith("mfs simulate: no measured cost model for tiny-sep")
    assert f"python -m eval.simulate.measure --family tiny-sep --out {tmp_path / 'tiny-sep_measured.json'}" in message
    assert not (tmp_path / "sim.json").exists() and not list(tmp_path.glob("*.json"))


def test_the_separate_family_is_measured_into_its_own_table_and_simulated_on_it(tmp_path, monkeypatch):
    """`python -m eval.simulate.measure --family tiny-sep` (a one-point grid here: this checks the command, not
    the timings) writes tables/tiny-sep_measured.json; `mfs simulate --family tiny-sep` then runs on it, its
    replies reading the nested family's recorded confidences member by member of the same rank."""
    import argparse

    from eval.simulate import measure, paths
    from eval.simulate.cli import add_arguments, run_simulation

    monkeypatch.setattr(paths, "TABLES_DIR", tmp_path)
    for name, value in (("DECODE_BATCH", (1, 2)), ("DECODE_CONTEXT", (16, 64)), ("PREFILL_TOKENS", (16, 32)),
                        ("PREFIX", (0, 16)), ("MIX_POINTS", ((16, 2, 16),)), ("REPEATS", 1)):
        monkeypatch.setattr(measure, name, value)
    assert measure.main(["--family", "tiny-sep"]) == 0
    table = load_table(tmp_path / "tiny-sep_measured.json")
    assert set(table.members) == {"sep-s", "sep-m", "sep-l"} and "tiny-sep family" in table.source
    assert {m.ride_overlap for m in table.members.values()} == {1.0}       # nothing nests: no member rides
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    result = run_simulation(parser.parse_args(["--family", "tiny-sep", "--cost-model", "measured", "--quick",
                                               "--sessions", "2", "--rates", "1", "--no-progress"]))
    simulated = result["simulated"]
    assert "tiny-sep family" in simulated["cost_model"]["source"]
    assert simulated["confidences"]["member_mapping"] == {"sep-s": "tiny-s", "sep-m": "tiny-m", "sep-l": "tiny-l"}
    for metrics in result["systems"].values():
        assert metrics["num_failed"] == 0 and set(metrics["solo_decode_step_s"]) == {"sep-s", "sep-m", "sep-l"}
