"""Bench: system configs (baseline static split, ablation knobs), metric arithmetic, the real-time driver."""
from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest

from eval.bench.metrics import RequestRecord, counter_delta, pages_timeline, prefix_hit_rates, summarize
from eval.composition import load_system_config
from eval.systems import SYSTEMS, RoutedRequest, apply_floors, best_static_split, system_config, system_scheduler
from eval.workloads import Session, Trace, Turn, WorkloadSpec
from orchestrator.core.config import load_config
from orchestrator.core.family import FamilySpec, MemberSpec
from orchestrator.core.types import MemberName, MemberSpan, RequestOutput

SPLIT = {"tiny-s": 0.2, "tiny-m": 0.3, "tiny-l": 0.5}


def fake_family() -> FamilySpec:
    members = tuple(MemberSpec(name=MemberName(n), index=i, checkpoint_dir=Path("."), architecture="llama",
                               num_layers=layers, hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64,
                               vocab_size=4096, context_tokens=1024, layer_lineages=tuple(f"l{j}" for j in range(layers)),
                               tokenizer_hash="t", eos_token_ids=(2,))
                    for i, (n, layers) in enumerate((("tiny-s", 2), ("tiny-m", 4), ("tiny-l", 8))))
    return FamilySpec(name="tiny", members=members)


# ----------------------------------------------------------------------------- systems
def test_baseline_split_is_traffic_share_of_tokens_times_layers():
    config = load_config(overrides={"pool.num_pages": 100_000})   # ample: no floor binds
    # thresholds [0.4, 0.7]: 0.1 -> tiny-s, 0.5 -> tiny-m, 0.9 -> tiny-l
    requests = [RoutedRequest(0.1, 400), RoutedRequest(0.1, 400), RoutedRequest(0.5, 300), RoutedRequest(0.9, 200)]
    split = best_static_split(fake_family(), requests, config, 100_000)
    # weights: s 800*2=1600, m 300*4=1200, l 200*8=1600 -> total 4400
    assert split.traffic_share == pytest.approx({"tiny-s": 1600 / 4400, "tiny-m": 1200 / 4400, "tiny-l": 1600 / 4400})
    assert split.fractions == pytest.approx(split.traffic_share)
    assert sum(split.fractions.values()) == pytest.approx(1.0, abs=1e-12)
    assert split.requests_by_member == {"tiny-s": 2, "tiny-m": 1, "tiny-l": 1}


def test_split_floors_use_the_page_rule_residual_pages_included():
    from eval.baseline.split_pool import split_pages

    config = load_config(overrides={"pool.num_pages": 1024})
    requests = [RoutedRequest(0.1, 500)] * 5 + [RoutedRequest(0.5, 100)]
    split = best_static_split(fake_family(), requests, config, 1024)
    assert sum(split.fractions.values()) == pytest.approx(1.0, abs=1e-12)
    assert all(f > 0 for f in split.fractions.values())
    pages = split_pages(1024, split.fractions)
    # the longest request + the decode reserve: ceil(500/16)+1 = 33 blocks. tiny-l got no routed traffic yet
    # must hold it: 33 x 8 layers; tiny-s and tiny-m record a residual page per block (the nested
    # handover of this config, what the old arithmetic forgot): 33 x (2+1) and 33 x (4+1)
    assert pages["tiny-l"] >= 33 * 8 and pages["tiny-m"] >= 33 * 5 and pages["tiny-s"] >= 33 * 3
    assert split.notes
    load_system_config({"comparison.static_split": split.fractions})   # the validator accepts it


def test_proportional_split_follows_weight_bytes(tmp_path):
    from dataclasses import replace as dc_replace

    from eval.baseline.static_split import proportional_split
    from eval.weights import member_weight_bytes
    from orchestrator.core.family import FamilySpec

    family = fake_family()
    sizes = member_weight_bytes(family)               # no files: the shape estimate, growing with layers
    assert sizes["tiny-s"] < sizes["tiny-m"] < sizes["tiny-l"]
    dirs = []
    for name, size in (("s", 100), ("m", 300), ("l", 600)):
        d = tmp_path / name
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"x" * size)
        dirs.append(d)
    with_files = FamilySpec(name="f", members=tuple(dc_replace(m, checkpoint_dir=d) for m, d in zip(family.members, dirs)))
    assert proportional_split(with_files) == pytest.approx({"tiny-s": 0.1, "tiny-m": 0.3, "tiny-l": 0.6})
    # no files but a config.json (a random-weights checkpoint): its exact bytes, with its own MLP width and tying
    from eval.weights import weight_bytes
    hf = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100,
          "intermediate_size": 160, "tie_word_embeddings": False}
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "config.json").write_text(json.dumps(hf))
    configured = FamilySpec(name="f", members=tuple(dc_replace(m, checkpoint_dir=tmp_path / "cfg") for m in family.members))
    assert set(member_weight_bytes(configured).values()) == {weight_bytes(hf)}


def test_split_floor_pages_are_the_schedulers_page_rule():
    from eval.baseline.static_split import config_layout, pages_rule

    config = load_config(overrides={"pool.num_pages": 1024})
    pages_for_tokens = pages_rule(fake_family(), config)
    layout = config_layout(fake_family(), config)
    for member in ("tiny-s", "tiny-m", "tiny-l"):
        assert pages_for_tokens(member, 500) == layout.pages_for_tokens(member, 500)
    assert layout.pages_for_tokens("tiny-m", 500) + layout.pages_per_block("tiny-m") == 33 * 5


