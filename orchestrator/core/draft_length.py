"""How many tokens each member's requests draft in a step: the acceptance estimates, DraftLength, and the
forwards a step's plan runs (plan_forwards: what a step-cost estimator prices). Pure: no clock, no I/O.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence as Seq
from typing import ClassVar, NamedTuple

from orchestrator.core.config import SpeculationConfig
from orchestrator.core.sequence import Sequence
from orchestrator.core.types import ForwardShape, MemberName, SeqChunk, StepPlan

# A draft's catch-up of at most this many tokens is a verify's rows (its request's KV read once, the rows through
# the weights); a longer one (a draft's first step after admission) a prefill chunk.
CATCH_UP_VERIFY_ROWS = 16

# estimate_step_s of an executor that can price a step (engine_api.StepCostEstimator); None: not yet (an engine
# that learns its step costs from its own steps has measured too few)
StepCost = Callable[[Seq[ForwardShape]], "float | None"]


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens one verify of k drafts yields on average: 1 + a + ... + a^k = (1 - a^(k + 1)) / (1 - a)."""
    if k <= 0:
        return 1.0
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


def pair_name(draft: str, target: str) -> str:
    return f"{draft}->{target}"


class AcceptanceEstimates:
    """Per draft->target pair, the per-token acceptance: accepted drafts over accepted drafts plus rejections (a
    geometric's parameter), both decayed by DECAY per verify, seeded with the prior as PRIOR_VERIFIES verifies."""

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
    """A decode chunk of the step's draft member that may ride every draft forward (Speculation.rides)."""

    chunk: SeqChunk
    max_tokens: int           # the most it may decode this step (its remaining tokens, its context)


class Candidate(NamedTuple):
    """A decode chunk of a request with a draft, as the draft-length policy weighs it."""

    chunk: SeqChunk
    seq: Sequence
    max_k: int                # the most drafts it may take this step (its remaining tokens, its context)
    acceptance: float         # its pair's estimated per-token acceptance


class DraftLength:
    """Each target member's k in the step: the choice that minimises the step's device time per token,
    T(k) / sum_r E_r(k_r) (docs/ARCHITECTURE.md "Speculation"), one member's k at a time with the others held
    (coordinate descent, until none changes). Along one member's k the cost has one minimum (T grows about
    linearly, sum E_r ever less), so k grows while each step up lowers it. Without an estimator, the fixed k;
    while the estimator has no estimate yet (an engine still measuring its first steps), 0."""

    # passes of coordinate descent over the members (each pass only lowers the cost; two settle it in practice)
    MAX_PASSES: ClassVar[int] = 3

    def __init__(self, config: SpeculationConfig) -> None:
        self.config = config

    def choose(self, plan: StepPlan, candidates: list[Candidate], estimate: StepCost | None,
               margin: float = 0.0, riders: Seq[Rider] = ()) -> dict[str, int]:
        """target member -> the tokens its candidates draft this step. margin: the estimate's relative error;
        drafts must save more than that share of the time per token, or none are made. riders: the draft member's
        decodes that ride every draft forward, a token per forward (at least one)."""
        targets: list[str] = sorted({c.seq.member for c in candidates})
        if estimate is None:
            return dict.fromkeys(targets, self.config.fixed_k)
        ks = dict.fromkeys(targets, 0)
        num_chunks = sum(len(batch.chunks) for batch in plan.batches)
        others = num_chunks - len(candidates) - len(riders)

        def cost(choice: dict[str, int]) -> float | None:
            step_s = estimate(step_forwards(plan, candidates, choice, self.config.max_k, riders))
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


def ride_tokens(forwards: int, max_tokens: int) -> int:
    """Tokens a rider decodes in `forwards` draft forwards: one each, within its bound; under two it rides not."""
    tokens = min(forwards, max_tokens)
    return tokens if tokens >= 2 else 1


def step_forwards(plan: StepPlan, candidates: list[Candidate], ks: dict[str, int], max_rows: int,
                  riders: Seq[Rider] = ()) -> list[ForwardShape]:
    """The forwards of `plan` if every candidate drafted min(its member's k, its max_k) tokens: the draft forwards
    (a catch-up, then k - 1 one-token forwards; riders a token in each), then each member batch with verifies of
    k + 1 rows. A catch-up longer than a verify counts as max_rows + 1 rows: it is paid once, not per step."""
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
        drafts.setdefault(draft.member, []).append(DraftEntry(rows, last + 1 - rows, last, k_r))
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
    """The forwards of a planned step as its DraftSpecs set them: the shapes step_forwards prices."""
    drafts: dict[str, list[DraftEntry]] = {}
    riding: set[int] = set()
    for batch in plan.batches:
        for chunk in batch.chunks:
            spec = chunk.draft
            if spec is not None:
                rows = len(spec.token_ids)
                drafts.setdefault(spec.member, []).append(
                    DraftEntry(rows, spec.start_pos, spec.start_pos + rows - 1, spec.num_tokens))
            elif chunk.ride_tokens:
                riding.add(id(chunk))
                drafts.setdefault(batch.member, []).append(
                    DraftEntry(1, chunk.start_pos, chunk.start_pos, chunk.ride_tokens))
    return _draft_forwards(drafts) + _batch_forwards(
        plan, lambda chunk: chunk.draft.num_tokens if chunk.draft is not None else 0, riding)


def _draft_forwards(drafts: dict[str, list[DraftEntry]]) -> list[ForwardShape]:
    """Per draft member: the catch-up forward, then one forward per further drafted token."""
    forwards: list[ForwardShape] = []
    for member, entries in drafts.items():
        forwards.append(ForwardShape(MemberName(member), tuple(e.before for e in entries if e.rows == 1),
                                     tuple((e.rows, e.before) for e in entries if 1 < e.rows <= CATCH_UP_VERIFY_ROWS),
                                     tuple((e.rows, e.before) for e in entries if e.rows > CATCH_UP_VERIFY_ROWS),
                                     True))
        for j in range(1, max(e.k for e in entries)):
            contexts = tuple(e.last + j for e in entries if e.k > j)
            forwards.append(ForwardShape(MemberName(member), contexts, (), (), True))
    return forwards


def _batch_forwards(plan: StepPlan, drafts_of: Callable[[SeqChunk], int],
                    riding: set[int] | None = None) -> list[ForwardShape]:
    """Each member batch's forward, a chunk with k drafts as a verify of k + 1 rows, riding chunks left out."""
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
