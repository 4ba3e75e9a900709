"""SimExecutor: stands where the local engine stands (the StepExecutor protocol), computes nothing, and says how
long the step would have taken.

Durations: the cost model's fixed per-step overhead, plus the member batches (one after the other when the
members share a device, side by side when each has its own: the node then plans and executes each device's
members apart, on their own timelines, node.py), plus the tier copies made before the step: loads
(host -> arena) always on the step's path, saves (arena -> host) too unless the cost model says they run beside
the compute (saves_overlap: a GPU engine's copy stream), where only what outlasts the compute adds; plus, when
the cost model prices them and the node gave a clock, what a step costs extra right after the engine sat idle
or after a prefill (cost_model.HistoryTracker).
Tokens: a seeded stream, token = hash(request key, position), the same in every system; or, when a real run's
replies are given (the validation replays its own real runs), that run's reply token at that position, so a
closed-loop session's next prompt is the real one and the router reads the same text. Confidences: the
recorded library (confidence.py). A chunk with a draft (speculation) gets the same stream's tokens, as many as its
verify accepts: each draft is kept with its pair's per-token acceptance (acceptance.py), drawn from a hash of the
request key and the position (the same draws in every system), until the first rejection, then the target's
token; its cost is the draft member's forwards before the step plus the verify's rows in the target's batch
(cost_model.plan_shapes), and the executor prices a step the core asks about the same way (estimate_step_s). A
decode of the draft member riding its draft forwards (SeqChunk.ride_tokens) gets the stream's next ride_tokens
tokens, its rows priced in those forwards.
Page contents are not simulated: read_page returns one shared block of
page_bytes zeros, so the host tier's byte accounting is exact while holding no real memory per page.
"""
from __future__ import annotations

import hashlib
import math
import zlib
from collections.abc import Callable, Mapping, Sequence

from eval.simulate.acceptance import AcceptanceTable, acceptance_table
from eval.simulate.confidence import Confidences
from eval.simulate.cost_model import (BatchShape, CostModel, HistoryTracker, forward_batch_shapes, plan_shapes,
                                      prefill_tokens_of)
from eval.simulate.step_profile import StepProfile
from orchestrator.core.family import FamilySpec
from orchestrator.core.types import ForwardShape, MemberName, PageId, RequestId, SampledToken, SeqChunk, StepPlan

FIRST_TOKEN_ID = 3          # ids below are specials in the shipped tokenizer (pad, bos, eos)


