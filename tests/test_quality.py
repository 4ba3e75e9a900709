"""Quality judged from outside the reply (eval/bench/quality.py): the serving members' likelihood of the reference."""
from __future__ import annotations

import pytest

from eval.bench.metrics import RequestRecord
from eval.bench.quality import member_token_share, reference_quality, request_weights


def record(session: str, turn: int, tokens_by_member: dict[str, int], prompt=(1, 2, 3), error=None) -> RequestRecord:
    total = sum(tokens_by_member.values())
    return RequestRecord(session_id=session, turn_index=turn, send_s=0.0, first_token_s=0.1,
                         finish_s=1.0, prompt_tokens=len(prompt), cached_tokens=0, output_tokens=total,
                         members=list(tokens_by_member), tokens_by_member=dict(tokens_by_member),
                         prompt_token_ids=list(prompt), error=error)


# per member: a fixed score, whatever tokens the member itself generated
SCORES = {"s": -3.0, "m": -2.0, "l": -1.0}


def fake_score(member, prompt, reference):
    assert list(reference) == [7, 8, 9] and list(prompt) == [1, 2, 3]
    return SCORES[member]


def test_an_escalated_request_weights_each_member_by_its_token_share():
    escalated = record("a", 0, {"s": 10, "l": 30})
    assert request_weights(escalated) == {"s": 0.25, "l": 0.75}
    refs = {("a", 0): [7, 8, 9], ("b", 1): [7, 8, 9]}
    assert reference_quality([escalated], refs, fake_score) == pytest.approx(0.25 * -3.0 + 0.75 * -1.0)
    # a request served by tiny-m alone scores tiny-m, however many tokens it produced
    alone = record("b", 1, {"m": 5})
    assert reference_quality([escalated, alone], refs, fake_score) == pytest.approx((-1.5 + -2.0) / 2)


def test_requests_without_a_reference_or_an_answer_are_left_out():
    refs = {("a", 0): [7, 8, 9]}
    failed = record("a", 0, {"l": 4}, error="timeout")
    unknown = record("z", 3, {"s": 4})
    assert reference_quality([failed, unknown], refs, fake_score) is None
    assert reference_quality([record("a", 0, {"m": 2}), unknown], refs, fake_score) == pytest.approx(-2.0)


def test_member_token_share_counts_kept_tokens_of_answered_requests():
    records = [record("a", 0, {"s": 10, "l": 30}), record("b", 0, {"m": 60}), record("c", 0, {"s": 99}, error="x")]
    assert member_token_share(records) == {"l": pytest.approx(0.3), "m": pytest.approx(0.6), "s": pytest.approx(0.1)}
    assert member_token_share([]) == {}


def test_local_scorer_scores_the_reference_under_the_named_member():
    torch = pytest.importorskip("torch")
    from engines.local.scoring import score_tokens
    from eval.bench.quality import _model, local_scorer
    from orchestrator.core.family import load_family, SHIPPED_FAMILIES_DIR

    family = load_family(SHIPPED_FAMILIES_DIR / "tiny")
    score = local_scorer(family, "float32")
    prompt, reference = [5, 6, 7, 8], [9, 10, 11]
    small, large = score("tiny-s", prompt, reference), score("tiny-l", prompt, reference)
    expected = score_tokens(_model(family.member("tiny-l"), "float32"), "tiny-l", [*prompt, *reference], start=4)
    assert large == pytest.approx(sum(expected) / 3) and small != large
    assert torch.isfinite(torch.tensor([small, large])).all()


def test_the_published_table_scores_every_paper_scale_member_and_weights_by_token_share():
    from eval.simulate.families import DRAFTS_ONLY, PRESETS
    from eval.simulate.published_quality import PUBLISHED_MMLU, covers, table_quality

    for family, members in PRESETS.items():          # every simulated paper-scale member that serves has a score
        assert covers([name for name, _ in members if name != DRAFTS_ONLY.get(family)])
    for family in (("qwen3-0.6b", "qwen3-1.7b", "qwen3-8b", "qwen3-32b"), ("llama3.1-8b", "llama3.1-70b")):
        scores = [PUBLISHED_MMLU[m][0] for m in family]
        assert scores == sorted(scores)              # larger members score higher in both sources
    quality = table_quality({"qwen3-1.7b": 0.25, "qwen3-32b": 0.75})
    assert quality["score"] == pytest.approx(0.25 * 62.63 + 0.75 * 83.61)
    assert quality["member_scores"] == {"qwen3-1.7b": 62.63, "qwen3-32b": 83.61}
    assert len(quality["sources"]) == 1 and "arXiv:2505.09388" in quality["sources"][0]
    assert "not a measurement" in quality["label"]
    assert table_quality({"tiny-s": 1.0}) is None and table_quality({}) is None   # no stated score: none given
