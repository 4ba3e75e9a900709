"""Sampler: greedy, top-k/top-p filtering, seeded reproducibility across recompute, min_tokens, raw logprobs."""
from __future__ import annotations

import math

import torch

from engines.local.sampler import Sampler
from orchestrator.core.types import RequestId, SamplingParams, SeqChunk


def _chunk(request_id: str = "r", num_generated: int = 0, **sampling) -> SeqChunk:
    return SeqChunk(request_id=RequestId(request_id), token_ids=[1], start_pos=0, block_tables=[], sample=True,
                    sampling=SamplingParams(**sampling), num_generated=num_generated)


def _logits(rows: int = 1, vocab: int = 32, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_and_raw_logprobs():
    logits = _logits(rows=2)
    tokens = Sampler().sample(logits, [_chunk("a"), _chunk("b", num_top_logprobs=3)])
    raw = torch.log_softmax(logits, -1)
    assert [t.token_id for t in tokens] == logits.argmax(-1).tolist()
    assert math.isclose(tokens[0].logprob, raw[0].max().item(), rel_tol=1e-6)
    assert math.isclose(tokens[1].top1_prob, raw[1].max().exp().item(), rel_tol=1e-6)
    assert tokens[0].top_logprobs == ()
    assert [i for i, _ in tokens[1].top_logprobs] == raw[1].topk(3).indices.tolist()


def test_top_k_one_is_greedy():
    logits = _logits(rows=1, seed=3)
    sampler = Sampler()
    draws = {sampler.sample(logits, [_chunk(temperature=1.5, top_k=1, num_generated=n)])[0].token_id
             for n in range(20)}
    assert draws == {int(logits.argmax())}


def test_top_p_keeps_only_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    sampler = Sampler()
    draws = {sampler.sample(logits, [_chunk(temperature=1.0, top_p=0.7, seed=1, num_generated=n)])[0].token_id
             for n in range(60)}
    assert draws == {0, 1}


def test_seed_reproducible_across_release_and_recompute():
    logits = _logits(rows=1, vocab=64, seed=5)
    first, second = Sampler(), Sampler()
    run = [first.sample(logits, [_chunk(temperature=1.0, seed=42, num_generated=n)])[0].token_id for n in range(12)]
    first.release([RequestId("r")])
    again = [first.sample(logits, [_chunk(temperature=1.0, seed=42, num_generated=n)])[0].token_id for n in range(12)]
    # a recompute after preemption resumes at num_generated=5 in a fresh sampler
    resumed = [second.sample(logits, [_chunk(temperature=1.0, seed=42, num_generated=n)])[0].token_id
               for n in range(5, 12)]
    assert run == again and run[5:] == resumed
    assert len(set(run)) > 1                                       # it really samples


def test_min_tokens_masks_eos_and_stop_ids_but_logprob_is_raw():
    logits = torch.full((1, 16), -5.0)
    logits[0, 2] = 10.0                                            # eos is the clear favourite
    logits[0, 7] = 9.0                                             # a stop token next
    logits[0, 4] = 1.0
    sampler = Sampler()
    masked = sampler.sample(logits, [_chunk(min_tokens=2, num_generated=1, stop_token_ids=(7,))], eos_token_ids=(2,))
    assert masked[0].token_id == 4
    assert masked[0].logprob == torch.log_softmax(logits, -1)[0, 4].item()
    free = sampler.sample(logits, [_chunk(min_tokens=2, num_generated=2, ignore_eos=True)], eos_token_ids=(2,))
    assert free[0].token_id == 2                                   # ignore_eos is the core's business


def test_mixed_batch_rows_stay_independent():
    logits = _logits(rows=3, seed=9)
    tokens = Sampler().sample(logits, [_chunk("g"), _chunk("s", temperature=0.8, seed=1), _chunk("k", top_k=1,
                                                                                                temperature=2.0)])
    assert [t.request_id for t in tokens] == ["g", "s", "k"]
    assert tokens[0].token_id == int(logits[0].argmax()) and tokens[2].token_id == int(logits[2].argmax())


def test_a_temperature_near_zero_is_greedy_not_nan():
    logits = _logits(rows=1, seed=7) * 10
    tokens = Sampler().sample(logits, [_chunk(temperature=5e-324, num_generated=n) for n in range(1)])
    assert tokens[0].token_id == int(logits.argmax())


def test_a_top_p_that_rounds_to_zero_keeps_the_best_token():
    logits = _logits(rows=1, seed=8)
    tokens = Sampler().sample(logits, [_chunk(temperature=1.0, top_p=5e-324, seed=3)])
    assert tokens[0].token_id == int(logits.argmax())
