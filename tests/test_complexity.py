"""Complexity estimator: range, determinism, and the orderings it must get right."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from orchestrator.core.complexity import ComplexityEstimator, ComplexityParams, estimator_for_vocab

WORDS = ["<pad>", "<|user|>", "<|assistant|>", " hi", " hello", " how", " are", " you", " ok", " thanks", " the",
         " a", " is", " cat", " nice", " day", "!", "?", ".", ",",
         " def", " class", " import", " return", "```", " {", " }", ";", " ==", "()", " function", " self",
         " why", " explain", " prove", " step", " because", " analyze", " compare", " calculate",
         " 1", " 2", "42", " +", " *", " =", " integral", " x", " y", " value", " list", " sort", " numbers",
         " this", " (", " )", ":", " sorted", " slow", " f", " A", " by", " and"]
VOCAB = WORDS + [f" w{i}" for i in range(200)]   # plain filler words
ID = {w.strip(): i for i, w in enumerate(WORDS)}
USER, ASSISTANT = ID["<|user|>"], ID["<|assistant|>"]
ESTIMATOR = ComplexityEstimator(VOCAB, role_token_ids=(USER, ASSISTANT))


def ids(text: str) -> list[int]:
    return [ID[word] for word in text.split()]


CHIT_CHAT = [USER] + ids("hi how are you ?") + [ASSISTANT]
CODE_TASK = ([USER] + ids("explain why this def sort ( numbers ) : return sorted ; is slow because") +
             ids("``` def f ( x ) : return x == 42 ; class A { import } ```") * 20 +
             ids("compare step by step and calculate 1 + 2 * 42") + [ASSISTANT])
PROSE = [USER] + [len(WORDS) + (i * 7) % 200 for i in range(400)] + [ASSISTANT]


def test_range_and_determinism():
    for prompt in ([], CHIT_CHAT, CODE_TASK, PROSE, [ID["?"]] * 5000):
        score = ESTIMATOR.score(prompt)
        assert 0.0 <= score <= 1.0
        assert ESTIMATOR.score(prompt) == score
        assert ComplexityEstimator(VOCAB, (USER, ASSISTANT)).score(prompt) == score


def test_long_code_and_reasoning_beats_chit_chat():
    assert ESTIMATOR.score(CODE_TASK) > ESTIMATOR.score(PROSE) > ESTIMATOR.score(CHIT_CHAT)
    assert ESTIMATOR.score(CHIT_CHAT) < 0.4       # tiny-s territory with the default thresholds
    assert ESTIMATOR.score(CODE_TASK) >= 0.7      # tiny-l territory


def test_longer_is_not_simpler_for_the_same_text():
    short = [USER] + ids("hello the cat is nice") + [ASSISTANT]
    longer = [USER] + ids("hello the cat is nice") + PROSE[1:-1] + [ASSISTANT]
    assert ESTIMATOR.score(longer) > ESTIMATOR.score(short)


def test_cues_raise_the_score_at_equal_length():
    plain = [USER] + ids("the cat is nice the day is nice ok thanks") + [ASSISTANT]
    reasoning = [USER] + ids("the cat is nice why explain because prove ok thanks") + [ASSISTANT]
    assert len(plain) == len(reasoning)
    assert ESTIMATOR.score(reasoning) > ESTIMATOR.score(plain)


def test_more_turns_raise_the_score():
    one_turn = [USER] + ids("hi how are you ?") * 4 + [ASSISTANT]
    many_turns = ([USER] + ids("hi how are you ?") + [ASSISTANT]) * 4
    many_turns = many_turns[: len(many_turns) - 2] + [ASSISTANT, ID["?"]]
    assert ESTIMATOR.components(many_turns)["turns"] > ESTIMATOR.components(one_turn)["turns"]


def test_estimator_for_vocab_counts_exactly_the_role_marker_ids_as_turns():
    built = estimator_for_vocab(VOCAB)            # finds <|user|> and <|assistant|> by their text
    assert built.components(CHIT_CHAT) == ESTIMATOR.components(CHIT_CHAT)
    turns_saturation = built.params.turns_saturation
    assert built.components(CHIT_CHAT)["turns"] == 2 / turns_saturation
    assert estimator_for_vocab(VOCAB, role_markers=("<|user|>",)).components(CHIT_CHAT)["turns"] == 1 / turns_saturation
    assert estimator_for_vocab(VOCAB, role_markers=()).components(CHIT_CHAT)["turns"] == 0.0


def test_repetition_lowers_diversity():
    diverse = PROSE
    repetitive = [USER] + [ID["ok"]] * 400 + [ASSISTANT]
    assert ESTIMATOR.components(repetitive)["diversity"] < ESTIMATOR.components(diverse)["diversity"]


def test_components_explain_the_score():
    parts = ESTIMATOR.components(CODE_TASK)
    assert set(parts) == {"length", "diversity", "code", "reasoning", "math", "cues", "turns", "score"}
    assert parts["score"] == ESTIMATOR.score(CODE_TASK)
    assert parts["code"] > 0 and parts["reasoning"] > 0 and parts["math"] > 0
    assert ESTIMATOR.components(CHIT_CHAT)["code"] == 0.0
    assert all(0.0 <= v <= 1.0 for v in parts.values())


def test_cue_matching_is_case_and_space_insensitive():
    estimator = ComplexityEstimator(["  DEF\n", "Why", "x"])
    assert estimator.components([0] * 40)["code"] == 1.0
    assert estimator.components([1] * 40)["reasoning"] == 1.0
    assert estimator.components([2] * 40)["cues"] == 0.0


def test_ids_outside_vocab_carry_no_cue():
    assert ESTIMATOR.components([10_000, 20_000, ID["def"]] * 20)["code"] > 0.0
    assert ESTIMATOR.components([10_000] * 50)["cues"] == 0.0


def test_params_are_knobs():
    flat = ComplexityEstimator(VOCAB, (USER, ASSISTANT),
                               ComplexityParams(weight_length=1.0, weight_diversity=0.0, weight_cues=0.0, weight_turns=0.0))
    assert flat.score(CODE_TASK) == flat.components(CODE_TASK)["length"]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=len(VOCAB) + 50), max_size=3000))
def test_any_prompt_scores_in_range(prompt):
    score = ESTIMATOR.score(prompt)
    assert 0.0 <= score <= 1.0
    assert score == ESTIMATOR.score(list(prompt))
