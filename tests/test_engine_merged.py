"""Merged forward for nested members: one pass on the largest model, each chunk leaving at its member's depth,
gives the same tokens, logits and pages as one forward per member; members that do not nest are never merged."""
from __future__ import annotations

import pytest
import torch

from conftest_engine import PageCounter, build_model, llama_config, nested_family_on_disk, qwen2_config, write_family
from engines.local.executor import LocalExecutor
from eval.composition import per_member_lineages
from engines.local.model import PagedCausalLM
from orchestrator.core.family import load_family
from orchestrator.core.types import MemberBatch, RequestId, SamplingParams, SeqChunk, StepPlan

PAGE_BYTES = 1500          # 4 tokens per block (fp32, 2 kv heads x 16 dims) and a residual block fits a page
NUM_PAGES = 512
DEPTHS = {"s": 2, "m": 3, "l": 5}
# Merged and separate forwards evaluate the same expressions, but the BLAS kernels pick their blocking, and so
# the order of each dot product's fp32 sum, from the batch shape (one merged batch vs one per member). Two
# orders of a K-term fp32 sum differ by at most 2*K*u*sum|a_i*b_i| (u = 2**-24, the unit roundoff); to first
# order each of the at most DEPTHS["l"] layers adds one such rounding, the longest sum being the MLP's
# (intermediate_size = 128 in both test configs). sum|a_i*b_i| is of the order of the largest value compared,
# so that value sets the absolute scale (values near zero come from cancellation: only an absolute bound fits).
# Observed worst case: 1.22e-5 on values up to ~34 (3.6e-7 of the scale), 200x inside this bound; a wrong page,
# layer or position differs by O(1) of the scale and still fails.
FP32_ORDER_RTOL = 2 * DEPTHS["l"] * 128 * 2.0**-24      # 7.6e-5


def assert_close_fp32(actual: torch.Tensor, expected: torch.Tensor) -> None:
    scale = float(expected.abs().max())
    torch.testing.assert_close(actual, expected, rtol=FP32_ORDER_RTOL, atol=FP32_ORDER_RTOL * max(scale, 1.0))


def _prompt(length: int, offset: int = 0) -> list[int]:
    return [(5 * i + 11 + offset) % 250 + 3 for i in range(length)]


def _nested_family(root, config_factory, other_norm: bool = False):
    """s, m, l: s and m are l's lower layers (same embeddings, norm, head); other_norm gives s its own final
    norm, which the lineages do not see."""
    return nested_family_on_disk(root, config_factory, DEPTHS, other_norm=other_norm)


@pytest.fixture(scope="module", params=[llama_config, qwen2_config], ids=["llama", "qwen2"])
def family_root(request, tmp_path_factory):
    return _nested_family(tmp_path_factory.mktemp("merged"), request.param)


def _executors(root):
    family = load_family(root)
    return (LocalExecutor(family, NUM_PAGES, PAGE_BYTES),
            LocalExecutor(family, NUM_PAGES, PAGE_BYTES, merge_nested=False))