def test_apply_floors():
    fractions, _ = apply_floors({"a": 0.9, "b": 0.1, "c": 0.0}, {"a": 0.05, "b": 0.05, "c": 0.2})
    assert fractions["c"] == pytest.approx(0.2)
    assert fractions["a"] / fractions["b"] == pytest.approx(9.0)
    assert sum(fractions.values()) == pytest.approx(1.0)


def test_system_knobs():
    cfg = {name: system_config(name, "tiny", 256, SPLIT) for name in SYSTEMS}
    assert all(c.pool.num_pages == 256 for c in cfg.values())
    default = load_config()
    mfs = cfg["mfs"]
    assert mfs.comparison.static_split is None and mfs.comparison.use_affinity and mfs.comparison.warmup
    assert mfs.pool.host_tier_mb == default.pool.host_tier_mb and mfs.comparison.cross_member_sharing
    b = cfg["baseline"]
    assert b.comparison.static_split == SPLIT and not b.comparison.cross_member_sharing
    # only the baselines run as separate deployments (the core's scheduler with eval's deployment policies)
    assert [n for n in SYSTEMS if system_scheduler(n) is not None] == \
        ["baseline", "baseline_elastic", "baseline_per_turn", "baseline_legacy", "baseline_spec",
         "baseline_elastic_spec"]
    searched = {"tiny-s": 0.1, "tiny-m": 0.2, "tiny-l": 0.7}
    for name in ("baseline", "baseline_per_turn", "baseline_legacy", "baseline_spec"):
        assert system_config(name, "tiny", 256, SPLIT, baseline_split=searched).comparison.static_split == searched
    assert cfg["baseline_elastic"].comparison.static_split is None
    assert cfg["baseline_elastic_spec"].comparison.static_split is None
    assert system_config("no_shared_pool", "tiny", 256, SPLIT, baseline_split=searched).comparison.static_split == SPLIT
    # the fair baselines keep MFS's host tier (the config's, or the node's when given); baseline_legacy has none
    assert (b.pool.host_tier_mb, b.pool.disk_tier_mb) == (default.pool.host_tier_mb, 0.0)
    assert system_config("baseline", "tiny", 256, SPLIT, host_tier_mb=512.0).pool.host_tier_mb == 512.0
    legacy = cfg["baseline_legacy"]
    assert (legacy.pool.host_tier_mb, legacy.pool.disk_tier_mb) == (0.0, 0.0)
    # --baseline-host-tier: baseline_legacy's deployments get MFS's host tier too
    hosted = system_config("baseline_legacy", "tiny", 256, SPLIT, baseline_host_tier=True)
    assert (hosted.pool.host_tier_mb, hosted.pool.disk_tier_mb) == (default.pool.host_tier_mb, 0.0)
    assert system_config("baseline_legacy", "tiny", 256, SPLIT, host_tier_mb=512.0).pool.host_tier_mb == 0.0
    assert system_config("mfs", "tiny", 256, SPLIT, host_tier_mb=512.0).pool.host_tier_mb == 512.0
    assert system_config("no_tiers", "tiny", 256, SPLIT, host_tier_mb=512.0).pool.host_tier_mb == 0.0
    assert not b.comparison.use_affinity and not b.comparison.use_load
    assert b.comparison.cold_handover and not b.comparison.warmup
    assert not cfg["no_affinity"].comparison.use_affinity and cfg["no_affinity"].comparison.use_load
    nsp = cfg["no_shared_pool"]
    assert nsp.comparison.static_split == SPLIT and nsp.comparison.use_affinity and nsp.pool.host_tier_mb == default.pool.host_tier_mb
    assert (cfg["no_tiers"].pool.host_tier_mb, cfg["no_tiers"].pool.disk_tier_mb) == (0.0, 0.0)
    assert not cfg["no_warmup"].comparison.warmup and not cfg["no_warmup"].comparison.cold_handover
    nls = cfg["no_layer_sharing"]
    assert not nls.comparison.cross_member_sharing and not nls.comparison.reuse_shared_layers
    assert nls.comparison.static_split is None and nls.comparison.use_affinity
    # baseline_legacy runs a single-model server's older scheduler policies; mfs_single_server_policies is MFS with
    # them and routing without load terms; mfs and the fair baselines get the defaults (tests/test_baseline_parity.py).
    for name in ("baseline_legacy", "mfs_single_server_policies"):
        sched = cfg[name].scheduler
        assert (sched.decode_reservation, sched.aging_steps, sched.victim_order, sched.decode_step_token_budget) == \
            ("block", None, "youngest", None)
    single = cfg["mfs_single_server_policies"]
    assert single.router.session_bonus == 0.2 and single.comparison.static_split is None
    for name in ("mfs", "baseline", "baseline_elastic", "baseline_per_turn"):
        assert (cfg[name].scheduler.decode_reservation, cfg[name].scheduler.victim_order) == ("peak", "priority_progress")
    with pytest.raises(ValueError):
        system_config("baseline", "tiny", 256, None)


# ----------------------------------------------------------------------------- metrics
def _record(turn, send, first, finish, prompt, cached, out, members):
    return RequestRecord(session_id="s", turn_index=turn, send_s=send, first_token_s=first, finish_s=finish,
                         prompt_tokens=prompt, cached_tokens=cached, output_tokens=out, members=members)


