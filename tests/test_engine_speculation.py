"""Draft-target speculation in the local engine (engines/local/speculation.py): plans built by hand against the
shipped tiny family (eval.simulate.measure_speculation.SpeculativeRun keeps the core's bookkeeping), checked
against plain decoding of the same requests: the same tokens (greedy, seeded), the target's distribution
(unseeded sampling), the same KV, the same stops."""
from __future__ import annotations

import math

import pytest
import torch

from engines.local.executor import LocalExecutor
from engines.local.sampler import Sampler
from eval.simulate.measure_speculation import Decode, SpeculativeRun, acceptance_stats, workload_prompts
from orchestrator.core.family import SHIPPED_FAMILIES_DIR, load_family
from orchestrator.core.types import DraftSpec, MemberBatch, PageId, RequestId, SamplingParams, SeqChunk, StepPlan

BLOCK_TOKENS = 16
NUM_PAGES = 6000


@pytest.fixture(scope="module")
def family():
    return load_family(SHIPPED_FAMILIES_DIR / "tiny")


@pytest.fixture(scope="module")
def prompts(family):
    return workload_prompts(family.members[0].tokenizer_hash, count=6, max_tokens=40)


def _executor(family, **options) -> LocalExecutor:
    member = family.members[-1]
    return LocalExecutor(family, num_pages=NUM_PAGES, page_bytes=BLOCK_TOKENS * member.kv_bytes_per_token_per_layer(4),
                         num_threads=1, **options)


def _plain_twins(decodes: list[Decode]) -> list[Decode]:
    return [Decode(d.request_id, d.prompt, d.target, d.sampling) for d in decodes]


def _run_both(family, decodes: list[Decode], **options) -> tuple[list[Decode], LocalExecutor, LocalExecutor]:
    """Decodes `decodes` with speculation and their plain twins without, each on its own executor."""
    plain = _plain_twins(decodes)
    plain_executor, spec_executor = _executor(family), _executor(family, **options)
    SpeculativeRun(plain_executor, plain).run()
    SpeculativeRun(spec_executor, decodes).run()
    return plain, plain_executor, spec_executor


