"""Draft-target speculation inside the family: which member drafts for a request, the draft's KV beside the
request's own, how many tokens each member's requests draft in a step (DraftLength, a policy object), the step's
DraftSpecs, and what a verify gives back.

A smaller member drafts k tokens for a request of a larger one, which verifies them in one forward of k + 1 rows
(the step-plan contract: types.DraftSpec, docs/ARCHITECTURE.md "Speculation"). In MFS the draft costs no weights of
its own, its pages come from the one pool, and its KV of a session's prefix is often cached already (the session
started on it, or it served the previous turn): the draft's tables are prefix-matched in the draft member's cache
at admission like any request's. With comparison.private_drafts each member's server keeps its own draft copy:
the draft's keys carry that server's salt (a cache no other server reads) and its pages come from that server's
slice. Drafts are the first pages to go under pressure: before a decode would preempt a request, and before a
waiting request is refused pages (release_drafts). Pure: no clock, no I/O.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence as Seq
from typing import ClassVar, NamedTuple

from orchestrator.core.config import MFSConfig, SpeculationConfig
from orchestrator.core.family import FamilySpec
from orchestrator.core.parts import SchedulerParts
from orchestrator.core.sequence import DraftState, Sequence
from orchestrator.core.types import (DraftSpec, ForwardShape, MemberName, RequestId, SampledToken, SamplingParams,
                                     SeqChunk, StepPlan, attended_keys)

# A draft's catch-up of at most this many tokens is a verify's rows (its request's KV read once, the rows through
# the weights); a longer one (a draft's first step after admission) a prefill chunk.
CATCH_UP_VERIFY_ROWS = 16

# estimate_step_s of an executor that can price a step (engine_api.StepCostEstimator); None: not yet (an engine
# that learns its step costs from its own steps has measured too few)
StepCost = Callable[[Seq[ForwardShape]], "float | None"]


def draftable(sampling: SamplingParams) -> bool:
    """Whether a verify gives exactly what decoding alone would: not with penalties or a logit bias (the rows past
    the first would need the drafted tokens in their history), nor with a seed under sampling (a seeded reply is
    the same every time; speculation's draws depend on k, which depends on the batch)."""
    return not sampling.penalized and not (sampling.temperature > 0 and sampling.seed is not None)


def draft_member_for(family: FamilySpec, config: MFSConfig, seq: Sequence) -> MemberName | None:
    """The member that drafts for `seq` on its current member: the family's smallest member, when it is smaller.
    None when speculation is off, for a warm-up, a pinned request (its caller named the one member to answer) and
    a sampling that speculation does not reproduce (draftable)."""
    smallest = family.members[0].name
    if (not config.speculation.enabled or seq.is_warmup or seq.member == smallest
            or seq.request.pinned_member is not None or not draftable(seq.request.sampling)):
        return None
    return smallest


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens one verify of k drafts yields on average when each draft is accepted with probability `acceptance`
    until the first rejection: 1 + a + ... + a^k = (1 - a^(k + 1)) / (1 - a)."""
    if k <= 0:
        return 1.0
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


def pair_name(draft: str, target: str) -> str:
    return f"{draft}->{target}"


class AcceptanceEstimates:
    """Per draft->target pair, the per-token acceptance its recent verifies show: accepted drafts over accepted
    drafts plus rejections (the estimate of a geometric's parameter), both decayed by DECAY per verify, seeded
    with the configured prior as PRIOR_VERIFIES verifies' worth."""

    PRIOR_VERIFIES: ClassVar[float] = 20.0
    DECAY: ClassVar[float] = 0.995

    def __init__(self, config: SpeculationConfig) -> None:
        self.config = config
        self._counts: dict[str, list[float]] = {}      # pair -> [accepted, accepted + rejections]

    def _entry(self, pair: str) -> list[float]:
        entry = self._counts.get(pair)
        if entry is None:
            prior = self.config.acceptance.get(pair, self.config.default_acceptance)
            entry = self._counts[pair] = [prior * self.PRIOR_VERIFIES, self.PRIOR_VERIFIES]
        return entry

    def acceptance(self, pair: str) -> float:
        accepted, trials = self._entry(pair)
        return min(accepted / trials, 0.999) if trials > 0 else 0.0

    def observe(self, pair: str, num_drafted: int, num_accepted: int) -> None:
        entry = self._entry(pair)
        rejected = 1.0 if num_accepted < num_drafted else 0.0
        entry[0] = entry[0] * self.DECAY + num_accepted
        entry[1] = entry[1] * self.DECAY + num_accepted + rejected


class Rider(NamedTuple):
    """A decode chunk of the step's draft member that may ride every draft forward (rides_every_draft)."""

    chunk: SeqChunk
    max_tokens: int           # the most it may decode this step (its remaining tokens, its context)


class Candidate(NamedTuple):
    """A decode chunk of a request with a draft, as the draft-length policy weighs it."""

    chunk: SeqChunk
    seq: Sequence
    max_k: int                # the most drafts it may take this step (its remaining tokens, its context)
    acceptance: float         # its pair's estimated per-token acceptance


class DraftLength:
    """Each target member's k in the step: the choice that makes the step's device time per token smallest,
    T(k) / sum_r E_r(k_r), where E_r is what chunk r gets from the step (expected_tokens for a drafting request at
    its member's k_r, 1 for every other chunk) and T(k) the executor's estimate of the step with those drafts (the
    draft forwards before the step, each verify k_r + 1 rows at its context). Time per token, not each request's
    own token period: every request running on the device waits for the step, not only those in it (members that
    skip the step, member_turns.py), so a step's cost is its time over what it yields. Members differ: a draft is
    cheap beside a large target's forward and dear beside a small one's, so one k for the step would over-draft
    the one or under-draft the other; a member's k is chosen with the others' held (coordinate descent, until no
    member's k changes). Along one member's k the cost has one minimum (T grows about linearly, sum E_r ever
    less), so k grows while each step up lowers it; 0 (no drafts) where even one does not pay: large batches,
    compute-bound steps. Without an estimator, the fixed k; while the estimator has no estimate yet (an engine
    still measuring its first steps), 0."""

    # passes of coordinate descent over the members (each pass only lowers the cost; two settle it in practice)
    MAX_PASSES: ClassVar[int] = 3

    def __init__(self, config: SpeculationConfig) -> None:
        self.config = config

    def choose(self, plan: StepPlan, candidates: list[Candidate], estimate: StepCost | None,
               margin: float = 0.0, riders: Seq[Rider] = ()) -> dict[str, int]:
        """target member -> the tokens its candidates draft this step. margin: how far the estimate may be off,
        relative (a fit of noisy measured steps; 0 for a cost model): drafts must save more than that share of the
        time per token, or none are made (a saving inside the estimate's own error is no evidence). riders: the
        draft member's decodes that ride every draft forward, each yielding a token per forward (at least one)."""
        targets: list[str] = sorted({c.seq.member for c in candidates})
        if estimate is None:
            return dict.fromkeys(targets, self.config.fixed_k)
        ks = dict.fromkeys(targets, 0)
        num_chunks = sum(len(batch.chunks) for batch in plan.batches)
        others = num_chunks - len(candidates) - len(riders)

        def cost(choice: dict[str, int]) -> float | None:
            step_s = estimate(step_forwards(plan, candidates, choice, self.config.max_k, riders,
                                            self.config.draft_window, self.config.draft_sink_tokens))
            if step_s is None:
                return None
            drafted = 0.0      # summed as sum() would (mypyc types sum() over floats as int)
            forwards = 0
            for c in candidates:
                k_c = min(choice[c.seq.member], c.max_k)
                drafted += expected_tokens(c.acceptance, k_c)
                forwards = max(forwards, k_c)
            for rider in riders:
                drafted += ride_tokens(forwards, rider.max_tokens)
            return step_s / (others + drafted)

        plain = cost(ks)
        if plain is None:
            return ks
        best = plain
        for _ in range(self.MAX_PASSES):
            changed = False
            for member in targets:
                start = ks[member]
                trial = dict(ks)
                # from 0 upwards: the member's best k given the others' (its cost along k has one minimum)
                member_best_k, member_best = 0, None
                for k in range(0, self.config.max_k + 1):
                    trial[member] = k
                    c = best if k == start else cost(trial)
                    if c is None or (member_best is not None and c >= member_best):
                        break
                    member_best_k, member_best = k, c
                if member_best is not None and member_best_k != start and member_best < best:
                    ks[member], best, changed = member_best_k, member_best, True
            if not changed or len(targets) == 1:
                break
        if best > plain * (1.0 - margin):
            return dict.fromkeys(targets, 0)
        return ks


class DraftEntry(NamedTuple):
    """One request's rows in its draft member's forwards of a step (a draft, or a rider's decodes)."""

    rows: int                 # catch-up rows
    before: int               # tokens before them
    last: int                 # the last catch-up row's position
    k: int                    # forwards it takes a row of (its drafts, a rider's tokens)
    window: int = 0           # the draft's attention window (DraftSpec.window; 0: none)
    sink_tokens: int = 0

    def context(self, position: int) -> int:
        """Tokens a row at `position` reads (a windowed draft reads no more than its window)."""
        return attended_keys(position, self.window, self.sink_tokens)


def ride_tokens(forwards: int, max_tokens: int) -> int:
    """Tokens a rider decodes in a step of `forwards` draft forwards: one per forward, within its own bound; with
    fewer than two it rides nothing (one token, in its batch or the catch-up, as without rides)."""
    tokens = min(forwards, max_tokens)
    return tokens if tokens >= 2 else 1


def step_forwards(plan: StepPlan, candidates: list[Candidate], ks: dict[str, int], max_rows: int,
                  riders: Seq[Rider] = (), window: int = 0, sink_tokens: int = 0) -> list[ForwardShape]:
    """The forwards of `plan` if every candidate drafted min(its member's k in ks, its max_k) tokens: the draft
    forwards first (the first one catches each draft up to its request's last token, the k - 1 others decode one
    drafted token each; riders decode a token in each, out of their batch's forward), then each member batch with
    the candidates' chunks as verifies of k + 1 rows. A catch-up longer than a verify (a draft's first step after
    admission) counts as max_rows + 1 rows: it is paid once, not per step. window, sink_tokens: the drafts'
    attention window (speculation.draft_window)."""
    by_chunk = {id(c.chunk): min(ks.get(c.seq.member, 0), c.max_k) for c in candidates}
    drafts: dict[str, list[DraftEntry]] = {}
    for c in candidates:
        k_r = by_chunk[id(c.chunk)]
        if k_r <= 0:
            continue
        draft = c.seq.draft
        assert draft is not None        # a candidate has a draft
        last = len(c.seq.token_ids) - 1
        rows = min(last + 1 - draft.num_computed_tokens, max_rows + 1)
        drafts.setdefault(draft.member, []).append(DraftEntry(rows, last + 1 - rows, last, k_r, window, sink_tokens))
    riding: set[int] = set()
    if riders and drafts:
        forwards = max(by_chunk.values())
        drafter = next(iter(drafts))        # the family's smallest member drafts for every request
        for rider in riders:
            n = ride_tokens(forwards, rider.max_tokens)
            if n >= 2:
                riding.add(id(rider.chunk))
                drafts[drafter].append(DraftEntry(1, rider.chunk.start_pos, rider.chunk.start_pos, n))
    return _draft_forwards(drafts) + _batch_forwards(plan, lambda chunk: by_chunk.get(id(chunk), 0), riding)


def plan_forwards(plan: StepPlan) -> list[ForwardShape]:
    """The forwards of a planned step as its DraftSpecs set them (what an executor that measures its steps fits
    its step-cost estimate on): the same shapes step_forwards prices, from the plan itself."""
    drafts: dict[str, list[DraftEntry]] = {}
    riding: set[int] = set()
    for batch in plan.batches:
        for chunk in batch.chunks:
            spec = chunk.draft
            if spec is not None:
                rows = len(spec.token_ids)
                drafts.setdefault(spec.member, []).append(DraftEntry(
                    rows, spec.start_pos, spec.start_pos + rows - 1, spec.num_tokens, spec.window, spec.sink_tokens))
            elif chunk.ride_tokens:
                riding.add(id(chunk))
                drafts.setdefault(batch.member, []).append(
                    DraftEntry(1, chunk.start_pos, chunk.start_pos, chunk.ride_tokens))
    return _draft_forwards(drafts) + _batch_forwards(
        plan, lambda chunk: chunk.draft.num_tokens if chunk.draft is not None else 0, riding)


def _draft_forwards(drafts: dict[str, list[DraftEntry]]) -> list[ForwardShape]:
    """Per draft member, from its requests' entries: the catch-up forward (one row a decode, up to
    CATCH_UP_VERIFY_ROWS a verify's rows, more a prefill chunk), then one forward per further drafted token; each
    row at the context it reads (a windowed draft's, at most its window)."""
    forwards: list[ForwardShape] = []
    for member, entries in drafts.items():
        forwards.append(ForwardShape(MemberName(member), tuple(e.context(e.before) for e in entries if e.rows == 1),
                                     tuple((e.rows, e.context(e.before)) for e in entries
                                           if 1 < e.rows <= CATCH_UP_VERIFY_ROWS),
                                     tuple((e.rows, e.context(e.before)) for e in entries
                                           if e.rows > CATCH_UP_VERIFY_ROWS), True))
        for j in range(1, max(e.k for e in entries)):
            contexts = tuple(e.context(e.last + j) for e in entries if e.k > j)
            forwards.append(ForwardShape(MemberName(member), contexts, (), (), True))
    return forwards


def _batch_forwards(plan: StepPlan, drafts_of: Callable[[SeqChunk], int],
                    riding: set[int] | None = None) -> list[ForwardShape]:
    """Each member batch's forward, a chunk with k drafts as a verify of k + 1 rows; riding (chunk ids): chunks
    computed in the draft forwards instead (a batch left with none has no forward)."""
    forwards: list[ForwardShape] = []
    for batch in plan.batches:
        decodes: list[int] = []
        verifies: list[tuple[int, int]] = []
        prefills: list[tuple[int, int]] = []
        for chunk in batch.chunks:
            if riding and id(chunk) in riding:
                continue
            k_r = drafts_of(chunk)
            n = len(chunk.token_ids)
            if k_r > 0:
                verifies.append((k_r + 1, chunk.start_pos))
            elif n == 1 and chunk.sample and chunk.start_pos > 0:
                decodes.append(chunk.start_pos)
            else:
                prefills.append((n, chunk.start_pos))
        if decodes or verifies or prefills:
            forwards.append(ForwardShape(batch.member, tuple(decodes), tuple(verifies), tuple(prefills)))
    return forwards


class Speculation:
    """Per request its draft (attach at admission, release_drafts under pressure; Sequence.drop_pages releases it
    with the request); per step the DraftSpecs (plan); after the step the verify's bookkeeping (verified, then
    advance once the tokens are in)."""

    def __init__(self, parts: SchedulerParts) -> None:
        self.family, self.config, self.kv, self.running = parts.family, parts.config, parts.kv, parts.running
        self.stats = parts.stats
        self.settings = parts.config.speculation
        self.private = parts.config.comparison.private_drafts
        # the draft member's own decodes ride every draft forward: only where its batch rides at all, and its drafts
        # are its own (a separate server's draft copy is not its small member)
        rides = self.settings.rides_every_draft
        if rides is None:
            rides = not parts.family.is_nested()
        self.rides = rides and self.settings.drafts_ride and not self.private
        self.partitioned = parts.config.comparison.static_split is not None
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
        """After seq's own pages: its draft's tables for its tokens, prefix-matched in the draft member's cache
        (what that member holds of the prompt is not recomputed), allocated beside reserve_pages. None when they
        do not fit: the request decodes without drafting."""
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
        """Gives back the drafts of the running requests in `member`'s pool (full blocks stay cached); they decode
        without drafting from now on. True if any was held."""
        if not self.settings.enabled:
            return False
        released = False
        for seq in self.running:
            if seq.draft is not None and (not self.partitioned or seq.member == member):
                seq.drop_draft(self.kv)
                released = True
        if released:
            self.running.changed()
        return released

    def _max_k(self, seq: Sequence, draft: DraftState) -> int:
        """Drafts seq may take this step: at most max_k, no more than its remaining tokens less the one the verify
        always gives, and every verified position inside both members' contexts."""
        remaining = seq.request.sampling.max_tokens - seq.num_generated - 1
        context = min(self._contexts[seq.member], self._contexts[draft.member]) - len(seq.token_ids) - 1
        return min(self.settings.max_k, remaining, context)

    # ------------------------------------------------------------------ a step
    def plan(self, plan: StepPlan) -> None:
        """Gives the step's decode chunks of requests with a draft their DraftSpec, k from the policy; grows their
        tables for the k + 1 verify rows and the draft's k - 1 new positions (a request whose pages do not stretch
        that far decodes plainly this step)."""
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
            chunk.block_tables, residual_out = own.tables_upto(-(-(n + k_r) // own.tokens_per_block))
            if chunk.residual_table_out is not None:
                chunk.residual_table_out = residual_out
            tables, _ = draft.kv.tables_upto(-(-(n + k_r - 1) // draft.kv.tokens_per_block))
            chunk.draft = DraftSpec(member=draft.member, num_tokens=k_r,
                                    token_ids=seq.token_ids[draft.num_computed_tokens:],
                                    start_pos=draft.num_computed_tokens, block_tables=tables,
                                    window=self.settings.draft_window,
                                    sink_tokens=self.settings.draft_sink_tokens)
        if riders:
            forwards = max((c.draft.num_tokens for b in plan.batches for c in b.chunks if c.draft is not None),
                           default=0)
            self._ride(riders, forwards)
        running.changed()       # tables grew

    def _riders(self, plan: StepPlan, candidates: list[Candidate]) -> list[Rider]:
        """The draft member's decode chunks in the plan that may ride its draft forwards: what it would draft for
        (draftable sampling, not pinned, not a warm-up), with at least two tokens to go."""
        drafters = {c.seq.draft.member for c in candidates if c.seq.draft is not None}
        riders: list[Rider] = []
        for batch in plan.batches:
            if batch.member not in drafters:
                continue
            for chunk in batch.chunks:
                if not chunk.sample or len(chunk.token_ids) != 1 or chunk.start_layer != 0:
                    continue
                seq = self.running.get(chunk.request_id)
                if (seq is None or not seq.is_decoding() or seq.is_warmup or seq.request.pinned_member is not None
                        or not draftable(seq.request.sampling)):
                    continue
                n = len(seq.token_ids)
                most = min(seq.request.sampling.max_tokens - seq.num_generated, self._contexts[seq.member] - n)
                if most >= 2:
                    riders.append(Rider(chunk, most))
        return riders

    def _ride(self, riders: list[Rider], forwards: int) -> None:
        """Gives each rider its tokens for a step of `forwards` draft forwards and grows its table to hold them (a
        rider whose pages do not stretch that far decodes one token, as usual)."""
        for rider in riders:
            tokens = ride_tokens(forwards, rider.max_tokens)
            chunk = rider.chunk
            seq = self.running.get(chunk.request_id)
            if tokens < 2 or seq is None or seq.kv is None:
                continue
            end = chunk.start_pos + tokens
            if not self.kv.grow(seq.kv, end):
                continue
            chunk.block_tables, residual_out = seq.kv.tables_upto(-(-end // seq.kv.tokens_per_block))
            if chunk.residual_table_out is not None:
                chunk.residual_table_out = residual_out
            chunk.ride_tokens = tokens

    def verified(self, plan: StepPlan, sampled: list[SampledToken]) -> dict[RequestId, int] | None:
        """Before the step's tokens go into their requests: per drafting request, the drafts its member accepted
        (the tokens it got back, less the one every verify gives), counted per pair (stats, the acceptance
        estimate) and per request. None when the step drafted nothing."""
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
        """After the tokens went in: a request still running holds its member's KV up to its new last token (not
        included: the verify's own token is computed next step) and its draft's up to what the draft wrote;
        newly full blocks of both get their keys."""
        register = self.kv.register_full_blocks
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
                if computed > seq.num_computed_tokens:
                    seq.num_computed_tokens = computed
                register(seq.kv, seq.hashes, seq.num_computed_tokens)
                draft = seq.draft
                if draft is None or spec is None:
                    continue
                draft.num_computed_tokens = min(computed, spec.start_pos + len(spec.token_ids) + spec.num_tokens - 1)
                register(draft.kv, self._draft_hashes(seq, draft), draft.num_computed_tokens)

    def _draft_hashes(self, seq: Sequence, draft: DraftState) -> list[bytes]:
        if draft.shares_hashes:
            return seq.hashes
        if (len(draft.hashes) + 1) * draft.kv.tokens_per_block <= len(seq.token_ids):
            draft.hashes = self.kv.block_hashes(draft.member, seq.token_ids, draft.salt, known=draft.hashes)
        return draft.hashes