def test_summarize_exact_numbers():
    records = [
        _record(0, 0.0, 0.5, 2.5, 100, 0, 5, ["tiny-s"]),              # ttft .5, tpot .5, e2e 2.5
        _record(1, 1.0, 1.1, 2.1, 200, 100, 11, ["tiny-s", "tiny-m"]),  # ttft .1, tpot .1, e2e 1.1, escalated
        _record(0, 2.0, None, None, 50, 0, 0, []),                      # failed: excluded from latency
    ]
    records[2].error = "QueueFull"
    counters = {"prefix_query_tokens": {"tiny-s": 300, "tiny-m": 100},
                "prefix_hit_tokens": {"tiny-s": {"arena": 60, "host": 30}, "tiny-m": {"arena": 10, "disk": 0}},
                "preemptions": 3, "escalations": {"tiny-s->tiny-m": 1}}
    m = summarize(records, counters, duration_s=4.0, timeline=[[0.0, 1, 2, 3, 4]])
    assert m["mean_token_latency_s"] == pytest.approx((2.5 / 5 + 1.1 / 11) / 2)
    assert m["ttft_p50_s"] == pytest.approx(0.3) and m["ttft_p99_s"] == pytest.approx(0.1 + 0.4 * 0.99)
    assert m["tpot_p50_s"] == pytest.approx(0.3)
    assert m["e2e_p50_s"] == pytest.approx(1.8)
    assert m["throughput_tok_s"] == pytest.approx(16 / 4.0)
    assert m["prefix_hit_rate"] == pytest.approx(100 / 300)
    assert m["prefix_hit_rate_by_tier"] == pytest.approx({"arena": 70 / 400, "host": 30 / 400, "disk": 0.0})
    assert m["prefix_hit_rate_by_member"] == pytest.approx({"tiny-s": 0.3, "tiny-m": 0.1})
    assert m["escalation_rate"] == 0.5 and m["preemptions"] == 3
    assert (m["num_requests"], m["num_failed"]) == (2, 1)
    assert m["requests_by_member"] == {"tiny-s": 1, "tiny-m": 1}
    assert m["pages_timeline"] == [[0.0, 1, 2, 3, 4]]
    row = m["per_request"][1]
    assert (row["turn_index"], row["member"], row["escalated"], row["cached_tokens"]) == (1, "tiny-m", True, 100)
    json.dumps(m)


def test_paired_token_latency_compares_only_requests_both_served():
    from eval.bench.metrics import RequestRecord, paired_token_latency

    def rec(session, turn, e2e, tokens, error=None):
        return RequestRecord(session, turn, send_s=0.0, first_token_s=0.01, finish_s=e2e, prompt_tokens=4,
                             cached_tokens=0, output_tokens=tokens, error=error)

    ours = [rec("a", 0, 1.0, 10), rec("a", 1, 3.0, 10), rec("b", 0, 8.0, 10)]
    theirs = [rec("a", 0, 2.0, 10), rec("a", 1, 4.0, 10), rec("b", 0, 0.0, 0, error="too long")]
    mine, base, count = paired_token_latency(ours, theirs)
    assert count == 2                       # ("b", 0) was refused by the other side: left out of both means
    assert mine == pytest.approx(0.2) and base == pytest.approx(0.3)


def test_decode_floor_charges_each_token_one_solo_step_of_its_member():
    from eval.bench.metrics import decode_floor_token_latency, member_tokens

    step = {"tiny-s": 0.001, "tiny-m": 0.002, "tiny-l": 0.004}
    escalated = _record(0, 0.0, 0.1, 1.0, 50, 0, 10, ["tiny-s", "tiny-l"])
    escalated.tokens_by_member = {"tiny-s": 6, "tiny-l": 4}
    plain = _record(1, 0.0, 0.1, 1.0, 50, 0, 5, ["tiny-m"])              # no span counts: all on its member
    refused = _record(2, 0.0, None, None, 50, 0, 0, [])
    refused.error = "too long"
    assert member_tokens(plain) == {"tiny-m": 5}
    floor = decode_floor_token_latency([escalated, plain, refused], step)
    assert floor == pytest.approx(((6 * 0.001 + 4 * 0.004) / 10 + 0.002) / 2)
    assert decode_floor_token_latency([escalated], {"tiny-s": 0.001}) is None   # tiny-l's cost unknown
    m = summarize([escalated, plain], {}, duration_s=1.0)
    assert m["output_tokens_by_member"] == {"tiny-s": 6, "tiny-l": 4, "tiny-m": 5}
    assert m["per_request"][0]["tokens_by_member"] == {"tiny-s": 6, "tiny-l": 4}


def test_reroutes_are_counted_by_direction_and_refused_escalations_from_the_counters():
    up = _record(0, 0.0, 0.1, 1.0, 50, 0, 5, ["tiny-l"])
    up.rerouted_from = "tiny-m"
    down = _record(1, 0.0, 0.1, 1.0, 50, 0, 5, ["tiny-s", "tiny-m"])      # re-routed down, then escalated
    down.rerouted_from = "tiny-l"
    plain = _record(2, 0.0, 0.1, 1.0, 50, 0, 5, ["tiny-m"])
    m = summarize([up, down, plain], {"escalations_refused": 2}, duration_s=1.0, members=("tiny-s", "tiny-m", "tiny-l"))
    assert (m["reroutes"], m["reroutes_up"], m["reroutes_down"], m["escalations_refused"]) == (2, 1, 1, 2)
    unknown = summarize([up], {}, duration_s=1.0)                 # no member order: no direction
    assert (unknown["reroutes"], unknown["reroutes_up"], unknown["reroutes_down"]) == (1, None, None)
    assert unknown["escalations_refused"] == 0


