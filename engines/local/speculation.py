"""Draft-target speculative decoding in the local engine: a decode chunk with a DraftSpec (orchestrator/core/types.py)
gets its next tokens proposed by a smaller member of the family and verified by its own member in one forward.

Per step, for every drafting chunk (batched over the requests drafting with the same member):
1. the draft member forwards draft.token_ids (its catch-up: the tokens whose KV it lacks, ending with the chunk's
   last token) into the draft's own pages and samples d1 from the last row; then k - 1 one-token forwards give
   d2..dk (`draft`);
2. the chunk's member forwards [last, d1..dk] at positions start_pos..start_pos + k as k + 1 one-token rows of
   the step's own forward (`verify_rows`): each layer writes every row's K and V before any row attends, so row j
   reads the keys of rows 0..j (and nothing past its own position) through the ordinary paged decode path;
3. `accept` keeps the drafts the rule allows and appends one token of the target's (the correction, or the bonus
   when all k are kept), 1 to k + 1 SampledTokens, num_drafted = k on the first.
A decode chunk of the drafting member itself with ride_tokens = n (the core's Speculation.rides) rides the draft
forwards: a row of each of its first n, sampled as plain decoding samples it at that position, so it gets n tokens
for no forward of its own (`draft`'s riders; it leaves early where plain decoding would stop).
K/V the target and the draft wrote past the accepted length is garbage: the core never counts it as computed, and
a later step overwrites it.

Every sampling option is honoured, position by position as plain decoding applies it, so the core may draft for
any request:
- row j of the verify (and draft step j) is sampled as generation step num_generated + j: min_tokens bans EOS and
  stop tokens there, penalties count the request's history plus the drafts before it, logit_bias applies;
- greedy (temperature 0) keeps d_i while it is the target's (adjusted) argmax: exactly plain decoding's tokens;
- seeded sampling: each position's token is the draw plain decoding makes there (the request's generator seeded
  for that step, from the target's adjusted, filtered distribution), and a draft is kept while it equals that
  draw: the same tokens as plain decoding with the same seed. The draft draws with the same per-step seed, so
  close distributions agree often;
- unseeded sampling: the rejection rule with the residual max(0, p - q) (engines/local/draft_acceptance.py), p and
  q both after temperature, top-k and top-p: the output follows the target's distribution;
- logprobs, top1_prob and top_logprobs of each returned token are the target's raw ones at that position;
- the returned tokens end where plain decoding would end the request (engines' view of
  orchestrator/core/sequence.py's stop_reason: a stop token or EOS once min_tokens are out, max_tokens, the
  target's context); stop strings are the core's, on the text.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch

from orchestrator.core.types import RequestId, SampledToken, SeqChunk

from engines.local.draft_acceptance import accept_greedy, accept_sampled
from engines.local.model import PagedCausalLM
from engines.local.sampler import MIN_SAMPLING_TEMPERATURE, Sampler


@dataclass(slots=True)
class Drafts:
    """One request's drafted tokens, and for an unseeded sampled request the distribution q each was drawn from."""

    tokens: list[int] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)


def check_draft(chunk: SeqChunk, draft_layers: int) -> None:
    """The contract's shape of a drafting chunk (orchestrator/core/types.py, DraftSpec); ValueError otherwise."""
    spec = chunk.draft
    assert spec is not None
    problem = None
    if spec.num_tokens < 1:
        problem = f"num_tokens {spec.num_tokens} < 1"
    elif not chunk.sample or len(chunk.token_ids) != 1 or chunk.start_layer != 0:
        problem = "a drafting chunk is a sampling one-token decode from layer 0"
    elif not spec.token_ids or spec.token_ids[-1] != chunk.token_ids[0]:
        problem = "draft.token_ids must end with the chunk's last token"
    elif spec.start_pos + len(spec.token_ids) != chunk.start_pos + 1:
        problem = (f"draft.token_ids at {spec.start_pos}..{spec.start_pos + len(spec.token_ids) - 1} must end at "
                   f"the chunk's position {chunk.start_pos}")
    elif len(spec.block_tables) != draft_layers:
        problem = f"{len(spec.block_tables)} draft block tables for {draft_layers} layers"
    if problem is not None:
        raise ValueError(f"chunk {chunk.request_id}: draft by {spec.member}: {problem}")


