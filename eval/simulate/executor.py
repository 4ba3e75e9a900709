"""SimExecutor: stands where the local engine stands (the StepExecutor protocol), computes nothing, and says how
long the step would have taken.

Durations: the cost model's fixed per-step overhead, plus the member batches (one after the other when the
members share a device, side by side when each has its own), plus the tier copies made before the step: loads
(host -> arena) always on the step's path, saves (arena -> host) too unless the cost model says they run beside
the compute (saves_overlap: a GPU engine's copy stream), where only what outlasts the compute adds; plus, when
the cost model prices them and the node gave a clock, what a step costs extra right after the engine sat idle
or after a prefill (cost_model.HistoryTracker).
Tokens: a seeded stream, token = hash(request key, position), the same in every system; or, when a real run's
replies are given (the validation replays its own real runs), that run's reply token at that position, so a
closed-loop session's next prompt is the real one and the router reads the same text. Confidences: the
recorded library (confidence.py). Page contents are not simulated: read_page returns one shared block of
page_bytes zeros, so the host tier's byte accounting is exact while holding no real memory per page.
"""
from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Mapping, Sequence

from eval.simulate.confidence import Confidences
from eval.simulate.cost_model import BatchShape, CostModel, HistoryTracker, plan_shapes, prefill_tokens_of
from orchestrator.core.family import FamilySpec
from orchestrator.core.types import PageId, RequestId, SampledToken, StepPlan, tuple_new

FIRST_TOKEN_ID = 3          # ids below are specials in the shipped tokenizer (pad, bos, eos)


class SimExecutor:
    def __init__(self, family: FamilySpec, num_pages: int, page_bytes: int, cost: CostModel,
                 confidences: Confidences, vocab_size: int, members_in_parallel: bool = False,
                 request_keys: dict[str, str] | None = None,
                 replies: Mapping[str, Sequence[int]] | None = None,
                 natural_lengths: Mapping[str, int] | None = None) -> None:
        self.family = family
        self.num_pages = num_pages
        self.page_bytes = page_bytes
        self.cost = cost
        self.confidences = confidences
        self.vocab_size = vocab_size
        self.members_in_parallel = members_in_parallel
        self.request_keys = request_keys if request_keys is not None else {}
        self.replies = replies or {}             # request key -> a real run's reply (token ids), replayed
        # request key -> tokens before its EOS (natural lengths: a reply ends where the dataset's did); a replayed
        # real reply ends where it ended
        self.natural_lengths = {k: n for k, n in (natural_lengths or {}).items() if k not in self.replies}
        self._eos = {m.name: (m.eos_token_ids[0] if m.eos_token_ids else None) for m in family.members}
        self._zero_page = bytes(page_bytes)
        self._key_crc: dict[str, int] = {}      # request key -> CRC-32 of its bytes (the token stream's prefix)
        self._save_bytes = 0                    # arena -> host tier since the last step (read_page)
        self._load_bytes = 0                    # host tier -> arena (write_page)
        self.last_step_s = 0.0
        self.num_steps = 0
        self.busy_s = 0.0
        # the history terms (after idle, after a prefill): priced only by a cost model that has them, and only
        # once a clock is attached
        self._history_s: Callable[[float, int, int, int], float] | None = getattr(cost, "history_s", None)
        self._clock: Callable[[], float] | None = None
        self._history = HistoryTracker()

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
        return self._step_s(plan_shapes(plan, self.family))

    def _step_s(self, shapes: list[BatchShape]) -> float:
        costs = [self.cost.batch_s(shape) for shape in shapes]
        compute = (max(costs) if self.members_in_parallel else sum(costs)) if costs else 0.0
        saves, loads = self.cost.copy_s(self._save_bytes), self.cost.copy_s(self._load_bytes)
        body = max(compute, saves) if self.cost.saves_overlap else compute + saves
        return self.cost.step_overhead_s() + body + loads

    def execute(self, plan: StepPlan) -> list[SampledToken]:
        self.release(plan.released_requests)
        shapes = plan_shapes(plan, self.family)
        self.last_step_s = self._step_s(shapes)
        if self._history_s is not None and self._clock is not None:
            now = self._clock()
            idle_s, since_wake, since_prefill, tokens = self._history.start(now, prefill_tokens_of(shapes))
            self.last_step_s += self._history_s(idle_s, since_wake, since_prefill, tokens)
            self._history.end(now + self.last_step_s)
        self._save_bytes = self._load_bytes = 0
        self.num_steps += 1
        self.busy_s += self.last_step_s
        out = []
        keys, value, token_id, natural = self.request_keys, self.confidences.value, self.token_id, self.natural_lengths
        for batch in plan.batches:
            member = batch.member
            for chunk in batch.chunks:
                if not chunk.sample:
                    continue
                request_id = chunk.request_id
                key = keys.get(request_id, request_id)
                position = chunk.num_generated
                p = value(key, member, position)
                token = token_id(key, position)
                if natural and natural.get(key) == position:
                    token = self._eos[member] if self._eos[member] is not None else token
                out.append(tuple_new(SampledToken, (request_id, token, _log(p), p, (), 0)))
        return out

    def read_page(self, page: PageId) -> bytes:
        self._save_bytes += self.page_bytes
        return self._zero_page

    def write_page(self, page: PageId, data: bytes) -> None:
        self._load_bytes += len(data)

    def release(self, request_ids: Sequence[RequestId]) -> None:
        for request_id in request_ids:
            key = self.request_keys.pop(request_id, None)
            self._key_crc.pop(key if key is not None else request_id, None)


def _log(p: float) -> float:
    return math.log(p) if p > 0 else -1e9