def test_the_split_pilot_is_the_runs_first_sessions_at_its_lightest_and_middle_rates():
    from eval.baseline.split import pilot_rates, pilot_trace

    assert pilot_rates((4.0, 0.5, 1.0, 2.0, 8.0)) == (0.5, 2.0)
    assert pilot_rates((0.5, 2.0)) == (0.5, 2.0) and pilot_rates((3.0,)) == (3.0,)
    sessions = [Session(f"s{i}", "chat", f"c{i}", [Turn([1, 2], 4, 0.0)]) for i in range(5)]
    trace = Trace(spec=WorkloadSpec(num_sessions=5), sessions=sessions, arrival_times_s=[0.0, 1.0, 2.0, 3.0, 4.0])
    short = pilot_trace(trace, 2)
    assert [s.session_id for s in short.sessions] == ["s0", "s1"] and short.arrival_times_s == [0.0, 1.0]
    assert short.spec.num_sessions == 2 and pilot_trace(trace, 9) is trace


def test_counter_delta_and_timeline_and_empty_rates():
    after = {"a": {"x": 5, "y": 2}, "n": 7, "s": "keep"}
    assert counter_delta(after, {"a": {"x": 1}, "n": 2}) == {"a": {"x": 4, "y": 2}, "n": 5, "s": "keep"}
    assert prefix_hit_rates({})["prefix_hit_rate_counters"] is None
    snap = {"t_s": 0.5, "stats": {"pages": {"by_state": {"free": 9, "used": 3, "cached": 2, "host": 1}}}}
    assert pages_timeline([snap]) == [[0.5, 3, 2, 1, 0]]


# ----------------------------------------------------------------------------- driver (fake engine, no torch)
class FakeEngine:
    """Streams max_tokens tokens, one per output, from the member named by the prompt's first id."""

    def __init__(self):
        self.requests = []
        self.finished = 0

    def stats(self):
        return {"pages": {"by_state": {"used": self.finished, "cached": 0}},
                "counters": {"preemptions": self.finished, "prefix_query_tokens": {}, "prefix_hit_tokens": {}}}

    async def generate(self, request):
        self.requests.append(request)
        n = request.sampling.max_tokens
        for i in range(n):
            await asyncio.sleep(0.001)
            last = i == n - 1
            if last:
                self.finished += 1
            yield RequestOutput(request_id=request.request_id, new_token_ids=[7], new_logprobs=[0.0],
                                new_top_logprobs=[()], member=MemberName("tiny-s"), finished=last,
                                num_prompt_tokens=len(request.prompt_token_ids), num_cached_prompt_tokens=2,
                                spans=(MemberSpan(MemberName("tiny-s"), i + 1),))


def test_replay_sends_turns_in_order_with_greedy_ignore_eos():
    from eval.bench.cli import replay

    spec = WorkloadSpec(num_sessions=2, lengths="exact")       # every reply the dataset's length
    sessions = [Session("s0", "multiturn", "c0", [Turn([1, 2, 3], 3, 0.0, [1, 2, 3]),
                                                  Turn([1, 2, 3, 40, 41, 42, 4, 5], 2, 0.05, [4, 5])]),
                Session("s1", "short", "c1", [Turn([1, 9], 4, 0.0, [1, 9])])]
    trace = Trace(spec=spec, sessions=sessions, arrival_times_s=[0.0, 0.02])
    engine = FakeEngine()
    records, samples, counters, duration = asyncio.run(replay(engine, trace, "t"))
    assert len(records) == 3 and all(r.ok for r in records)
    # closed loop: turn 1 = turn 0's prompt + the reply this engine generated (7, 7, 7) + the user part
    assert [r.prompt_token_ids for r in engine.requests if "s0" in r.request_id] == [[1, 2, 3], [1, 2, 3, 7, 7, 7, 4, 5]]
    assert all(r.route_reason is None and not r.rerouted for r in records)
    assert all(r.sampling.temperature == 0.0 and r.sampling.ignore_eos for r in engine.requests)
    s0 = [r for r in records if r.session_id == "s0"]
    assert [r.output_tokens for r in s0] == [3, 2]
    assert s0[1].send_s >= s0[0].finish_s + 0.05 - 1e-3          # think time after the previous turn finished
    s1 = next(r for r in records if r.session_id == "s1")
    assert s1.send_s >= 0.02 - 1e-3                              # not before its arrival time
    assert counters["preemptions"] == 3 and samples and duration > 0
    assert all(r.cached_tokens == 2 and r.members == ["tiny-s"] for r in records)
    assert [r.tokens_by_member for r in s0] == [{"tiny-s": 3}, {"tiny-s": 2}]    # from the streamed spans


def test_probe_skips_a_member_the_engine_refuses():
    from eval.bench.cli import probe_decode_step_s, warm_up
    from orchestrator.core.errors import InvalidRequestError

    class SmallSlice(FakeEngine):
        async def generate(self, request):
            if request.pinned_member == "tiny-l":
                raise InvalidRequestError("request needs 32 KV pages on tiny-l; the pool can give it at most 25")
            async for out in super().generate(request):
                yield out

    engine = SmallSlice()
    asyncio.run(warm_up(engine, ["tiny-s", "tiny-l"], "w"))
    steps = asyncio.run(probe_decode_step_s(engine, ["tiny-s", "tiny-l"], "p", tokens=4))
    assert set(steps) == {"tiny-s"} and steps["tiny-s"] > 0     # tiny-l: no step cost, its floor reads n/a


