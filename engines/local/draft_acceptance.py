"""Which drafted tokens a target member keeps (draft-target speculative decoding, any two members of a family).

A smaller member drafted k tokens after a request's last token; the target's forward over those k + 1 positions
gives k + 1 next-token distributions. Greedy requests keep the drafts up to the first one that is not the target's
own argmax, then the target's token there (all k kept: the target's token after them, the bonus). Sampled
requests use the standard rejection rule (Leviathan et al., Chen et al.): draft token x at step i is kept with
probability min(1, p(x) / q(x)) (p the target's distribution, q the draft's, both after the request's own
temperature and filters); at the first rejection a token is drawn from max(0, p - q), renormalised, and drafting
stops; all k kept, the bonus is drawn from the last p. The output has exactly the target's distribution, and
every verification yields at least one token.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


def accept_greedy(target_logits: torch.Tensor, draft_tokens: Sequence[int]) -> list[int]:
    """target_logits [k + 1, vocab]: row i is the target's next-token logits after draft i - 1 (row 0: after the
    request's last token). Returns 1 to k + 1 tokens, each the target's argmax: what decoding alone would give."""
    _check(target_logits, draft_tokens)
    chosen = target_logits.argmax(dim=-1).tolist()
    out = []
    for i, drafted in enumerate(draft_tokens):
        out.append(chosen[i])
        if chosen[i] != drafted:
            return out
    out.append(chosen[len(draft_tokens)])
    return out


def accept_sampled(target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_tokens: Sequence[int],
                   generator: torch.Generator | None = None) -> list[int]:
    """target_probs [k + 1, vocab], draft_probs [k, vocab]: the two members' sampling distributions at each
    drafted position (rows sum to 1; draft row i is what draft token i was drawn from). Returns 1 to k + 1 tokens
    distributed exactly as the target sampling alone."""
    _check(target_probs, draft_tokens)
    if draft_probs.shape != (len(draft_tokens), target_probs.shape[1]):
        raise ValueError(f"draft_probs has shape {tuple(draft_probs.shape)}, expected "
                         f"({len(draft_tokens)}, {target_probs.shape[1]})")
    device = target_probs.device
    draws = torch.rand(len(draft_tokens), generator=generator, device=device).tolist() if draft_tokens else []
    out = []
    for i, drafted in enumerate(draft_tokens):
        p, q = float(target_probs[i, drafted]), float(draft_probs[i, drafted])
        if q > 0.0 and draws[i] < min(1.0, p / q):
            out.append(drafted)
            continue
        residual = (target_probs[i] - draft_probs[i]).clamp_(min=0.0)
        total = float(residual.sum())
        # p == q everywhere leaves nothing: then the rejection had probability 0 and any draw of p is right
        weights = residual / total if total > 0.0 else target_probs[i]
        out.append(int(torch.multinomial(weights, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(target_probs[len(draft_tokens)], 1, generator=generator)))
    return out


def _check(target: torch.Tensor, draft_tokens: Sequence[int]) -> None:
    if target.dim() != 2 or target.shape[0] != len(draft_tokens) + 1:
        raise ValueError(f"the target gives {tuple(target.shape)}; expected {len(draft_tokens) + 1} rows "
                         f"(one per drafted token, plus one)")