class SimExecutor:
    def __init__(self, family: FamilySpec, num_pages: int, page_bytes: int, cost: CostModel,
                 confidences: Confidences, vocab_size: int, members_in_parallel: bool = False,
                 request_keys: dict[str, str] | None = None,
                 replies: Mapping[str, Sequence[int]] | None = None,
                 natural_lengths: Mapping[str, int] | None = None,
                 acceptance: AcceptanceTable | None = None, drafts_ride: bool = True) -> None:
        """drafts_ride: the draft member's own batch rides in its drafts' catch-up forward (cost_model.ride_catch_ups;
        never for members on devices of their own: the drafts run on the target's)."""
        self.family = family
        self.num_pages = num_pages
        self.page_bytes = page_bytes
        self.cost = cost
        self.confidences = confidences
        self.vocab_size = vocab_size
        self.members_in_parallel = members_in_parallel
        self.drafts_ride = drafts_ride and not members_in_parallel
        self.request_keys = request_keys if request_keys is not None else {}
        self.replies = replies or {}             # request key -> a real run's reply (token ids), replayed
        # request key -> tokens before its EOS (natural lengths: a reply ends where the dataset's did); a replayed
        # real reply ends where it ended
        self.natural_lengths = {k: n for k, n in (natural_lengths or {}).items() if k not in self.replies}
        self._eos = {m.name: (m.eos_token_ids[0] if m.eos_token_ids else None) for m in family.members}
        self.acceptance = acceptance or acceptance_table(family.name, family.member_names)
        self._zero_page = bytes(page_bytes)
        self._key_crc: dict[str, int] = {}      # request key -> CRC-32 of its bytes (the token stream's prefix)
        self._save_bytes = 0                    # arena -> host tier since the last step (read_page)
        self._load_bytes = 0                    # host tier -> arena (write_page)
        self.last_step_s = 0.0
        self.num_steps = 0
        self.busy_s = 0.0                       # summed over devices (device-seconds)
        self.profile = StepProfile()            # where the steps' time went (step_profile.py)
        # the history terms (after idle, after a prefill): priced only by a cost model that has them, and only
        # once a clock is attached
        self._history_s: Callable[[float, int, int, int], float] | None = getattr(cost, "history_s", None)
        self._clock: Callable[[], float] | None = None
        self._histories: dict[str | None, HistoryTracker] = {}     # device -> its steps' history
        self.device: str | None = None          # the device the next plan runs on (None: the node's one; node.py)

    def attach_clock(self, clock: Callable[[], float]) -> None:
        """The node's virtual clock: lets the executor see the idle gaps between its steps (history terms)."""
        self._clock = clock

    def key_of(self, request_id: str) -> str:
        return self.request_keys.get(request_id, request_id)

    def token_id(self, key: str, position: int) -> int:
        """FIRST_TOKEN_ID + crc32(f"{key}:{position}") mod the rest of the vocabulary. The CRC runs on: the key's
        part is computed once per request, then continued over ":position" (the same value as over the whole).
        A replayed real reply gives its own token where it has one."""
        reply = self.replies.get(key)
        if reply is not None and position < len(reply):
            return reply[position]
        seed = self._key_crc.get(key)
        if seed is None:
            seed = self._key_crc[key] = zlib.crc32(key.encode())
        return FIRST_TOKEN_ID + zlib.crc32(b":%d" % position, seed) % (self.vocab_size - FIRST_TOKEN_ID)

    def step_s(self, plan: StepPlan) -> float:
        """What the plan costs (also the tier copies made since the last step)."""
        return self._step_s(plan_shapes(plan, self.family, self.drafts_ride))

    @property
    def step_costs(self) -> SimExecutor:
        """What the core prices speculation's draft length with (EngineCore.attach_executor): this executor."""
        return self

    def estimate_step_s(self, forwards: Sequence[ForwardShape]) -> float:
        """What a step of these forwards would cost (engine_api.StepCostEstimator: speculation's draft length),
        its forwards priced as a plan's are (no tier copies, no history: the same for every draft length)."""
        return self.cost.step_overhead_s() + self._compute_s(
            forward_batch_shapes(list(forwards), self.family, self.drafts_ride))

    def estimate_error(self) -> float:
        """The estimate is the cost model's own price: exact."""
        return 0.0

    def _compute_s(self, shapes: list[BatchShape], costs: list[float] | None = None) -> float:
        if costs is None:
            costs = [self.cost.batch_s(shape) for shape in shapes]
        if not costs:
            return 0.0
        if not self.members_in_parallel:
            return sum(costs)
        # members on devices of their own step on timelines of their own (node.py): a verifying member's step waits
        # for its drafts, priced in its step (the draft member's own timeline is not charged for them)
        drafts = sum(cost for shape, cost in zip(shapes, costs) if shape.draft)
        return drafts + max((cost for shape, cost in zip(shapes, costs) if not shape.draft), default=0.0)

    def _step_s(self, shapes: list[BatchShape], costs: list[float] | None = None) -> float:
        compute = self._compute_s(shapes, costs)
        saves, loads = self.cost.copy_s(self._save_bytes), self.cost.copy_s(self._load_bytes)
        body = max(compute, saves) if self.cost.saves_overlap else compute + saves
        return self.cost.step_overhead_s() + body + loads

    def execute(self, plan: StepPlan) -> list[SampledToken]:
        """Runs the plan on `device` (the node sets it before each step; None: the node's one device): the history
        terms read that device's own steps and idle gaps. The tier copies counted are those made since the last execute, i.e. this plan's
        (the node copies right before it executes)."""
        self.release(plan.released_requests)
        shapes = plan_shapes(plan, self.family, self.drafts_ride)
        costs = [self.cost.batch_s(shape) for shape in shapes]
        self.last_step_s = self._step_s(shapes, costs)
        if self._history_s is not None and self._clock is not None:
            now = self._clock()
            device = self.device
            history = self._histories.get(device)
            if history is None:
                history = self._histories[device] = HistoryTracker()
            idle_s, since_wake, since_prefill, tokens = history.start(now, prefill_tokens_of(shapes))
            self.last_step_s += self._history_s(idle_s, since_wake, since_prefill, tokens)
            history.end(now + self.last_step_s)
        self._save_bytes = self._load_bytes = 0
        self.num_steps += 1
        self.busy_s += self.last_step_s
        out: list[SampledToken] = []
        keys, value, token_id, natural = self.request_keys, self.confidences.value, self.token_id, self.natural_lengths
        requests = context_tokens = verify_rows = prompt_ends = 0
        for batch in plan.batches:
            member = batch.member
            for chunk in batch.chunks:
                if not chunk.sample:
                    continue
                request_id = chunk.request_id
                key = keys.get(request_id, request_id)
                position = chunk.num_generated
                decoding = chunk.draft is not None or chunk.ride_tokens > 0 or len(chunk.token_ids) == 1
                if decoding:
                    requests += 1
                    context_tokens += chunk.start_pos
                else:
                    prompt_ends += 1            # a prompt's last chunk: one token, its first
                if chunk.draft is not None:
                    verify_rows += chunk.draft.num_tokens + 1
                    out.extend(self._verify(member, chunk, key, position))
                    continue
                if chunk.ride_tokens:
                    out.extend(self._stream(member, chunk, key, position, chunk.ride_tokens))
                    continue
                p = value(key, member, position)
                token = token_id(key, position)
                if natural and natural.get(key) == position:
                    eos = self._eos[member]
                    token = eos if eos is not None else token
                out.append(SampledToken(request_id=request_id, token_id=token, logprob=_log(p), top1_prob=p))
        self._profile_step(plan, shapes, costs, requests, len(out) - prompt_ends, context_tokens, verify_rows)
        return out

    def _profile_step(self, plan: StepPlan, shapes: list[BatchShape], costs: list[float], requests: int,
                      decode_tokens: int, context_tokens: int, verify_rows: int) -> None:
        """The step in self.profile: its kind (the members of its batches), its forwards' and drafts' time, what
        its prefill chunks cost inside those forwards (each batch with some priced again without them), and what
        its decoding requests got."""
        forward_s = draft_s = prompt_s = 0.0
        prompt_tokens = 0
        for shape, cost in zip(shapes, costs):
            if shape.draft:
                draft_s += cost
                continue
            forward_s += cost
            if shape.prefills:
                prompt_tokens += sum(n for n, _ in shape.prefills)
                rest = BatchShape(shape.member, shape.decode_contexts, (), shape.layer_fraction, shape.own_forward,
                                  shape.verifies, False)
                prompt_s += cost - (self.cost.batch_s(rest) if rest.num_tokens else 0.0)
        kind = "+".join(batch.member for batch in plan.batches if batch.chunks)
        self.profile.add(kind, self.last_step_s, forward_s, prompt_s, draft_s, requests, decode_tokens,
                         context_tokens, verify_rows, prompt_tokens)

    def _verify(self, member: MemberName, chunk: SeqChunk, key: str, position: int) -> list[SampledToken]:
        """A verify's tokens: the stream's tokens from `position`, one per accepted draft plus the target's own
        (EOS ends them where the reply ends); the first says how many were drafted."""
        draft = chunk.draft
        assert draft is not None
        k = draft.num_tokens
        acceptance = self.acceptance.of(f"{draft.member}->{member}").for_temperature(chunk.sampling.temperature)
        accepted = 0
        while accepted < k and acceptance_draw(key, position + accepted) < acceptance:
            accepted += 1
        return self._stream(member, chunk, key, position, accepted + 1, drafted=k)

    def _stream(self, member: MemberName, chunk: SeqChunk, key: str, position: int, count: int,
                drafted: int = 0) -> list[SampledToken]:
        """`count` of the stream's tokens from `position` (a verify's, or a rider's: one per draft forward), ending
        at the reply's EOS; the first says how many were drafted."""
        eos, natural = self._eos[member], self.natural_lengths
        stops = not chunk.sampling.ignore_eos
        tokens = []
        for i in range(count):
            at = position + i
            p = self.confidences.value(key, member, at)
            token = self.token_id(key, at)
            if natural and natural.get(key) == at and eos is not None:
                token = eos
            tokens.append(SampledToken(request_id=chunk.request_id, token_id=token, logprob=_log(p), top1_prob=p,
                                       num_drafted=drafted if i == 0 else 0))
            if stops and token == eos:
                break
        return tokens

    def read_page(self, page: PageId) -> bytes:
        self._save_bytes += self.page_bytes
        return self._zero_page

    def write_page(self, page: PageId, data: bytes) -> None:
        self._load_bytes += len(data)

    def release(self, request_ids: Sequence[RequestId]) -> None:
        for request_id in request_ids:
            key = self.request_keys.pop(request_id, None)
            self._key_crc.pop(key if key is not None else request_id, None)


def acceptance_draw(key: str, position: int) -> float:
    """A uniform draw in [0, 1) for the draft at generated position `position` of request `key`: the same in every
    system and every run (a hash, like the token stream)."""
    digest = hashlib.blake2b(b"%s|accept|%d" % (key.encode(), position), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2.0 ** 64


def _log(p: float) -> float:
    return math.log(p) if p > 0 else -1e9