def check_ride(chunk: SeqChunk, num_layers: int) -> None:
    """The contract's shape of a chunk riding its member's draft forwards (SeqChunk.ride_tokens); ValueError
    otherwise."""
    problem = None
    if chunk.draft is not None:
        problem = "a riding chunk drafts nothing itself"
    elif not chunk.sample or len(chunk.token_ids) != 1 or chunk.start_layer != 0:
        problem = "a riding chunk is a sampling one-token decode from layer 0"
    elif len(chunk.block_tables) != num_layers:
        problem = f"{len(chunk.block_tables)} block tables for {num_layers} layers"
    if problem is not None:
        raise ValueError(f"chunk {chunk.request_id}: riding {chunk.ride_tokens} draft forwards: {problem}")


def _greedy(chunk: SeqChunk) -> bool:
    return chunk.sampling.temperature < MIN_SAMPLING_TEMPERATURE


def draft(model: PagedCausalLM, run: Callable[[PagedCausalLM, list[SeqChunk]], torch.Tensor], sampler: Sampler,
          chunks: Sequence[SeqChunk], eos_token_ids: Sequence[int],
          riders: Sequence[SeqChunk] = (), decoders: Sequence[SeqChunk] = (),
          ) -> tuple[dict[RequestId, Drafts], torch.Tensor | None, dict[RequestId, list[SampledToken]]]:
    """The drafts of every chunk drafting with `model`: one catch-up forward over all of them, then one
    one-token forward per further position (a chunk leaves after its own k). run(model, chunks) is the
    executor's forward (logits of each sampling chunk's last row). riders: the drafting member's own batch in the
    step, run in the catch-up forward (one read of its weights for both); their logits come back as the second
    value (None without riders), to be sampled as that batch's. decoders: the drafting member's chunks with
    ride_tokens, a row in each of their first ride_tokens forwards (RideDecodes); their tokens are the third value."""
    drafts = {c.request_id: Drafts() for c in chunks}
    rows = [SeqChunk(request_id=c.request_id, token_ids=list(c.draft.token_ids), start_pos=c.draft.start_pos,
                     block_tables=c.draft.block_tables, sample=True, sampling=c.sampling,
                     num_generated=c.num_generated) for c in chunks]
    active = list(chunks)
    rider_logits = None
    decoding = RideDecodes(sampler, decoders, model.member.eos_token_ids, model.member.context_tokens)
    steps = max([c.draft.num_tokens for c in chunks] + [c.ride_tokens for c in decoders])
    for step in range(steps):
        if step > 0:
            active = [c for c in active if c.draft.num_tokens > step]
            rows = [SeqChunk(request_id=c.request_id, token_ids=[drafts[c.request_id].tokens[-1]],
                             start_pos=c.start_pos + step, block_tables=c.draft.block_tables, sample=True,
                             sampling=c.sampling, num_generated=c.num_generated + step) for c in active]
        ride = decoding.rows(step)
        extra = list(riders) if step == 0 else []
        if not rows and not ride and not extra:
            continue                                  # every rider stopped early, no draft left this far
        logits = run(model, rows + ride + extra)
        if extra:
            rider_logits = logits[len(rows) + len(ride):]
        decoding.sample(logits[len(rows):len(rows) + len(ride)], ride)
        logits = logits[:len(rows)]
        if not rows:
            continue
        logits = logits.float()
        processed = sampler.adjust(logits, rows, eos_token_ids)
        chosen = processed.argmax(dim=-1)
        for i, (chunk, row) in enumerate(zip(active, rows)):
            if _greedy(chunk):
                continue
            q = sampler.distribution(processed[i], chunk.sampling)
            chosen[i] = sampler.draw(q, row)          # seeded: the per-step seed plain decoding uses there
            if chunk.sampling.seed is None:
                drafts[chunk.request_id].probs.append(q)
        for chunk, token in zip(active, chosen.tolist()):
            tokens = drafts[chunk.request_id].tokens
            tokens.append(token)
            if chunk.sampling.penalized:              # the next draft step's penalties count it
                sampler.record(chunk.request_id, chunk.num_generated, tokens)
    return drafts, rider_logits, decoding.tokens