def test_replay_dataset_history_resends_the_dataset_prompt_and_closed_loop_ends_a_failed_session():
    from dataclasses import replace as dc_replace

    from eval.bench.cli import replay

    turns = [Turn([1, 2, 3], 3, 0.0, [1, 2, 3]), Turn([1, 2, 3, 40, 41, 42, 4, 5], 2, 0.0, [4, 5])]
    trace = Trace(spec=WorkloadSpec(num_sessions=1, history="dataset"), sessions=[Session("s0", "multiturn", "c0", turns)],
                  arrival_times_s=[0.0])
    engine = FakeEngine()
    asyncio.run(replay(engine, trace, "d"))
    assert [r.prompt_token_ids for r in engine.requests] == [[1, 2, 3], [1, 2, 3, 40, 41, 42, 4, 5]]

    class Refusing(FakeEngine):
        async def generate(self, request):
            self.requests.append(request)
            raise ValueError("too long")
            yield  # pragma: no cover - makes this an async generator

    closed = Trace(spec=dc_replace(trace.spec, history="closed"), sessions=trace.sessions, arrival_times_s=[0.0])
    refusing = Refusing()
    records, *_ = asyncio.run(replay(refusing, closed, "c"))
    assert len(refusing.requests) == 1                      # no reply to send back: turn 1 is never sent
    assert [r.error for r in records] == ["ValueError: too long", "session ended: turn 0 failed"]


# ----------------------------------------------------------------------------- end to end (real local engine)
def test_tiny_end_to_end_bench(tmp_path):
    from eval.bench.cli import BenchSettings, format_table
    from eval.commands.bench import run_bench       # `mfs bench`'s: the split re-scored on the simulated pilot
    from tests.test_workloads import family_dir

    settings = BenchSettings(sessions=2, rate=2.0, kv_pages=512, family=str(family_dir()), max_turns=2,
                             max_prompt_tokens=256, max_output_tokens=8, think_s=0.2, progress=False,
                             rates=(2.0, 8.0))
    result = run_bench(settings)
    assert set(result["systems"]) == {"mfs", "baseline"}
    assert sum(result["settings"]["static_split"].values()) == pytest.approx(1.0)
    assert result["workload"]["history"] == "closed" and result["headline_rate"] == 2.0
    outputs = {}
    for m in result["systems"].values():
        assert m["num_requests"] == result["workload"]["num_requests"] and m["num_failed"] == 0
        assert m["mean_token_latency_s"] > 0
        outputs[id(m)] = sorted((r["session_id"], r["turn_index"], r["prompt_tokens"], r["output_tokens"])
                                for r in m["per_request"])
    a, b = outputs.values()
    # closed loop, greedy + ignore_eos: every system sees the same prompt lengths and generates exactly the
    # same number of tokens, though the tokens (its own replies, sent back) differ
    assert a == b
    assert any(turn == 1 for _, turn, _, _ in a)
    # the curve: both rates, every system, the same sessions (same lengths) at each rate
    assert [p["rate"] for p in result["curve"]] == result["rates"] == [2.0, 8.0]
    for point in result["curve"]:
        assert set(point["systems"]) == {"mfs", "baseline"}
        for m in point["systems"].values():
            assert m["num_failed"] == 0 and "per_request" not in m and m["decode_floor_token_latency_s"] > 0
            assert m["prompt_tokens"] == result["systems"]["mfs"]["prompt_tokens"]
        assert isinstance(point["reduction_ceiling"]["mfs"], float)
    assert result["curve"][0]["systems"]["mfs"]["mean_token_latency_s"] == result["systems"]["mfs"]["mean_token_latency_s"]
    for key in ("knee_rate", "reduction_at_knee", "capacity_at_slo", "slo"):
        assert key in result
    assert set(result["capacity_at_slo"]) == {"mfs", "baseline"}
    # the baseline: independent deployments on the split the core chose on a pilot simulated on the measured cost
    # model (no wall time): the operator's default and the search's shortlist, each at the lightest and a loaded rate
    from eval.baseline.static_split import proportional_split
    from orchestrator.core.family import load_family

    baseline_config = result["settings"]["configs"]["baseline"]
    assert baseline_config["comparison"]["static_split"] and not baseline_config["comparison"]["cross_member_sharing"]
    rescore = result["baseline_split_rescore"]
    assert rescore["winner"]["fractions"] == result["settings"]["baseline_split"] == baseline_config["comparison"]["static_split"]
    assert rescore["pilot"]["simulated"] and "measured" in rescore["pilot"]["cost_model"]
    assert rescore["pilot"]["rates"] == [2.0, 8.0] and rescore["pilot"]["sessions"] == 2
    assert rescore["default"]["fractions"] == pytest.approx(proportional_split(load_family(str(family_dir()))))
    for entry in (rescore["default"], *rescore["candidates"]):
        assert set(entry["by_rate"]) == {"2.0", "8.0"} and entry["by_rate"]["2.0"]["num_failed"] == 0
    assert len(rescore["candidates"]) == len(result["baseline_split_search"]["shortlist"]) <= 4
    assert result["baseline_proportional"]["fractions"] == rescore["default"]["fractions"]
    for point in result["curve"]:                  # every point says how many re-routes went each way
        for m in point["systems"].values():
            assert m["reroutes"] == m["reroutes_up"] + m["reroutes_down"] and m["escalations_refused"] >= 0
    assert result["slo"]["ttft_p90_s"] == pytest.approx(5 * result["curve"][0]["systems"]["baseline"]["ttft_p50_s"])
    assert isinstance(result["reduction_mean_token_latency"], float)
    for m in result["systems"].values():       # every member's decode step was probed, the floor is built on it
        assert set(m["solo_decode_step_s"]) == {"tiny-s", "tiny-m", "tiny-l"}
        probes = m["solo_decode_probes_s"]          # probed before and after the replay, the faster kept
        assert m["solo_decode_step_s"] == {k: min(probes["before"][k], probes["after"][k]) for k in probes["before"]}
        assert m["decode_floor_token_latency_s"] > 0
        assert sum(m["output_tokens_by_member"].values()) == sum(r["output_tokens"] for r in m["per_request"])
    assert isinstance(result["reduction_ceiling"]["mfs"], float)
    paired = result["paired_vs_baseline"]["mfs"]
    assert paired["num_requests"] == result["workload"]["num_requests"]   # nothing refused: the same requests
    assert paired["mean_token_latency_s"] == pytest.approx(result["systems"]["mfs"]["mean_token_latency_s"])
    json.dumps(result)
    assert "mfs" in format_table(result)