class _Plans:
    """Builds the same plans for both executors (fresh chunk objects, the same page ids)."""

    def __init__(self) -> None:
        self.pages = PageCounter(NUM_PAGES)
        self.block = 4

    def tables(self, num_layers: int, tokens: int) -> list[list[int]]:
        return [self.pages.take(-(-tokens // self.block)) for _ in range(num_layers)]

    @staticmethod
    def chunk(rid: str, tokens: list[int], tables, start_pos: int = 0, sample: bool = True, **extra) -> SeqChunk:
        sampling = extra.pop("sampling", SamplingParams(num_top_logprobs=3))
        return SeqChunk(request_id=RequestId(rid), token_ids=tokens, start_pos=start_pos,
                        block_tables=[list(t) for t in tables], sample=sample, sampling=sampling, **extra)


def _run_both(merged: LocalExecutor, separate: LocalExecutor, plan_factory):
    return merged.execute(plan_factory()), separate.execute(plan_factory())


def _assert_same(ours, theirs, merged: LocalExecutor, separate: LocalExecutor) -> None:
    assert [(s.request_id, s.token_id) for s in ours] == [(s.request_id, s.token_id) for s in theirs]
    for a, b in zip(ours, theirs):
        assert [t for t, _ in a.top_logprobs] == [t for t, _ in b.top_logprobs]
        assert_close_fp32(torch.tensor([a.logprob] + [v for _, v in a.top_logprobs], dtype=torch.float64),
                          torch.tensor([b.logprob] + [v for _, v in b.top_logprobs], dtype=torch.float64))
    # every page of the arena: K/V of every layer, residual pages, untouched pages
    assert_close_fp32(merged.arena.storage.view(torch.float32), separate.arena.storage.view(torch.float32))


def test_nested_members_are_grouped_once(family_root):
    merged, separate = _executors(family_root)
    assert merged.nested_pairs == {("s", "m"), ("s", "l"), ("m", "l")}
    assert separate.nested_pairs == set()


def test_merged_plan_matches_separate_forwards(family_root, monkeypatch):
    merged, separate = _executors(family_root)
    calls = []
    original = PagedCausalLM.forward
    monkeypatch.setattr(PagedCausalLM, "forward",
                        lambda self, *a, **k: calls.append(self.member.name) or original(self, *a, **k))
    plans = _Plans()
    # step 0: s prefills two prompts and writes their residuals, to be handed over to m and l
    to_m, to_l = _prompt(9, 1), _prompt(6, 2)
    s_tables = {"hm": plans.tables(2, 9 + 4), "hl": plans.tables(2, 6 + 4)}
    residual = {"hm": plans.pages.take(4), "hl": plans.pages.take(3)}
    step0 = lambda: StepPlan(batches=[MemberBatch("s", [
        _Plans.chunk("hm", to_m, s_tables["hm"], residual_table_out=residual["hm"]),
        _Plans.chunk("hl", to_l, s_tables["hl"], residual_table_out=residual["hl"])])])
    _assert_same(*_run_both(merged, separate, step0), merged, separate)
    # step 1: prefills on every member, two handovers (start_layer 2), residual out on s, m and l, seeded sampling
    t = {name: plans.tables(DEPTHS[name[0]], 16) for name in ("s1", "s2", "m1", "m2", "l1", "l2")}
    t["hm"] = s_tables["hm"] + plans.tables(1, 13)
    t["hl"] = s_tables["hl"] + plans.tables(3, 10)
    outs = {name: plans.pages.take(3) for name in ("s2", "m2", "l2")}
    hot = SamplingParams(temperature=0.8, top_k=20, seed=7, num_top_logprobs=3)
    step1 = lambda: StepPlan(batches=[
        MemberBatch("l", [_Plans.chunk("l1", _prompt(7, 3), t["l1"]),
                          _Plans.chunk("hl", to_l, t["hl"], start_layer=2, residual_table=residual["hl"]),
                          _Plans.chunk("l2", _prompt(10, 4), t["l2"], residual_table_out=outs["l2"], sampling=hot)]),
        MemberBatch("s", [_Plans.chunk("s1", _prompt(5, 5), t["s1"], sample=False),
                          _Plans.chunk("s2", _prompt(11, 6), t["s2"], residual_table_out=outs["s2"])]),
        MemberBatch("m", [_Plans.chunk("hm", to_m, t["hm"], start_layer=2, residual_table=residual["hm"]),
                          _Plans.chunk("m1", _prompt(3, 7), t["m1"], sampling=hot),
                          _Plans.chunk("m2", _prompt(8, 8), t["m2"], residual_table_out=outs["m2"])])],
        released_requests=[RequestId("nobody")])
    calls.clear()
    first = _run_both(merged, separate, step1)
    assert calls == ["l"] + ["l", "s", "m"]          # merged: one forward; separate: one per batch, plan order
    assert [s.request_id for s in first[0]] == ["l1", "hl", "l2", "s2", "hm", "m1", "m2"]
    _assert_same(*first, merged, separate)
    # step 2: decodes on every member (different lengths), the rest of s1's prefill, and an s decode in m's way
    tokens = {s.request_id: s.token_id for s in first[0]}
    length = {"l1": 7, "hl": 6, "l2": 10, "s2": 11, "hm": 9, "m1": 3, "m2": 8}
    decode = lambda rid, **extra: _Plans.chunk(rid, [tokens[rid]], t[rid], start_pos=length[rid], **extra)
    step2 = lambda: StepPlan(batches=[
        MemberBatch("m", [decode("hm"), decode("m1", sampling=hot), decode("m2")]),
        MemberBatch("s", [decode("s2"), _Plans.chunk("s1", _prompt(4, 9), t["s1"], start_pos=5)]),
        MemberBatch("l", [decode("l1"), decode("hl"), decode("l2", sampling=hot)])])
    calls.clear()
    second = _run_both(merged, separate, step2)
    assert calls == ["l", "m", "s", "l"]
    _assert_same(*second, merged, separate)


def test_merged_forward_logits_match_each_member(family_root):
    merged, separate = _executors(family_root)
    plans = _Plans()
    prompts = {"s": _prompt(6), "m": _prompt(9, 1), "l": _prompt(5, 2)}
    tables = {name: plans.tables(depth, 9) for name, depth in DEPTHS.items()}
    chunks = lambda: [_Plans.chunk(name, prompts[name], tables[name]) for name in DEPTHS]
    ours = merged.model("l").forward(merged.arena, chunks(), all_logits=True, exits=list(DEPTHS.values()))
    theirs = [separate.model(name).forward(separate.arena, [chunk], all_logits=True)
              for name, chunk in zip(DEPTHS, chunks())]
    assert_close_fp32(ours, torch.cat(theirs))
    with pytest.raises(ValueError, match="block tables"):
        merged.model("l").forward(merged.arena, chunks(), exits=[2, 2, 5])


@pytest.mark.parametrize("kind", ["per_member_lineage", "other_norm", "independent"])
def test_members_that_do_not_nest_run_separately(kind, tmp_path, monkeypatch):
    if kind == "independent":
        members = [(name, build_model(llama_config(num_layers=depth), seed=depth)) for name, depth in DEPTHS.items()]
        root = write_family(tmp_path, members)
    else:
        root = _nested_family(tmp_path, llama_config, other_norm=kind == "other_norm")
    family = per_member_lineages(load_family(root)) if kind == "per_member_lineage" else load_family(root)
    executor = LocalExecutor(family, NUM_PAGES, PAGE_BYTES)
    expected = {"per_member_lineage": set(), "other_norm": {("m", "l")}, "independent": set()}[kind]
    assert executor.nested_pairs == expected
    calls = []
    original = PagedCausalLM.forward
    monkeypatch.setattr(PagedCausalLM, "forward",
                        lambda self, *a, **k: calls.append(self.member.name) or original(self, *a, **k))
    plans = _Plans()
    plan = StepPlan(batches=[MemberBatch(name, [_Plans.chunk(name, _prompt(3), plans.tables(depth, 3))])
                             for name, depth in DEPTHS.items()])
    sampled = executor.execute(plan)
    assert [s.request_id for s in sampled] == ["s", "m", "l"]
    assert sorted(calls) == (["l", "s"] if kind == "other_norm" else ["l", "m", "s"])


def test_the_fp32_tolerance_accepts_reordered_sums_and_catches_a_wrong_value():
    torch.manual_seed(0)
    a, b = torch.randn(64, 128, dtype=torch.float64), torch.randn(128, 256, dtype=torch.float64)
    exact = a @ b
    in_order = (a.float() @ b.float())
    reordered = (a.float().flip(1) @ b.float().flip(0))         # the same sums, in the opposite order
    assert not torch.equal(in_order, reordered)
    assert_close_fp32(reordered, in_order)
    assert_close_fp32(in_order.double(), exact)
    wrong = in_order.clone()
    wrong[3, 7] += 0.01 * float(in_order.abs().max())           # e.g. one value read from the wrong page
    with pytest.raises(AssertionError):
        assert_close_fp32(wrong, in_order)
