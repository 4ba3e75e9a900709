"""Draft-target speculation's acceptance rule (engines/local/draft_acceptance.py)."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from engines.local.draft_acceptance import accept_greedy, accept_sampled  # noqa: E402


def test_greedy_keeps_drafts_up_to_the_first_that_is_not_the_targets_argmax():
    logits = torch.full((4, 6), -5.0)
    for row, best in enumerate((2, 4, 1, 5)):
        logits[row, best] = 5.0
    assert accept_greedy(logits, [2, 4, 1]) == [2, 4, 1, 5]          # all kept, plus the bonus
    assert accept_greedy(logits, [2, 3, 1]) == [2, 4]                # second draft wrong: the target's own token
    assert accept_greedy(logits, [0, 4, 1]) == [2]                   # the first wrong: one token, as decoding
    assert accept_greedy(logits[:1], []) == [2]                      # no draft: plain decoding
    with pytest.raises(ValueError):
        accept_greedy(logits, [2, 4])


def _distribution(n: int, generator: torch.Generator) -> torch.Tensor:
    return torch.softmax(torch.randn(n, generator=generator) * 1.5, dim=-1)


@pytest.mark.parametrize("num_drafts", [1, 3])
def test_sampled_output_has_the_targets_distribution(num_drafts):
    """Chi-square of the first and the second emitted token against the target's own distribution (the draft's
    is far from it); 20,000 trials, significance 0.001, a fixed seed for the draws."""
    vocab = 5
    setup = torch.Generator().manual_seed(7)
    target = torch.stack([_distribution(vocab, setup) for _ in range(num_drafts + 1)])
    draft = torch.stack([_distribution(vocab, setup) for _ in range(num_drafts)])
    draws = torch.Generator().manual_seed(11)
    trials = 20_000
    first = torch.zeros(vocab)
    second = torch.zeros(vocab)
    second_trials = 0
    lengths = []
    for _ in range(trials):
        drafts = [int(torch.multinomial(draft[i], 1, generator=draws)) for i in range(num_drafts)]
        out = accept_sampled(target, draft, drafts, draws)
        lengths.append(len(out))
        first[out[0]] += 1
        if len(out) > 1:                       # given the first draft was kept, the second follows target row 1
            second[out[1]] += 1
            second_trials += 1
    chi2_critical_4dof = 18.467                # P(chi2 > x) = 0.001 with 4 degrees of freedom
    expected = target[0] * trials
    assert float(((first - expected) ** 2 / expected).sum()) < chi2_critical_4dof
    if second_trials > 1000:
        expected = target[1] * second_trials
        assert float(((second - expected) ** 2 / expected).sum()) < chi2_critical_4dof
    assert min(lengths) >= 1 and max(lengths) <= num_drafts + 1
    # acceptance of the first draft is sum_x min(p(x), q(x)): the expected share of outputs longer than one
    accept_rate = float(torch.minimum(target[0], draft[0]).sum())
    assert sum(n > 1 for n in lengths) / trials == pytest.approx(accept_rate, abs=0.02)


def test_identical_distributions_accept_every_draft():
    probs = torch.softmax(torch.randn(3, 8, generator=torch.Generator().manual_seed(1)), dim=-1)
    out = accept_sampled(probs, probs[:2], [3, 5], torch.Generator().manual_seed(2))
    assert out[:2] == [3, 5] and len(out) == 3
    with pytest.raises(ValueError):
        accept_sampled(probs, probs[:1], [3, 5])