def _kv(executor: LocalExecutor, member: str, tables: list[list[PageId]], positions: range) -> torch.Tensor:
    """[layers, positions, 2, kv_heads, head_dim]: what the pages hold for those positions."""
    view = executor.arena.kv_view(executor.model(member).member, executor.dtype)
    block = view.shape[2]
    slots = torch.tensor([p % block for p in positions])
    return torch.stack([view[torch.tensor([t[p // block] for p in positions]), :, slots] for t in tables])


TORCH_PATH = dict(native_attention=False, native_layer_ops=False)     # the operators CUDA runs


@pytest.mark.parametrize("drafter, options", [("tiny-s", {}), ("tiny-l", {}), ("tiny-s", TORCH_PATH)],
                         ids=["tiny-s", "tiny-l-self", "tiny-s-torch-ops"])
def test_greedy_tokens_and_kv_equal_plain_decoding(family, prompts, drafter, options):
    """k = 1..4 side by side in one step, next to a plain decode and a tiny-m target drafting with tiny-s:
    every request's tokens are plain decoding's, and the KV of every computed position too (target and draft);
    with the native kernels and with torch's operators (what the engine runs on CUDA)."""
    greedy = SamplingParams(max_tokens=20)
    decodes = [Decode(f"r{k}", prompts[k], "tiny-l", greedy, drafter, k) for k in (1, 2, 3, 4)]
    decodes += [Decode("plain", prompts[0], "tiny-l", greedy),
                Decode("m", prompts[5], "tiny-m", greedy, "tiny-s", 3)]
    plain, plain_executor, spec_executor = _run_both(family, decodes, **options)
    for d, p in zip(decodes, plain):
        assert d.generated == p.generated, d.request_id
        assert [t.logprob for t in d.tokens] == pytest.approx([t.logprob for t in p.tokens], abs=1e-4)
        assert d.dropped == 0
        # num_drafted: k on the first token a drafting step returns, 0 elsewhere
        assert sum(t.num_drafted for t in d.tokens) == sum(k for k, _, _ in d.verified)
        positions = range(min(d.target_done, p.target_done))
        torch.testing.assert_close(_kv(spec_executor, d.target, d.tables, positions),
                                   _kv(plain_executor, p.target, p.tables, positions), rtol=1e-4, atol=1e-4)
    steps = [(k, returned) for d in decodes if d.drafter == drafter and d.target == "tiny-l"
             for k, returned, ended in d.verified if not ended]
    assert any(returned == k + 1 for k, returned in steps)                      # every draft kept
    if drafter == "tiny-l":                                                    # the target drafting for itself
        assert all(returned == k + 1 for k, returned in steps)
    else:
        assert any(returned == 1 and k >= 2 for k, returned in steps)          # the first draft rejected
    # the draft's KV: what a prefill of the same tokens on the drafter writes
    scratch = SpeculativeRun(spec_executor, [], first_page=NUM_PAGES // 2)
    for d in decodes:
        if d.drafter is None:
            continue
        sequence = (d.prompt + d.generated)[:d.draft_done]
        tables = [[] for _ in d.draft_tables]
        scratch._grow(tables, d.drafter, len(sequence))
        chunk = SeqChunk(request_id=RequestId(f"{d.request_id}-ref"), token_ids=sequence, start_pos=0,
                         block_tables=tables, sample=False, sampling=greedy)
        spec_executor.execute(StepPlan(batches=[MemberBatch(d.drafter, [chunk])]))
        positions = range(d.draft_done)
        torch.testing.assert_close(_kv(spec_executor, d.drafter, d.draft_tables, positions),
                                   _kv(spec_executor, d.drafter, tables, positions), rtol=1e-4, atol=1e-4)


def test_sampling_options_give_plain_decodings_tokens(family, prompts):
    """Penalties, bias, seeded sampling (top-k, top-p), top logprobs, a two-thread forward: position by
    position as plain decoding applies them, so the same tokens (seeded sampling draws what plain decoding
    draws) and the same logprobs."""
    penalties = dict(frequency_penalty=0.8, presence_penalty=0.4, repetition_penalty=1.3,
                     logit_bias=((17, 3.0), (40, -2.0)))
    cases = {
        "penalized": SamplingParams(max_tokens=18, penalized_prompt_ids=tuple(sorted(set(prompts[1]))), **penalties),
        "seeded": SamplingParams(max_tokens=18, temperature=1.0, top_p=0.95, seed=11, num_top_logprobs=3),
        "seeded-penalized": SamplingParams(max_tokens=18, temperature=0.8, top_k=20, seed=5,
                                           penalized_prompt_ids=tuple(sorted(set(prompts[3]))), **penalties),
        "top-logprobs": SamplingParams(max_tokens=18, num_top_logprobs=4),
        # a favourite token that the count penalty pushes back after each use: a draft repeating it must see
        # the drafts before it in its history
        "count-penalized": SamplingParams(max_tokens=18, logit_bias=((17, 9.0),), frequency_penalty=3.0),
    }
    decodes = [Decode(name, prompts[i + 1], "tiny-l", params, "tiny-s" if i % 2 else "tiny-m", 3)
               for i, (name, params) in enumerate(cases.items())]
    plain, _, _ = _run_both(family, decodes, parallel_forwards=2)
    assert 2 <= decodes[-1].generated.count(17) < len(decodes[-1].generated) - 4
    for d, p in zip(decodes, plain):
        assert d.generated == p.generated, d.request_id
        assert [t.logprob for t in d.tokens] == pytest.approx([t.logprob for t in p.tokens], abs=1e-4)
        for mine, theirs in zip(d.tokens, p.tokens):
            assert [t for t, _ in mine.top_logprobs] == [t for t, _ in theirs.top_logprobs]
    assert all(any(returned > 1 for _, returned, _ in d.verified) for d in decodes)   # drafts were kept


def _first_new_token(tokens: list[int], start: int, k: int) -> int:
    """An index >= start whose token did not occur before it and that falls inside a self-drafting step of k
    (the prefill returns index 0, each step k + 1 tokens after it): a stop there cuts a step's tokens."""
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i] and (i - 1) % (k + 1) != k)


def test_a_stop_token_among_the_drafts_ends_where_plain_decoding_would(family, prompts):
    k = 4
    reference = Decode("ref", prompts[2], "tiny-l", SamplingParams(max_tokens=24))
    SpeculativeRun(_executor(family), [reference]).run()
    index = _first_new_token(reference.generated, 2, k)
    stop = reference.generated[index]
    stopping = SamplingParams(max_tokens=24, stop_token_ids=(stop,))
    late = SamplingParams(max_tokens=index + 8, stop_token_ids=(stop,), min_tokens=index + 3)
    # EOS forced by a bias once min_tokens allows it (banned before, in the drafts too)
    forced_eos = SamplingParams(max_tokens=24, min_tokens=3, logit_bias=((2, 100.0),))
    decodes = [Decode("stop", prompts[2], "tiny-l", stopping, "tiny-l", k),
               Decode("late", prompts[2], "tiny-l", late, "tiny-l", k),
               Decode("eos", prompts[2], "tiny-l", forced_eos, "tiny-s", k)]
    plain, _, _ = _run_both(family, decodes)
    for d, p in zip(decodes, plain):
        assert d.generated == p.generated, d.request_id
        assert d.dropped == 0, d.request_id                       # the engine returned nothing past the stop
    assert decodes[0].generated == reference.generated[:index + 1]
    assert decodes[0].verified[-1][1] < k + 1                     # the stop cut a step's tokens
    assert len(decodes[1].generated) > index + 1 and stop not in decodes[1].generated[:index + 3]
    assert decodes[2].generated[-1] == 2 and len(decodes[2].generated) == 4


def _chi2_critical(df: int, z: float = 3.0902) -> float:
    """Chi-square's upper 0.001 point (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _chi2(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 10.0) -> tuple[float, int]:
    """(statistic, degrees of freedom) of counts against probs, the tokens expected fewer than min_expected
    times pooled into one bin."""
    total = float(counts.sum())
    expected = probs * total
    big = expected >= min_expected
    observed = torch.cat([counts[big], counts[~big].sum()[None]])
    wanted = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = wanted > 0
    return float(((observed[keep] - wanted[keep]) ** 2 / wanted[keep]).sum()), int(keep.sum()) - 1


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=64, temperature=1.0),
                                    SamplingParams(max_tokens=64, temperature=0.7, top_k=12, top_p=0.9)],
                         ids=["t1", "t07-topk-topp"])
def test_unseeded_sampling_emits_the_targets_distribution(family, prompts, params):
    """4,000 requests at one context, drafting k = 2 with tiny-s for tiny-l, each from its own fixed random
    stream: the first token follows the target's distribution, the second (after the most common kept first
    draft) the target's distribution after it, and the first draft is kept with probability sum min(p, q)."""
    executor = _executor(family)
    target, drafter = executor.model("tiny-l"), executor.model("tiny-s")
    sequence = prompts[4][:33]
    start = 32                                     # [0, 32) prefilled once, in shared pages (two blocks)
    shared = {m: [[PageId(2 * (layer + 8 * i)), PageId(2 * (layer + 8 * i) + 1)] for layer in range(depth)]
              for i, (m, depth) in enumerate((("tiny-l", 8), ("tiny-s", 2)))}
    prefill = [MemberBatch(m, [SeqChunk(request_id=RequestId(f"prefix-{m}"), token_ids=sequence[:start],
                                        start_pos=0, block_tables=shared[m], sample=False, sampling=params)])
               for m in shared]
    executor.execute(StepPlan(batches=prefill))
    next_page = 64

    def tables(member: str) -> list[list[PageId]]:
        nonlocal next_page
        out = [table + [PageId(next_page + layer)] for layer, table in enumerate(shared[member])]
        next_page += len(out)
        return out

    per_step, steps, k = 400, 10, 2
    slots = [(tables("tiny-l"), tables("tiny-s")) for _ in range(per_step)]
    firsts, seconds, lengths = [], [], []
    for step in range(steps):
        chunks = []
        for i, (target_tables, draft_tables) in enumerate(slots):
            request = RequestId(f"t{step}-{i}")
            executor.sampler.start_stream(request, step * per_step + i)
            chunks.append(SeqChunk(request_id=request, token_ids=[sequence[start]], start_pos=start,
                                   block_tables=target_tables, sample=True, sampling=params,
                                   draft=DraftSpec(member="tiny-s", num_tokens=k, token_ids=[sequence[start]],
                                                   start_pos=start, block_tables=draft_tables)))
        out = executor.execute(StepPlan(batches=[MemberBatch("tiny-l", chunks)],
                                        released_requests=[RequestId(f"t{step - 1}-{i}") for i in range(per_step)]))
        by_request: dict[str, list[int]] = {}
        for token in out:
            by_request.setdefault(token.request_id, []).append(token.token_id)
        for tokens in by_request.values():
            lengths.append(len(tokens))
            firsts.append(tokens[0])
            seconds.append(tokens[1] if len(tokens) > 1 else None)

    def distributions(model, continuations: list[list[int]], tables: list[list[list[PageId]]]) -> torch.Tensor:
        """[len(continuations), vocab]: the request's sampling distribution after each continuation (positions
        from `start`, in the given private tables)."""
        out = []
        for at in range(0, len(continuations), len(tables)):
            part = continuations[at:at + len(tables)]
            chunks = [SeqChunk(request_id=RequestId(f"ref{at + i}"), token_ids=tokens, start_pos=start,
                               block_tables=tables[i], sample=True, sampling=params) for i, tokens in enumerate(part)]
            out.extend(Sampler.distribution(row, params) for row in model.forward(executor.arena, chunks))
        return torch.stack(out)

    target_tables = [t for t, _ in slots]
    p0 = distributions(target, [[sequence[start]]], target_tables)[0]
    q0 = distributions(drafter, [[sequence[start]]], [d for _, d in slots])[0]
    trials = len(firsts)
    assert trials == per_step * steps and min(lengths) >= 1 and max(lengths) <= k + 1
    statistic, df = _chi2(torch.bincount(torch.tensor(firsts), minlength=p0.numel()).float(), p0)
    assert df >= 3 and statistic < _chi2_critical(df)
    kept = float(torch.minimum(p0, q0).sum())
    observed = sum(n > 1 for n in lengths) / trials
    assert abs(observed - kept) < 4 * math.sqrt(kept * (1 - kept) / trials)
    # a second token exists when the first draft was kept; given that first token x it follows p(. | x): the
    # expected counts are the sum of those distributions over the trials (a chi-square that can only be
    # conservative: each trial has its own distribution)
    pairs = [(f, s) for f, s in zip(firsts, seconds) if s is not None]
    kept_firsts = sorted({f for f, _ in pairs})
    after = distributions(target, [[sequence[start], x] for x in kept_firsts], target_tables)
    row_of = {x: i for i, x in enumerate(kept_firsts)}
    expected = after[torch.tensor([row_of[f] for f, _ in pairs])].sum(0)
    counts = torch.bincount(torch.tensor([s for _, s in pairs]), minlength=expected.numel()).float()
    statistic, df = _chi2(counts, expected / len(pairs))
    assert len(pairs) > 1000 and df >= 3 and statistic < _chi2_critical(df)


def test_a_malformed_draft_is_refused(family):
    executor = _executor(family)
    tables = [[PageId(layer)] for layer in range(8)]
    good = DraftSpec(member="tiny-s", num_tokens=2, token_ids=[7], start_pos=3,
                     block_tables=[[PageId(20)], [PageId(21)]])
    bad = [DraftSpec(member="tiny-s", num_tokens=2, token_ids=[8], start_pos=3, block_tables=good.block_tables),
           DraftSpec(member="tiny-s", num_tokens=2, token_ids=[7], start_pos=2, block_tables=good.block_tables),
           DraftSpec(member="tiny-s", num_tokens=0, token_ids=[7], start_pos=3, block_tables=good.block_tables),
           DraftSpec(member="tiny-s", num_tokens=2, token_ids=[7], start_pos=3, block_tables=good.block_tables[:1]),
           DraftSpec(member="nobody", num_tokens=2, token_ids=[7], start_pos=3, block_tables=good.block_tables)]
    for draft in bad:
        chunk = SeqChunk(request_id=RequestId("x"), token_ids=[7], start_pos=3, block_tables=tables, sample=True,
                         sampling=SamplingParams(), draft=draft)
        with pytest.raises(ValueError):
            executor.execute(StepPlan(batches=[MemberBatch("tiny-l", [chunk])]))


def test_acceptance_stats_count_judged_drafts():
    decodes = [Decode("a", [1], "t", SamplingParams(), "d", 3)]
    decodes[0].verified = [(3, 4, False), (3, 1, False), (3, 2, False), (2, 1, True)]   # the last ended: left out
    stats = acceptance_stats(decodes)
    # accepted 3 + 0 + 1 = 4; judged = 4 + two rejecting steps
    assert stats["per_token_acceptance"] == round(4 / 6, 4) and stats["verify_steps"] == 3
    assert stats["by_position"] == [round(2 / 3, 4), 0.5, 1.0]
    assert stats["tokens_per_step"] == round(7 / 3, 3)
