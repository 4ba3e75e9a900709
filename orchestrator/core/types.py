"""The shared vocabulary of MFS: requests, sampling, pages, step plans and results (pure data: the core, the
engines and the server all speak these types)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple, NewType

RequestId = NewType("RequestId", str)
PageId = NewType("PageId", int)
MemberName = NewType("MemberName", str)


class PageKey(NamedTuple):
    """Identity of a page's contents: one layer's KV (or a residual block) for a prefix (docs/ARCHITECTURE.md,
    Page identity). A tuple: the page pool hashes and compares keys for every page it registers or looks up, and a
    tuple does that in C."""

    lineage: str
    block_hash: bytes


class Profile(enum.Enum):
    LATENCY = "latency"
    QUALITY = "quality"


class RequestState(enum.Enum):
    WAITING = "waiting"        # in the global queue, holds no pages
    RUNNING = "running"        # admitted: holds pages, prefilling or decoding
    PREEMPTED = "preempted"    # pages taken back (recompute) or swapped to host; waits to resume
    FINISHED = "finished"
    CANCELLED = "cancelled"


class FinishReason(enum.Enum):
    STOP = "stop"              # eos or a stop token / string
    LENGTH = "length"          # max_tokens or the member's context
    CANCELLED = "cancelled"    # client went away or server-side timeout
    ERROR = "error"


class Tier(enum.Enum):
    ARENA = "arena"
    HOST = "host"
    DISK = "disk"


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0          # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0                    # 0 = off
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    num_top_logprobs: int = 0         # top alternatives returned per token (OpenAI top_logprobs)
    # OpenAI / vLLM penalties: frequency and presence act on the generated tokens, repetition on the prompt's
    # and the generated ones; the neutral values (0, 0, 1, no bias) leave the logits untouched.
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()     # (token id, bias added to its logit), by id
    penalized_prompt_ids: tuple[int, ...] = ()        # the prompt's distinct ids, when repetition_penalty != 1

    @property
    def penalized(self) -> bool:
        """Whether the sampler must adjust this request's logits beyond temperature / top-k / top-p."""
        return (self.frequency_penalty != 0.0 or self.presence_penalty != 0.0 or self.repetition_penalty != 1.0
                or bool(self.logit_bias))


@dataclass(slots=True)
class Request:
    """What the edge hands the core: already validated and tokenized."""

    request_id: RequestId
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_s: float
    session_id: str | None = None
    pinned_member: MemberName | None = None   # `model` named a member: no routing, no escalation
    profile: Profile = Profile.LATENCY
    cache_salt: str | None = None
    priority: int = 0                         # lower runs first; FCFS within a priority
    complexity_hint: float | None = None      # eval may pass a known difficulty; None = estimate
    # False: only the first output and the final one are built; the tokens between are emitted on time (a rollback
    # can no longer drop them) but reach the caller with the final one (mfs simulate: one output object less a token).
    intermediate_outputs: bool = True


@dataclass(frozen=True, slots=True)
class RouteDecision:
    """One routing decision with every component, so it can be explained and logged."""

    request_id: RequestId
    member: MemberName
    reason: str
    scores: dict[str, float]                          # member -> total score
    components: dict[str, dict[str, float]]           # member -> {"complexity", "affinity", "load", ...}
    matched_prefix_tokens: dict[str, int]             # member -> tokens cached (any tier)
    complexity: float                                 # estimator output in [0, 1]
    downgraded_from: MemberName | None = None
    rerouted_from: MemberName | None = None         # placement moved it here: that member could not hold it


# ----------------------------------------------------------------------------- step plan (core -> engine)
@dataclass(slots=True)
class DraftSpec:
    """A smaller member of the family proposes `num_tokens` tokens for one decode chunk; the chunk's own member
    verifies them in the same step."""

    member: MemberName                 # the drafting member (shares the tokenizer; smaller)
    num_tokens: int                    # k >= 1
    token_ids: list[int]               # tokens whose KV the draft lacks, ending with the chunk's last token
                                       # (catch-up: usually 1 token; more after admission or a rejected draft)
    start_pos: int                     # position of token_ids[0]
    block_tables: list[list[PageId]]   # the draft member's pages for this request, one list per draft layer,
                                       # covering positions [0, start_pos + len(token_ids) + num_tokens - 1)