def test_the_baselines_pages_and_host_tier_of_a_separate_family_follow_its_own_layers():
    """The shipped separate-weight family (tiny-sep): no member records a residual page (nothing nests), so a
    deployment's slice holds one page per layer per block; every lineage is one member's (host tier parts)."""
    from eval.baseline.static_split import pages_rule, proportional_split
    from eval.baseline.tier_parts import host_tier_lineages
    from eval.composition import system_family

    config = system_config("baseline", "tiny-sep", 1024, {"sep-s": 0.2, "sep-m": 0.3, "sep-l": 0.5})
    family = system_family(config)
    assert [m.name for m in family.members] == ["sep-s", "sep-m", "sep-l"] and not family.is_nested()
    rule = pages_rule(family, config)
    for member in family.members:
        assert rule(member.name, 100) == -(-100 // 16) * member.num_layers      # 16 tokens per 16 KiB fp32 page
    lineages = host_tier_lineages(family)
    assert sum(map(len, lineages.values())) == len({l for names in lineages.values() for l in names})
    fractions = proportional_split(family)
    assert fractions["sep-s"] < fractions["sep-m"] < fractions["sep-l"] and sum(fractions.values()) == pytest.approx(1)


def test_separate_family_end_to_end_bench():
    """`mfs bench --family tiny-sep` (the bench's own run_bench, smallest settings): both systems serve every
    request of the closed-loop replay; the baseline's split is re-scored on the family's own measured cost model,
    or, where none is measured, stays the operator's default and the JSON names the command that measures one."""
    from eval.bench.cli import BenchSettings
    from eval.commands.bench import run_bench
    from eval.simulate.paths import fitted_model_path, measured_table_path

    settings = BenchSettings(sessions=2, rate=4.0, kv_pages=512, family="tiny-sep", max_turns=2,
                             max_prompt_tokens=128, max_output_tokens=6, think_s=0.1, progress=False,
                             rates=(4.0,), score_quality=False)
    result = run_bench(settings)
    assert set(result["systems"]) == {"mfs", "baseline"}
    lengths = []
    for m in result["systems"].values():
        assert m["num_requests"] == result["workload"]["num_requests"] and m["num_failed"] == 0
        assert set(m["solo_decode_step_s"]) == {"sep-s", "sep-m", "sep-l"}
        lengths.append(sorted((r["session_id"], r["turn_index"], r["prompt_tokens"], r["output_tokens"])
                              for r in m["per_request"]))
    assert lengths[0] == lengths[1]
    baseline = result["settings"]["configs"]["baseline"]
    assert set(baseline["comparison"]["static_split"]) == {"sep-s", "sep-m", "sep-l"}
    assert not baseline["comparison"]["cross_member_sharing"]
    if measured_table_path("tiny-sep").is_file() or fitted_model_path("tiny-sep").is_file():
        assert result["baseline_split_rescore"]["pilot"]["simulated"]
    else:
        assert result["settings"]["baseline_split"] == result["baseline_proportional"]["fractions"]
        assert ("python -m eval.simulate.measure --family tiny-sep --out eval/simulate/tables/tiny-sep_measured.json"
                in result["baseline_proportional"]["note"])


def test_bench_cli_saves_and_replays_a_trace(tmp_path, capsys):
    """--save-trace then --trace replays the very same requests (no ShareGPT needed the second time)."""
    from eval.bench.cli import add_arguments, main
    from tests.test_workloads import family_dir
    import argparse

    def run(*flags):
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        return main(parser.parse_args(["--family", str(family_dir()), "--systems", "mfs", "--no-quality",
                                       "--no-progress", "--kv-pages", "512", *flags]))

    first, second = tmp_path / "a.json", tmp_path / "b.json"
    trace = tmp_path / "trace.json"
    assert run("--sessions", "2", "--rate", "4", "--quick", "--out", str(first), "--save-trace", str(trace)) == 0
    assert run("--trace", str(trace), "--out", str(second), "--rates", "4") == 0
    a, b = json.loads(first.read_text()), json.loads(second.read_text())
    assert a["workload"] == b["workload"] and a["workload"]["history"] == "closed"
    assert a["rates"] == b["rates"] == [4.0] and a["knee_rate"] is None
    rows = [sorted((r["session_id"], r["turn_index"], r["prompt_tokens"], r["output_tokens"])
                   for r in x["systems"]["mfs"]["per_request"]) for x in (a, b)]
    assert rows[0] == rows[1] and len(rows[0]) >= 2
    assert any("trace replayed from" in n for n in b["notes"])
    with pytest.raises(SystemExit, match="drop --rate/--sessions"):
        run("--trace", str(trace), "--rate", "2")
    trace.write_text("{}")
    with pytest.raises(SystemExit, match="not an mfs-trace/3 file"):
        run("--trace", str(trace), "--out", str(second))
    with pytest.raises(SystemExit, match="positive"):
        run("--rates", "1,-2")


def test_baseline_split_modes_without_a_pilot():
    """traffic: the old traffic-share split; proportional: weight bytes, no pilot run (nothing is replayed)."""
    from eval.baseline.split import choose_baseline_split
    from eval.bench.cli import BenchSettings
    from eval.baseline.static_split import StaticSplit, proportional_split
    from orchestrator.core.family import load_family
    from tests.test_workloads import family_dir

    family = load_family(str(family_dir()))
    traffic = StaticSplit(fractions=dict(SPLIT), traffic_share=dict(SPLIT), requests_by_member={})
    trace = Trace(spec=WorkloadSpec(num_sessions=1), sessions=[], arrival_times_s=[])   # never replayed here

    def no_pilot(fractions, trace):
        raise AssertionError("these modes run no pilot")

    split, about = choose_baseline_split(BenchSettings(baseline_split="traffic"), family, trace, (1.0,), traffic,
                                         None, no_pilot)
    assert split == SPLIT and about == {}
    split, about = choose_baseline_split(BenchSettings(baseline_split="proportional"), family, trace, (0.5, 1.0), traffic,
                                         None, no_pilot)
    assert split == proportional_split(family) == about["baseline_proportional"]["fractions"]
    assert "baseline_split_rescore" not in about
    given = "tiny-l=0.5,tiny-s=0.2,tiny-m=0.3"          # any order on the command line; the family's in the result
    split, about = choose_baseline_split(BenchSettings(baseline_split=given), family, trace, (0.5,), traffic, None, no_pilot)
    assert list(split.items()) == [("tiny-s", 0.2), ("tiny-m", 0.3), ("tiny-l", 0.5)]
    assert about == {"baseline_fixed": {"fractions": split, "rule": "given with --baseline-split"}}


def fake_pilot(latency_by_split, guards_by_split=None):
    """A PilotRunner whose baseline takes latency_by_split[split's tiny-s fraction] at every rate (and the given
    quality-guard counts), recording what it ran."""
    from eval.systems import system_config

    ran = []

    def run(fractions, trace):
        ran.append((dict(fractions), trace.spec.rate_sessions_per_s, len(trace.sessions)))
        key = round(fractions["tiny-s"], 3)
        metrics = {"mean_token_latency_s": latency_by_split[key], "num_failed": 0, "reroutes_down": 0,
                   "escalations_refused": 0, "solo_decode_step_s": {"tiny-s": 1e-3, "tiny-m": 2e-3, "tiny-l": 3e-3},
                   **(guards_by_split or {}).get(key, {})}
        return system_config("baseline", "tiny", 256, fractions), [], metrics

    return run, ran


def test_the_core_rescoring_picks_the_fastest_split_that_gives_up_no_quality(monkeypatch):
    """The default and the search's shortlist each replay the pilot (the run's first sessions) at the lightest and
    one loaded rate; a faster split that re-routes down more than the default is not eligible."""
    import eval.baseline.split as split_module
    from eval.bench.cli import BenchSettings
    from eval.baseline.static_split import StaticSplit, proportional_split
    from orchestrator.core.family import load_family
    from tests.test_workloads import family_dir

    family = load_family(str(family_dir()))
    default = proportional_split(family)
    traffic = StaticSplit(fractions=dict(SPLIT), traffic_share=dict(SPLIT), requests_by_member={})
    sessions = [Session(f"s{i}", "chat", f"c{i}", [Turn([1, 2, 3], 4, 0.0)]) for i in range(5)]
    trace = Trace(spec=WorkloadSpec(num_sessions=5, rate_sessions_per_s=1.0), sessions=sessions,
                  arrival_times_s=[float(i) for i in range(5)])
    shortlist = [{"tiny-s": 0.05, "tiny-m": 0.45, "tiny-l": 0.5}, {"tiny-s": 0.1, "tiny-m": 0.3, "tiny-l": 0.6},
                 {"tiny-s": 0.15, "tiny-m": 0.25, "tiny-l": 0.6}]
    monkeypatch.setattr(split_module, "shortlisted",
                        lambda settings, *args: (shortlist[:settings.split_candidates], {"shortlist": shortlist}))
    latency = {round(default["tiny-s"], 3): 0.010, 0.05: 0.005, 0.1: 0.008, 0.15: 0.009}
    run, ran = fake_pilot(latency, {0.05: {"reroutes_down": 3}})
    settings = BenchSettings(baseline_split="search", split_pilot_sessions=3)
    split, about = split_module.choose_baseline_split(settings, family, trace, (0.5, 1.0, 4.0), traffic, None, run,
                                                      "a fake cost model")
    assert split == shortlist[1]                     # 0.05 is faster but re-routes down: not eligible
    rescore = about["baseline_split_rescore"]
    assert rescore["chosen"] == "the search's #2" and rescore["winner"]["score_s"] == pytest.approx(0.008)
    assert rescore["default"]["fractions"] == default and rescore["default"]["score_s"] == pytest.approx(0.010)
    assert [c["eligible"] for c in rescore["candidates"]] == [False, True, True]
    assert rescore["candidates"][0]["ineligible_because"] == {"reroutes_down": 6}
    assert rescore["pilot"] == {"sessions": 3, "rates": [0.5, 1.0], "cost_model": "a fake cost model", "simulated": True}
    assert {(rate, n) for _, rate, n in ran} == {(0.5, 3), (1.0, 3)}      # the first 3 sessions, two rates
    assert len(ran) == 2 * 4
    # nothing faster than the default: the default stands; no candidates: the default alone is scored
    run, ran = fake_pilot({k: 0.010 for k in latency})
    split, about = split_module.choose_baseline_split(settings, family, trace, (1.0,), traffic, None, run)
    assert split == default and about["baseline_split_rescore"]["chosen"] == "default" and len(ran) == 4
    run, ran = fake_pilot(latency)
    split, about = split_module.choose_baseline_split(BenchSettings(split_candidates=0), family, trace, (1.0,),
                                                      traffic, None, run)
    assert split == default and about["baseline_split_rescore"]["candidates"] == [] and len(ran) == 1
    # no simulator for this family: the default stands, and the JSON says why
    split, about = split_module.choose_baseline_split(settings, family, trace, (1.0,), traffic, None, None)
    assert split == default and "no simulator" in about["baseline_proportional"]["note"]


def test_a_search_with_no_candidate_leaves_the_operators_default(monkeypatch):
    """The search may rank no candidate (a request no slice of any split holds): only the default is scored and
    it stands; the JSON says why."""
    import eval.baseline.split as split_module
    from eval.bench.cli import BenchSettings
    from eval.baseline.static_split import StaticSplit, proportional_split
    from orchestrator.core.family import load_family
    from tests.test_workloads import family_dir

    family = load_family(str(family_dir()))
    traffic = StaticSplit(fractions=dict(SPLIT), traffic_share=dict(SPLIT), requests_by_member={})
    trace = Trace(spec=WorkloadSpec(num_sessions=1), sessions=[], arrival_times_s=[])

    def infeasible(*args, **kwargs):
        raise ValueError("no split lets every request run on its routed member or a larger one")

    monkeypatch.setattr(split_module, "search_split", infeasible)
    monkeypatch.setattr(split_module, "sim_sessions", lambda *args: [])
    run, _ = fake_pilot({round(proportional_split(family)["tiny-s"], 3): 0.01})
    split, about = split_module.choose_baseline_split(BenchSettings(baseline_split="search"), family, trace, (1.0,),
                                                      traffic, None, run)
    assert split == proportional_split(family)
    assert about["baseline_split_search"]["error"].startswith("no split")
    assert about["baseline_split_rescore"]["chosen"] == "default"


@pytest.mark.parametrize("text, says", [
    ("tiny-s=0.5", "add up to 0.5"), ("tiny-s=0.5,tiny-m=0.5,tiny-l=0", "in (0, 1]"), ("tiny-s=0.5,tiny-s=0.5", "once"),
    ("tiny-s:0.5", "member=fraction"), ("seach", "member=fraction"), ("tiny-s=x,tiny-m=1", "member=fraction")])
def test_fixed_baseline_split_refused_with_the_reason(text, says):
    from eval.baseline.split import SplitError, parse_split_mode

    with pytest.raises(SplitError, match=re.escape(says)):
        parse_split_mode(text)


def test_fixed_baseline_split_must_name_the_family():
    from eval.baseline.split import SplitError, fixed_split, parse_split_mode
    from orchestrator.core.family import load_family
    from tests.test_workloads import family_dir

    family = load_family(str(family_dir()))
    assert parse_split_mode("search") == "search" and fixed_split("search", family) is None
    with pytest.raises(SplitError, match="the family tiny has"):
        fixed_split("tiny-s=0.5,tiny-x=0.5", family)
    with pytest.raises(SplitError, match="the family tiny has"):
        fixed_split("tiny-s=0.5,tiny-m=0.5", family)       # tiny-l missing


def test_the_recorded_sampling_says_what_the_requests_asked_for():
    """natural lengths: EOS ends a reply and max_tokens is the cap; exact: ignore_eos at the dataset length."""
    from eval.bench.cli import sampling_record

    assert sampling_record("natural", 128) == {"temperature": 0.0, "ignore_eos": False, "max_tokens": 128}
    exact = sampling_record("exact", 64)
    assert exact["ignore_eos"] is True and "dataset reply's length, at most 64" in exact["max_tokens"]


def test_largest_member_bound_is_where_the_largest_members_band_starts():
    from eval.bench.cli import largest_member_bound

    assert largest_member_bound([0.4, 0.7], 3) == 0.7
    assert largest_member_bound([0.4, 0.7], 2) == 0.4
    assert largest_member_bound([0.4, 0.7], 1) == 0.0
