"""Draft-target speculation inside the family (docs/ARCHITECTURE.md "Speculation"): which member drafts for a
request, the draft's KV beside the request's own (prefix-matched in the draft member's cache at admission), the
step's DraftSpecs (k from draft_length.DraftLength) and what a verify gives back. Drafts are the first pages to go
under pressure (release_drafts). Pure: no clock, no I/O.
"""
from __future__ import annotations

from collections.abc import Callable

from orchestrator.core.config import MFSConfig
from orchestrator.core.family import FamilySpec
from orchestrator.core.parts import SchedulerParts
from orchestrator.core.draft_length import (AcceptanceEstimates, Candidate, DraftLength, Rider, StepCost, pair_name,
                                           ride_tokens)
from orchestrator.core.sequence import DraftState, Sequence
from orchestrator.core.types import DraftSpec, MemberName, RequestId, SampledToken, SamplingParams, SeqChunk, StepPlan


def draftable(sampling: SamplingParams) -> bool:
    """Whether a verify gives exactly what decoding alone would: not with penalties or a logit bias (later rows
    would need the drafts in their history), nor with a seed under sampling (the draws would depend on k)."""
    return not sampling.penalized and not (sampling.temperature > 0 and sampling.seed is not None)


def speculable(seq: Sequence) -> bool:
    """Whether `seq` may take more than one token a step: not a warm-up, not pinned, its sampling draftable."""
    return not seq.is_warmup and seq.request.pinned_member is None and draftable(seq.request.sampling)


def draft_member_for(family: FamilySpec, config: MFSConfig, seq: Sequence) -> MemberName | None:
    """The member that drafts for `seq`: the family's smallest, when smaller and `seq` is speculable; else None."""
    smallest = family.members[0].name
    if not config.speculation.enabled or seq.member == smallest or not speculable(seq):
        return None
    return smallest