class RideDecodes:
    """The drafting member's own decodes riding its draft forwards: per forward the rows of those still going,
    each sampled as plain decoding samples it at that position; a decode leaves after its ride_tokens or where
    plain decoding would stop it."""

    def __init__(self, sampler: Sampler, chunks: Sequence[SeqChunk], eos_token_ids: Sequence[int],
                 context_tokens: int) -> None:
        self.sampler, self.eos, self.context = sampler, eos_token_ids, context_tokens
        self.going = list(chunks)
        self.tokens: dict[RequestId, list[SampledToken]] = {c.request_id: [] for c in chunks}

    def rows(self, step: int) -> list[SeqChunk]:
        self.going = [c for c in self.going if c.ride_tokens > step]
        rows = []
        for c in self.going:
            got = self.tokens[c.request_id]
            rows.append(c if step == 0 else replace(c, token_ids=[got[-1].token_id], start_pos=c.start_pos + step,
                                                    num_generated=c.num_generated + step, ride_tokens=0))
        return rows

    def sample(self, logits: torch.Tensor, rows: list[SeqChunk]) -> None:
        if not rows:
            return
        stopped = set()
        tokens = {token.request_id: token for token in self.sampler.sample(logits, rows, self.eos)}
        for row in rows:
            token = tokens.get(row.request_id)                  # None: its own sampling failed, it stops here
            if token is not None:
                self.tokens[row.request_id].append(token)
            if token is None or _stops(row, 0, token.token_id, self.eos, self.context):
                stopped.add(row.request_id)
        if stopped:
            self.going = [c for c in self.going if c.request_id not in stopped]


def verify_rows(chunk: SeqChunk, drafted: Sequence[int]) -> list[SeqChunk]:
    """The chunk as 1 + k one-token rows [last, d1..dk] at consecutive positions, row j sampled as generation
    step num_generated + j (same block tables and residual pages)."""
    return [replace(chunk, token_ids=[token], start_pos=chunk.start_pos + j, num_generated=chunk.num_generated + j,
                    draft=None)
            for j, token in enumerate([chunk.token_ids[0], *drafted])]


def accept(sampler: Sampler, logits: torch.Tensor, rows: list[SeqChunk], drafts: Drafts,
           eos_token_ids: Sequence[int], context_tokens: int) -> list[SampledToken]:
    """logits [k + 1, vocab]: the target's raw logits of one request's verify rows. Returns its 1 to k + 1
    tokens (module docstring), num_drafted = k on the first."""
    first = rows[0]
    params, k = first.sampling, len(drafts.tokens)
    logits = logits.float()
    if params.penalized:                              # row j's penalties count d1..dj
        sampler.record(first.request_id, first.num_generated, drafts.tokens)
    processed = sampler.adjust(logits, rows, eos_token_ids)
    if _greedy(first):
        emitted = accept_greedy(processed, drafts.tokens)
    elif params.seed is not None:
        emitted = []
        for j, row in enumerate(rows):
            emitted.append(int(sampler.draw(sampler.distribution(processed[j], params), row)))
            if j == k or emitted[j] != drafts.tokens[j]:
                break
    else:
        target = torch.stack([sampler.distribution(processed[j], params) for j in range(k + 1)])
        emitted = accept_sampled(target, torch.stack(drafts.probs), drafts.tokens, sampler.generator(first))
    emitted = emitted[:_length_until_stop(first, emitted, eos_token_ids, context_tokens)]
    n = len(emitted)
    tokens = sampler.tokens(logits[:n], rows[:n], torch.tensor(emitted, device=logits.device))
    if params.penalized:
        sampler.record(first.request_id, first.num_generated, emitted)
    tokens[0] = tokens[0]._replace(num_drafted=k)
    return tokens


def _length_until_stop(chunk: SeqChunk, emitted: list[int], eos_token_ids: Sequence[int], context_tokens: int) -> int:
    """How many of `emitted` the request keeps: up to and including the first after which plain decoding would
    stop it (as orchestrator/core/sequence.py's stop_reason decides)."""
    for j, token in enumerate(emitted):
        if _stops(chunk, j, token, eos_token_ids, context_tokens):
            return j + 1
    return len(emitted)


def _stops(chunk: SeqChunk, j: int, token: int, eos_token_ids: Sequence[int], context_tokens: int) -> bool:
    """Whether plain decoding stops the request after sampling `token` as the chunk's row j (generation step
    num_generated + j, position start_pos + j), as sequence.py's stop_reason decides."""
    params = chunk.sampling
    generated = chunk.num_generated + j + 1
    if generated >= params.min_tokens and (token in params.stop_token_ids
                                           or (not params.ignore_eos and token in eos_token_ids)):
        return True
    return generated >= params.max_tokens or chunk.start_pos + j + 2 >= context_tokens