@dataclass(slots=True)
class SeqChunk:
    """One request's share of one member's forward pass in one step (docs/ARCHITECTURE.md, SeqChunk semantics).

    If residual_table_out is set, the hidden state after the member's last layer (before the final norm) for these
    tokens is written into those pages (one page per block), so a larger member can later start from it.
    """

    request_id: RequestId
    token_ids: list[int]
    start_pos: int
    block_tables: list[list[PageId]]             # one list per layer of the member
    sample: bool                                 # sample from the last position's logits
    sampling: SamplingParams
    start_layer: int = 0
    residual_table: list[PageId] | None = None   # input pages when start_layer > 0
    residual_table_out: list[PageId] | None = None
    num_generated: int = 0                       # tokens already generated (min_tokens, seeded sampling)
    # A decode chunk whose member verifies k drafted tokens: token_ids == [last], sample=True, and block_tables
    # cover positions [0, start_pos + 1 + k) (k + 1 verify rows). docs/ARCHITECTURE.md, Speculation.
    draft: DraftSpec | None = None
    # A decode chunk of the member drafting in this step that rides its draft forwards (a family of separate
    # weights, speculation.py): it decodes this many tokens, one per forward, and no forward of its member's batch
    # computes it; token_ids == [last], sample=True, block_tables cover positions [0, start_pos + ride_tokens).
    # 0: one token, as usual.
    ride_tokens: int = 0


@dataclass(slots=True)
class MemberBatch:
    member: MemberName
    chunks: list[SeqChunk]


@dataclass(slots=True)
class StepPlan:
    batches: list[MemberBatch] = field(default_factory=list)
    # Page copies the step needs before any forward: save evicted pages' contents to a tier
    # (their pages are about to be overwritten), load tier hits into freshly allocated pages.
    page_saves: list[tuple[PageId, PageKey]] = field(default_factory=list)
    page_loads: list[tuple[PageId, PageKey, Tier]] = field(default_factory=list)
    released_requests: list[RequestId] = field(default_factory=list)  # engine may drop per-request state


class ForwardShape(NamedTuple):
    """One member forward of a step as a step-cost estimate reads it (engine_api.StepCostEstimator): a draft
    member's forward (the drafts run before the step's member forwards) or a member batch."""

    member: MemberName
    decode_contexts: tuple[int, ...]              # per one-row chunk: the tokens before it
    verifies: tuple[tuple[int, int], ...]         # per few-row chunk at a context (a verify, a draft's catch-up):
                                                  # (rows, tokens before them); each reads its request's KV once
    prefills: tuple[tuple[int, int], ...]         # per prefill chunk: (new tokens, tokens before them)
    is_draft: bool = False


class SampledToken(NamedTuple):
    """What the engine returns for a chunk with sample=True. A tuple, as PageKey: one is made per generated
    token, and a tuple is built in C (a frozen dataclass's __init__ sets each field through Python).
    A chunk with a draft returns 1 to k + 1 of them, in order (the accepted drafts, then the target's token),
    each with its own logprob; the first carries num_drafted = k, the others 0."""

    request_id: RequestId
    token_id: int
    logprob: float
    top1_prob: float                                  # confidence signal for escalation
    top_logprobs: tuple[tuple[int, float], ...] = ()  # (token_id, logprob), best first
    num_drafted: int = 0                              # k on the first token of a verify chunk, else 0


# ----------------------------------------------------------------------------- results (core -> edge)
class MemberSpan(NamedTuple):
    """Which member produced which generated tokens (a tuple: a request's last span is rebuilt per token)."""

    member: MemberName
    num_tokens: int


@dataclass(slots=True)
class RequestOutput:
    """Incremental output: the new tokens of one request since its last output."""

    request_id: RequestId
    new_token_ids: list[int]
    new_logprobs: list[float]
    new_top_logprobs: list[tuple[tuple[int, float], ...]]
    member: MemberName
    finished: bool = False
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    spans: tuple[MemberSpan, ...] = ()
    route: RouteDecision | None = None
    error: str | None = None
    num_drafted_tokens: int = 0           # tokens drafted for this request so far (speculation)
    num_accepted_tokens: int = 0          # of those, the ones its members accepted