class Speculation:
    """Per request its draft (attach, release_drafts); per step the DraftSpecs (plan); after it the verify's
    bookkeeping (verified, then advance once the tokens are in)."""

    def __init__(self, parts: SchedulerParts, shares_pages: Callable[[Sequence, str], bool],
                 private: bool = False) -> None:
        """shares_pages: Reservation.shares_pages. private: each member's server keeps its own draft copy (its keys
        salted with that server, its pages from that server's slice)."""
        self.family, self.config, self.kv, self.running = parts.family, parts.config, parts.kv, parts.running
        self.stats = parts.stats
        self.settings = parts.config.speculation
        self.private = private
        # the draft member's own decodes ride every draft forward: in a family of separate weights (a nested one
        # merges its batch into its host's forward), and not with private drafts (a server's copy is not its member)
        self.rides = not parts.family.is_nested() and self.settings.drafts_ride and not self.private
        self.shares_pages = shares_pages
        self.acceptance = AcceptanceEstimates(self.settings)
        self.length = DraftLength(self.settings)
        self.estimate: StepCost | None = None
        self.estimate_error: Callable[[], float] | None = None
        self._contexts = {m.name: m.context_tokens for m in parts.family.members}

    def use_step_cost(self, estimate: StepCost | None, error: Callable[[], float] | None = None) -> None:
        """The executor's step-cost estimate (engine_api.StepCostEstimator.estimate_step_s), or None: fixed k."""
        self.estimate = estimate
        self.estimate_error = error

    # ------------------------------------------------------------------ a request's draft
    def attach(self, seq: Sequence, reserve_pages: int, page_loads: list) -> None:
        """After seq's own pages: its draft's tables, prefix-matched in the draft member's cache, allocated beside
        reserve_pages. When they do not fit the request decodes without drafting."""
        member = draft_member_for(self.family, self.config, seq)
        if member is None:
            return
        salt = seq.request.cache_salt
        if self.private:
            salt = f"{salt or ''}|draft of {seq.member}"      # this server's own draft cache
        shares = not self.private and self.kv.tokens_per_block(member) == self.kv.tokens_per_block(seq.member)
        hashes = seq.hashes if shares else self.kv.block_hashes(member, seq.token_ids, salt)
        match = self.kv.match(member, hashes, len(seq.token_ids), allow_shared=False)
        attached = self.kv.attach(member, match, hashes, len(seq.token_ids), reserve_pages=reserve_pages,
                                  account=seq.member if self.private else None, residuals=False)
        if attached is None:
            return
        kv, loads = attached
        page_loads.extend(loads)
        seq.draft = DraftState(member=member, kv=kv, hashes=[] if shares else hashes, salt=salt,
                               shares_hashes=shares, num_computed_tokens=match.num_full_tokens)

    def release_drafts(self, member: str) -> bool:
        """Gives back the drafts of the running requests in `member`'s pool (they decode plainly from now on);
        True if any was held."""
        if not self.settings.enabled:
            return False
        released = False
        for seq in self.running:
            if seq.draft is not None and self.shares_pages(seq, member):
                seq.drop_draft(self.kv)
                released = True
        if released:
            self.running.changed()
        return released

    def _max_k(self, seq: Sequence, draft: DraftState) -> int:
        """Drafts seq may take this step: within max_k, its remaining tokens (less the verify's own) and both
        members' contexts."""
        remaining = seq.request.sampling.max_tokens - seq.num_generated - 1
        context = min(self._contexts[seq.member], self._contexts[draft.member]) - len(seq.token_ids) - 1
        return min(self.settings.max_k, remaining, context)

    # ------------------------------------------------------------------ a step
    def plan(self, plan: StepPlan) -> None:
        """Gives the step's decode chunks of requests with a draft their DraftSpec and grows their tables for the
        k + 1 verify rows and the draft's k - 1 new positions (where pages fall short: a plain decode)."""
        if not self.settings.enabled:
            return
        candidates: list[Candidate] = []
        running = self.running
        for batch in plan.batches:
            for chunk in batch.chunks:
                if not chunk.sample or len(chunk.token_ids) != 1:
                    continue
                seq = running.get(chunk.request_id)
                if seq is None or seq.draft is None or not seq.is_decoding():
                    continue
                max_k = self._max_k(seq, seq.draft)
                if max_k >= 1:
                    pair = pair_name(seq.draft.member, seq.member)
                    candidates.append(Candidate(chunk, seq, max_k, self.acceptance.acceptance(pair)))
        if not candidates:
            return
        margin = self.estimate_error() if self.estimate_error is not None else 0.0
        riders = self._riders(plan, candidates) if self.rides else []
        ks = self.length.choose(plan, candidates, self.estimate, margin, riders)
        for k in ks.values():
            self.stats.on_draft_length(k)
        if not any(ks.values()):
            return
        grow = self.kv.grow
        for candidate in candidates:
            chunk, seq = candidate.chunk, candidate.seq
            draft, own = seq.draft, seq.kv
            assert draft is not None and own is not None
            k_r = min(ks[seq.member], candidate.max_k)
            if k_r <= 0:
                continue
            n = len(seq.token_ids)
            if not (grow(own, n + k_r) and grow(draft.kv, n + k_r - 1)):
                continue
            _cover(chunk, seq, n + k_r)
            tables, _ = draft.kv.tables_upto(-(-(n + k_r - 1) // draft.kv.tokens_per_block))
            chunk.draft = DraftSpec(member=draft.member, num_tokens=k_r,
                                    token_ids=seq.token_ids[draft.num_computed_tokens:],
                                    start_pos=draft.num_computed_tokens, block_tables=tables)
        if riders:
            forwards = max((c.draft.num_tokens for b in plan.batches for c in b.chunks if c.draft is not None),
                           default=0)
            self._ride(riders, forwards)
        running.changed()       # tables grew

    def _riders(self, plan: StepPlan, candidates: list[Candidate]) -> list[Rider]:
        """The draft member's speculable decode chunks with at least two tokens to go: they may ride its forwards."""
        drafters = {c.seq.draft.member for c in candidates if c.seq.draft is not None}
        riders: list[Rider] = []
        for batch in plan.batches:
            if batch.member not in drafters:
                continue
            for chunk in batch.chunks:
                if not chunk.sample or len(chunk.token_ids) != 1 or chunk.start_layer != 0:
                    continue
                seq = self.running.get(chunk.request_id)
                if seq is None or not seq.is_decoding() or not speculable(seq):
                    continue
                n = len(seq.token_ids)
                most = min(seq.request.sampling.max_tokens - seq.num_generated, self._contexts[seq.member] - n)
                if most >= 2:
                    riders.append(Rider(chunk, most))
        return riders

    def _ride(self, riders: list[Rider], forwards: int) -> None:
        """Gives each rider its tokens for `forwards` draft forwards and grows its table (else it decodes one)."""
        for rider in riders:
            tokens = ride_tokens(forwards, rider.max_tokens)
            chunk = rider.chunk
            seq = self.running.get(chunk.request_id)
            if tokens < 2 or seq is None or seq.kv is None:
                continue
            if self.kv.grow(seq.kv, chunk.start_pos + tokens):
                _cover(chunk, seq, chunk.start_pos + tokens)
                chunk.ride_tokens = tokens

    def verified(self, plan: StepPlan, sampled: list[SampledToken]) -> dict[RequestId, int] | None:
        """Before the step's tokens go in: per drafting request, the drafts accepted (the tokens back less the
        verify's own), counted per pair and per request. None when the step drafted nothing."""
        drafted = [(chunk, batch.member) for batch in plan.batches for chunk in batch.chunks
                   if chunk.draft is not None or chunk.ride_tokens]
        if not drafted:
            return None
        returned = dict.fromkeys((chunk.request_id for chunk, _ in drafted), 0)
        for token in sampled:
            if token.request_id in returned:
                returned[token.request_id] += 1
        accepted: dict[RequestId, int] = {}
        for chunk, target in drafted:
            if chunk.draft is None:             # a rider: its tokens after the first, as a verify's accepted ones
                if returned[chunk.request_id]:
                    accepted[chunk.request_id] = returned[chunk.request_id] - 1
                    self.stats.on_ride(target, returned[chunk.request_id])
                continue
            draft = chunk.draft
            assert draft is not None
            got = returned[chunk.request_id]
            if got == 0:
                continue
            n = min(got - 1, draft.num_tokens)
            accepted[chunk.request_id] = n
            pair = pair_name(draft.member, target)
            self.acceptance.observe(pair, draft.num_tokens, n)
            self.stats.on_speculation(pair, draft.num_tokens, n)
            seq = self.running.get(chunk.request_id)
            if seq is not None:
                seq.num_drafted_tokens += draft.num_tokens
                seq.num_accepted_tokens += n
        return accepted

    def advance(self, plan: StepPlan, accepted: dict[RequestId, int]) -> None:
        """After the tokens went in: computed counts up to the new last token (excluded: computed next step) and,
        for the draft, what it wrote; newly full blocks of both get their keys."""
        for batch in plan.batches:
            for chunk in batch.chunks:
                spec = chunk.draft
                n = accepted.get(chunk.request_id) if spec is not None or chunk.ride_tokens else None
                if n is None:
                    continue
                seq = self.running.get(chunk.request_id)
                if seq is None or seq.kv is None:
                    continue            # it stopped or escalated among the returned tokens
                computed = chunk.start_pos + 1 + n
                seq.computed_to(computed, self.kv)
                draft = seq.draft
                if draft is None or spec is None:
                    continue
                draft.num_computed_tokens = min(computed, spec.start_pos + len(spec.token_ids) + spec.num_tokens - 1)
                self.kv.register_full_blocks(draft.kv, self._draft_hashes(seq, draft), draft.num_computed_tokens)

    def _draft_hashes(self, seq: Sequence, draft: DraftState) -> list[bytes]:
        if draft.shares_hashes:
            return seq.hashes
        if (len(draft.hashes) + 1) * draft.kv.tokens_per_block <= len(seq.token_ids):
            draft.hashes = self.kv.block_hashes(draft.member, seq.token_ids, draft.salt, known=draft.hashes)
        return draft.hashes


def _cover(chunk: SeqChunk, seq: Sequence, end: int) -> None:
    """chunk's tables (and residual_out, where it writes one) cover positions [0, end) of seq's grown KV."""
    assert seq.kv is not None
    chunk.block_tables, residual_out = seq.kv.tables_upto(-(-end // seq.kv.tokens_per_block))
    if chunk.residual_table_out is not None:
        chunk.residual_table_out = residual_out
