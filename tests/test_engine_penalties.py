"""Sampler penalties and logit bias: vLLM's definitions, batched rows equal single rows, neutral rows untouched."""
from __future__ import annotations

import pytest
import torch

from engines.local.sampler import Sampler
from orchestrator.core.types import RequestId, SamplingParams, SeqChunk

VOCAB = 16
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _chunk(request_id: str, num_generated: int = 0, **sampling) -> SeqChunk:
    return SeqChunk(request_id=RequestId(request_id), token_ids=[1], start_pos=0, block_tables=[], sample=True,
                    sampling=SamplingParams(**sampling), num_generated=num_generated)


def _logits(rows: int, seed: int = 0, device: str = "cpu") -> torch.Tensor:
    return (torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3).to(device)


def reference(row: list[float], prompt: list[int], output: list[int], params: SamplingParams) -> list[float]:
    """The definition, one token at a time: bias, then repetition over prompt + output, frequency, presence."""
    adjusted = list(row)
    for token, bias in params.logit_bias:
        adjusted[token] += bias
    for token in range(len(adjusted)):
        if token in prompt or token in output:
            rp = params.repetition_penalty
            adjusted[token] = adjusted[token] / rp if adjusted[token] > 0 else adjusted[token] * rp
        count = output.count(token)
        adjusted[token] -= params.frequency_penalty * count + params.presence_penalty * (count > 0)
    return adjusted


def _feed(sampler: Sampler, request_id: str, tokens: list[int], params: dict) -> None:
    """Makes the sampler's history of request_id equal `tokens` by forcing each step with a +100 bias."""
    for step, token in enumerate(tokens):
        forced = _chunk(request_id, step, **{**params, "logit_bias": ((token, 100.0),)})
        assert sampler.sample(torch.zeros(1, VOCAB), [forced])[0].token_id == token


@pytest.mark.parametrize("device", DEVICES)
def test_penalties_match_the_definition_row_by_row_and_batched(device):
    cases = [
        ("a", [3, 3, 5], [1, 2, 3], dict(frequency_penalty=0.7)),
        ("b", [4, 4, 4, 9], [9], dict(presence_penalty=-1.5)),
        ("c", [2, 7], [7, 8, 11], dict(repetition_penalty=1.8)),
        ("d", [6], [0, 6], dict(repetition_penalty=0.5, frequency_penalty=2.0, presence_penalty=2.0,
                              logit_bias=((0, -3.0), (6, 2.5)))),
    ]
    sampler = Sampler(device)
    for request_id, output, prompt, params in cases:
        _feed(sampler, request_id, output, {**params, "penalized_prompt_ids": tuple(sorted(set(prompt)))})
    logits = _logits(len(cases), device=device)
    chunks = [_chunk(rid, len(output), penalized_prompt_ids=tuple(sorted(set(prompt))), **params)
              for rid, output, prompt, params in cases]
    batched = sampler._penalize(logits, chunks)
    for row, (rid, output, prompt, params) in enumerate(cases):
        expected = reference(logits[row].tolist(), prompt, output, chunks[row].sampling)
        assert batched[row].tolist() == pytest.approx(expected, rel=1e-5, abs=1e-5), rid
        alone = sampler._penalize(logits[row:row + 1], [chunks[row]])
        assert torch.equal(alone[0], batched[row])


def test_a_greedy_row_with_neutral_values_is_the_raw_argmax_next_to_a_penalized_row():
    logits = _logits(3, seed=4)
    sampler = Sampler()
    winner = int(logits[1].argmax())
    tokens = sampler.sample(logits, [_chunk("plain"), _chunk("biased", logit_bias=((winner, -100.0),)),
                                     _chunk("neutral", frequency_penalty=0.0, repetition_penalty=1.0)])
    assert tokens[0].token_id == int(logits[0].argmax())
    assert tokens[2].token_id == int(logits[2].argmax())
    assert tokens[1].token_id != winner and tokens[1].token_id == int(logits[1].topk(2).indices[1])
    # logprobs stay those of the raw model, as for every request
    assert tokens[1].logprob == pytest.approx(float(torch.log_softmax(logits[1], -1)[tokens[1].token_id]))


def test_frequency_penalty_breaks_a_greedy_loop_and_a_rollback_forgets_the_dropped_tokens():
    logits = torch.zeros(1, VOCAB)
    logits[0, 5], logits[0, 6] = 2.0, 1.0
    sampler = Sampler()
    run = [sampler.sample(logits, [_chunk("r", step, frequency_penalty=0.6)])[0].token_id for step in range(4)]
    assert run == [5, 5, 6, 5]        # 2-0.6=1.4 > 1; 2-1.2=0.8 < 1; then 5 (0.8) vs 6 (0.4)
    # step 1 sampled again (an escalation rollback): the history is cut back to step 1 first
    assert sampler.sample(logits, [_chunk("r", 1, frequency_penalty=0.6)])[0].token_id == 5
    assert sampler._generated[RequestId("r")] == [5, 5]
    sampler.release([RequestId("r")])
    assert RequestId("r") not in sampler._generated

