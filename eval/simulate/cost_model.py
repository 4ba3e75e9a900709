"""The cost-model interface: what a step's shape costs in seconds. Everything the simulator knows about speed
comes through here, so a fake cost model gives exactly predictable timelines (tests) and a step table gives
measured ones (the local engine on this machine, or aiconfigurator's TensorRT-LLM database for a GPU).

A step runs one batch per member (the core's StepPlan); how member batches combine is the placement's business
(members on one device run one after the other; members on their own devices run side by side).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

from eval.simulate.step_table import StepTable, StepTableError
from orchestrator.core.family import FamilySpec
from orchestrator.core.draft_length import plan_forwards
from orchestrator.core.types import ForwardShape, MemberBatch, StepPlan

@dataclass(frozen=True, slots=True)
class BatchShape:
    """One member's share of a step, as a cost model sees it."""

    member: str
    decode_contexts: tuple[int, ...]                 # per decoding request: tokens attended (its position)
    prefills: tuple[tuple[int, int], ...]            # per prefill chunk: (new tokens, tokens before it)
    layer_fraction: float = 1.0                      # share of the member's layers computed (nested handover)
    own_forward: bool = True                         # False: rows join a larger nested member's forward (merged)
    # speculation: per few-row chunk at a context (a verify's k + 1 rows, a draft's catch-up): (rows, tokens
    # before them); each reads its request's KV once, as a decode does
    verifies: tuple[tuple[int, int], ...] = ()
    draft: bool = False                              # a draft forward: runs before the step's member batches

    @property
    def num_tokens(self) -> int:
        return len(self.decode_contexts) + sum(n for n, _ in self.prefills) + sum(r for r, _ in self.verifies)


def plan_shapes(plan: StepPlan, family: FamilySpec, drafts_ride: bool = True) -> list[BatchShape]:
    """Shapes of a plan's forwards, as the core describes them (speculation.plan_forwards: its draft forwards
    first, then its member batches) and the local engine runs them (engines/local/executor.py): a batch whose member
    nests in a larger member of the same plan (its layers are that member's lower layers) rides in that member's
    forward, only the outermost batch of such a group paying a forward of its own; a batch that starts above layer
    0 (a nested handover) computes its share of the layers; with drafts_ride, ride_catch_ups."""
    fractions: dict[str, float] = {b.member: layer_fraction(b, family.member(b.member).num_layers)
                                   for b in plan.batches if b.chunks}
    return forward_batch_shapes(plan_forwards(plan), family, drafts_ride, fractions)


_NESTS: dict[tuple[int, str, str], tuple[FamilySpec, bool]] = {}   # asked every simulated step: answered once


def rides_in(family: FamilySpec, member: str, other: str) -> bool:
    """Whether member's layers are the lower layers of the larger member `other` (it rides in other's forward)."""
    entry = _NESTS.get((id(family), member, other))
    if entry is None or entry[0] is not family:
        spec = family.member(member)
        nests = family.member(other).index > spec.index and family.shared_depth(member, other) == spec.num_layers
        entry = _NESTS[(id(family), member, other)] = (family, nests)
    return entry[1]


def layer_fraction(batch: MemberBatch, num_layers: int) -> float:
    """The share of the member's layers the batch's rows compute (a chunk from start_layer computes the rest)."""
    layers_computed = total = 0
    for chunk in batch.chunks:
        n = 1 + chunk.draft.num_tokens if chunk.draft is not None else len(chunk.token_ids)
        layers_computed += (num_layers - chunk.start_layer) * n
        total += n
    return layers_computed / (num_layers * total) if total else 1.0


def forward_batch_shapes(forwards: list[ForwardShape], family: FamilySpec, drafts_ride: bool = True,
                         fractions: dict[str, float] | None = None) -> list[BatchShape]:
    """The core's ForwardShapes (a planned step's, or one the draft-length policy asks the price of) as cost-model
    shapes: a member batch that nests in a larger member of the same step rides in its forward; fractions: the
    share of its layers each member's batch computes (1 where not given)."""
    present = [f.member for f in forwards if not f.is_draft]
    fractions = fractions or {}
    shapes = [BatchShape(f.member, f.decode_contexts, f.prefills,
                         1.0 if f.is_draft else fractions.get(f.member, 1.0),
                         f.is_draft or not any(rides_in(family, f.member, other) for other in present),
                         f.verifies, f.is_draft) for f in forwards]
    return ride_catch_ups(shapes) if drafts_ride else shapes


def ride_catch_ups(shapes: list[BatchShape]) -> list[BatchShape]:
    """As the local engine runs them (engines/local/executor.py): a draft member's own batch in the step, where it
    pays a forward of its own (it rides in no nested host), runs in its drafts' catch-up forward, the first one,
    instead of in a forward of its own after the verifies: one read of that member's weights, not two. Only one
    device running the whole family can do this; a separate deployment's draft copy is not its small member."""
    own = {s.member: i for i, s in enumerate(shapes) if not s.draft and s.own_forward and not s.verifies}
    out: list[BatchShape] = []
    merged: set[int] = set()
    caught_up: set[str] = set()
    for shape in shapes:
        j = own.get(shape.member)
        if shape.draft and shape.member not in caught_up and j is not None:
            rider = shapes[j]
            merged.add(j)
            rows, rider_rows = shape.num_tokens, rider.num_tokens
            fraction = (rows + rider.layer_fraction * rider_rows) / max(1, rows + rider_rows)
            shape = BatchShape(shape.member, shape.decode_contexts + rider.decode_contexts,
                               shape.prefills + rider.prefills, fraction, True, shape.verifies + rider.verifies, True)
        if shape.draft:
            caught_up.add(shape.member)
        out.append(shape)
    return [shape for i, shape in enumerate(out) if i not in merged]


class CostModel(Protocol):
    """Seconds for a member batch, the serving loop's fixed cost per step, and tier copies.

    saves_overlap: whether copies of evicted pages to the host tier run beside the step's compute (a GPU engine's
    own copy stream, as TensorRT-LLM's KV cache transfer manager offloads) instead of before it (the local engine
    copies in its step loop).
    A model may also price what a step costs beyond its shape by the engine's recent history
    (history_s(*StepHistory) -> extra seconds; LinearCostModel fits it); the simulated executor asks when the
    model has it. And the serving edge's latency outside the steps (request_path_s() -> (in, out): from the
    client's call to the scheduler, and from a step's outputs to the client); the simulation's driver asks."""

    name: str
    saves_overlap: bool

    def batch_s(self, shape: BatchShape) -> float: ...

    def step_overhead_s(self) -> float: ...

    def copy_s(self, num_bytes: int) -> float: ...

    def describe(self) -> dict[str, Any]: ...


# A gap longer than this between the end of one step and the start of the next ends a busy period: the local
# engine's back-to-back steps are 0.1-0.2 ms apart (schedule and update), a wait for work at least 10 ms.
IDLE_GAP_S = 1e-3
HISTORY_MAX_STEPS = 30             # past this many steps a history term is 0 (decay^30 is nothing)

# (idle seconds before the busy period (inf: none before it), steps of the busy period before this one,
#  steps since the last step that held a prefill (0: none in this busy period), that step's prefill tokens)
StepHistory = tuple[float, int, int, int]


class HistoryTracker:
    """Where each step of one engine stands in its recent history: what the after-idle and after-prefill terms
    read. The same bookkeeping for a real run's timeline (step_histories) and the simulated executor."""

    __slots__ = ("busy_until", "idle_s", "since_wake", "since_prefill", "prefill_tokens", "previous_prefill")

    def __init__(self) -> None:
        self.busy_until = -1.0             # when the last step ended (< 0: no step yet)
        self.idle_s = math.inf
        self.since_wake = 0
        self.since_prefill = 0
        self.prefill_tokens = 0
        self.previous_prefill = 0          # prefill tokens of the step before this one

    def start(self, now: float, prefill_tokens: int) -> StepHistory:
        """A step starts at `now` holding `prefill_tokens` prefill tokens: its history."""
        if self.busy_until < 0 or now - self.busy_until > IDLE_GAP_S:
            self.idle_s = math.inf if self.busy_until < 0 else now - self.busy_until
            self.since_wake = self.since_prefill = self.prefill_tokens = 0
        else:
            self.since_wake += 1
            if self.previous_prefill:
                self.since_prefill, self.prefill_tokens = 1, self.previous_prefill
            elif self.since_prefill:
                self.since_prefill += 1
        self.previous_prefill = prefill_tokens
        return (self.idle_s, self.since_wake, self.since_prefill, self.prefill_tokens)

    def end(self, end_s: float) -> None:
        self.busy_until = end_s


def prefill_tokens_of(shapes: list[BatchShape]) -> int:
    return sum(n for shape in shapes for n, _ in shape.prefills)


def step_histories(starts_s: list[float], observations: list[tuple[list[BatchShape], float]]) -> list[StepHistory]:
    """The history of every step of one engine's real timeline (a replay starts after warm-up and probes: its
    first step counts as after a long idle)."""
    tracker, out = HistoryTracker(), []
    for start, (shapes, seconds) in zip(starts_s, observations):
        out.append(tracker.start(start, prefill_tokens_of(shapes)))
        tracker.end(start + seconds)
    return out


def after_idle_term(idle_s: float, since_wake: int, decay: float, tau_s: float) -> float:
    """The after-idle cost's shape, per unit of its size: saturating in the idle time, decaying with the steps
    since the engine woke up."""
    if since_wake > HISTORY_MAX_STEPS:
        return 0.0
    return (1.0 - math.exp(-idle_s / tau_s)) * decay ** since_wake


def after_prefill_term(since_prefill: int, prefill_tokens: int, decay: float) -> float:
    """The after-prefill cost's shape, per unit of its size (seconds per prefill token): the prefill's tokens,
    decaying with the steps since it."""
    if not since_prefill or since_prefill > HISTORY_MAX_STEPS:
        return 0.0
    return prefill_tokens * decay ** (since_prefill - 1)


# how a step table prices a step holding both decodes and a prefill chunk (TableCostModel)
MIXED_STEPS = ("overlap", "grid")


class TableCostModel:
    """Costs read from an `mfs-step-table/1` (see step_table.py).

    A batch's decodes cost D = decode_ms(batch size, mean context); its prefill chunks cost
    P = prefill_ms(total new tokens, mean tokens before them); both in one step cost
    max(P, D) + mix_overlap * min(P, D) (mixed_steps "overlap", one factor per member fitted on a few mixed steps);
    with mixed_steps "grid", D + mixed_extra_ms(new tokens, requests) + P - prefill_ms(new tokens, 0): what
    aiconfigurator's own mixed step says the chunk adds beside that batch, plus what its cached prefix adds (the
    one factor charges a short chunk in a large decode batch several times what the mixed step itself does).
    Chunks resuming at a layer > 0 (nested handover) scale by the share of layers computed. A batch riding in a larger nested member's forward (own_forward False) costs
    ride_overlap times that: its rows go through layers the host runs anyway, as the local engine merges them.
    Verifies (speculation) join the decodes: a verify of r rows reads its request's KV once, as a decode does,
    and its r - 1 extra rows cost what they add to a forward's matrix work: D = decode_ms(decodes + verifies,
    their mean context) + prefill_ms(all rows, 0) - prefill_ms(decodes + verifies, 0). (The table's prefill entries
    are one sequence: n verifies priced as one chunk of their rows would read one request's KV, not n.)
    """

    def __init__(self, table: StepTable, name: str = "table", saves_overlap: bool = False,
                 mixed_steps: str = "overlap") -> None:
        if mixed_steps not in MIXED_STEPS:
            raise ValueError(f"mixed_steps {mixed_steps!r}: one of {', '.join(MIXED_STEPS)}")
        if mixed_steps == "grid":
            missing = [n for n, m in table.members.items() if m.mixed_extra_ms is None]
            if missing:
                raise StepTableError(f"--mixed-steps grid: the step table ({table.source}) has no mixed-step grid "
                                     f"for {', '.join(missing)} (a table built before it was recorded: build it "
                                     "again with aiconfigurator)")
        self.table = table
        self.name = name
        self.saves_overlap = saves_overlap
        self.mixed_steps = mixed_steps

    def batch_s(self, shape: BatchShape) -> float:
        costs = self.table.member(shape.member)
        decode_ms = prefill_ms = 0.0
        if shape.verifies:
            decode_ms = _rows_ms(costs, shape.decode_contexts, shape.verifies)
        elif shape.decode_contexts:
            n = len(shape.decode_contexts)
            decode_ms = costs.decode_ms(n, sum(shape.decode_contexts) / n)
        if shape.prefills:
            tokens = sum(n for n, _ in shape.prefills)
            prefix = sum(p for _, p in shape.prefills) / len(shape.prefills)
            prefill_ms = costs.prefill_ms(tokens, prefix)
        grid = costs.mixed_extra_ms if self.mixed_steps == "grid" else None
        if grid is not None and decode_ms > 0 and prefill_ms > 0:
            # the chunk's cost beside this many decoding requests, plus what its cached prefix adds to it
            requests = len(shape.decode_contexts) + len(shape.verifies)
            total_ms = decode_ms + grid(tokens, requests) + max(0.0, prefill_ms - costs.prefill_ms(tokens, 0))
        else:
            total_ms = max(decode_ms, prefill_ms) + costs.mix_overlap * min(decode_ms, prefill_ms)
        if not shape.own_forward:
            total_ms *= costs.ride_overlap
        return total_ms * shape.layer_fraction / 1e3

    def step_overhead_s(self) -> float:
        return self.table.step_overhead_ms / 1e3

    def copy_s(self, num_bytes: int) -> float:
        return num_bytes / (self.table.copy_gb_s * 1e9)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "source": self.table.source, "gpu": self.table.gpu, "backend": self.table.backend,
                "step_overhead_ms": self.table.step_overhead_ms, "copy_gb_s": self.table.copy_gb_s,
                "saves_overlap": self.saves_overlap, "mixed_steps": self.mixed_steps,
                "members": {n: {"model": m.model, "tp": m.tp} for n, m in self.table.members.items()},
                "notes": list(self.table.notes)}


def _rows_ms(costs, decode_contexts: tuple[int, ...], verifies: tuple[tuple[int, int], ...]) -> float:
    """A batch's decodes and verifies (TableCostModel): every request's KV read once at its context, plus the
    matrix work of the verifies' extra rows."""
    requests = len(decode_contexts) + len(verifies)
    context = (sum(decode_contexts) + sum(c for _, c in verifies)) / requests
    rows = len(decode_contexts) + sum(r for r, _ in verifies)
    extra = costs.prefill_ms(rows, 0) - costs.prefill_ms(requests, 0)
    return costs.decode_ms(requests, context) + max(0.0, extra)


class TableWithServingTerms(TableCostModel):
    """A step table (the engine timed alone, on a grid of batch sizes) with what only real serving shows taken from
    a model fitted to real runs: the history terms (after idle, after a prefill), the serving edge and, when given,
    prefill_extra_s: what a member batch holding a prefill chunk costs in serving beyond its table price (the
    engine timed alone prices decode steps within 1% but prefill steps 0.15-1.4 ms low, about the same for 16 and
    200 tokens; docs/SIMULATOR.md, Validation). The validation's table_calibrated and table_held_out_serving
    variants; a plain TableCostModel has none of these, so the executor skips them."""

    def __init__(self, table: StepTable, serving: "LinearCostModel", name: str = "table+serving",
                 prefill_extra_s: float = 0.0) -> None:
        super().__init__(table, name)
        self.serving = serving
        self.prefill_extra_s = prefill_extra_s

    def batch_s(self, shape: BatchShape) -> float:
        seconds = super().batch_s(shape)
        return seconds + self.prefill_extra_s if shape.prefills else seconds

    def history_s(self, idle_s: float, since_wake: int, since_prefill: int, prefill_tokens: int) -> float:
        return self.serving.history_s(idle_s, since_wake, since_prefill, prefill_tokens)

    def request_path_s(self) -> tuple[float, float]:
        return self.serving.request_path_s()

    def describe(self) -> dict[str, Any]:
        serving = self.serving.describe()
        return {**super().describe(), "serving_terms_from": serving["source"], "after_idle": serving["after_idle"],
                "after_prefill": serving["after_prefill"], "request_path_ms": serving["request_path_ms"],
                "prefill_extra_ms": self.prefill_extra_s * 1e3}


# ----------------------------------------------------------------------------- fitted linear model
FIT_FORMAT = "mfs-step-fit/1"
FEATURES = ("forward", "decodes", "decode_context_k", "prefill_tokens", "prefill_attention_m", "prefill_chunks")


def features(shape: BatchShape) -> tuple[float, ...]:
    """Per member batch: 1 when it runs its own forward (0 when merged into a larger member's), decode rows, their
    summed context (thousands of tokens), prefill tokens, prefill attention work (new tokens x tokens attended,
    millions), prefill chunks (each pays the prefill path's fixed cost: its causal mask, its page writes; a fit
    saved with five coefficients prices it 0). A verify's rows (speculation) go through the local engine's
    multi-token path: they count as a prefill chunk of that many tokens at its context."""
    chunks = shape.prefills + shape.verifies if shape.verifies else shape.prefills
    return (1.0 if shape.own_forward else 0.0, float(len(shape.decode_contexts)), sum(shape.decode_contexts) / 1e3,
            float(sum(n for n, _ in chunks)), sum(n * (p + n / 2) for n, p in chunks) / 1e6,
            float(len(chunks)))


class LinearCostModel:
    """batch_s = layer_fraction * sum_k coef[member][k] * features_k (seconds), fitted by least squares on step
    durations observed in a real run (eval.validate.bench_vs_sim); overhead = the run's mean gap between steps.

    Two history terms, when fitted (eval.validate.bench_vs_sim fits them from the real steps' start times):
    after_idle = (extra_s, decay, tau_s): the k-th step (from 0) after the engine sat idle for `idle` seconds
    costs extra_s * (1 - exp(-idle / tau_s)) * decay^k more; after_prefill = (s_per_token, decay): the k-th step
    (from 1) after a step that held P prefill tokens costs s_per_token * P * decay^(k-1) more. On the CPU (one
    request at a time on an otherwise quiet engine) a step right after 50-500 ms of idling ran 2-2.5 ms
    slower than after 0.5 ms, and the next one 0.7-0.9 ms; with one request decoding at 1.8-1.9 ms a step, the
    steps after a 40 / 200 / 400-token prefill beside it took 2.52 / 3.88 / 4.79 ms (the new request's first
    decode among them), then 2.07 / 2.67 / 3.03 ms (neither malloc's trimming nor AVX-512 clocks: caches, most
    likely). docs/SIMULATOR.md, Validation.

    path_s = (in, out): the serving edge's latency outside the steps, measured on the real runs: from the client's
    call to the request entering the scheduler, and from the engine handing a step's output over to the client
    receiving it (the bench's in-process client: ~0.03 and ~0.2 ms on the CPU)."""

    def __init__(self, coefficients: dict[str, tuple[float, ...]], overhead_s: float, source: str,
                 copy_gb_s: float = 5.0, name: str = "measured",
                 after_idle: tuple[float, float, float] | None = None,
                 after_prefill: tuple[float, float] | None = None,
                 path_s: tuple[float, float] = (0.0, 0.0)) -> None:
        self.coefficients = {m: tuple(c) for m, c in coefficients.items()}
        self.overhead_s = overhead_s
        self.source = source
        self.copy_gb_s = copy_gb_s
        self.name = name
        self.after_idle = tuple(after_idle) if after_idle else None
        self.after_prefill = tuple(after_prefill) if after_prefill else None
        self.path_s = (float(path_s[0]), float(path_s[1]))
        self.saves_overlap = False          # the local engine copies tier pages in its step loop

    def request_path_s(self) -> tuple[float, float]:
        return self.path_s

    def history_s(self, idle_s: float, since_wake: int, since_prefill: int, prefill_tokens: int) -> float:
        """Extra seconds of a step by its history (0 without the terms)."""
        extra = 0.0
        if self.after_idle is not None:
            size, decay, tau = self.after_idle
            extra += size * after_idle_term(idle_s, since_wake, decay, tau)
        if self.after_prefill is not None:
            per_token, decay = self.after_prefill
            extra += per_token * after_prefill_term(since_prefill, prefill_tokens, decay)
        return extra

    def batch_s(self, shape: BatchShape) -> float:
        coef = self.coefficients[shape.member]
        return max(0.0, sum(c * f for c, f in zip(coef, features(shape)))) * shape.layer_fraction

    def step_overhead_s(self) -> float:
        return self.overhead_s

    def copy_s(self, num_bytes: int) -> float:
        return num_bytes / (self.copy_gb_s * 1e9)

    def describe(self) -> dict[str, Any]:
        idle = prefill = None
        if self.after_idle is not None:
            extra, decay, tau = self.after_idle
            idle = {"extra_ms": extra * 1e3, "decay": decay, "tau_ms": tau * 1e3}
        if self.after_prefill is not None:
            per_token, decay = self.after_prefill
            prefill = {"us_per_prefill_token": per_token * 1e6, "decay": decay}
        return {"name": self.name, "source": self.source, "gpu": None, "backend": "local",
                "step_overhead_ms": self.overhead_s * 1e3, "features": list(FEATURES),
                "coefficients_s": {m: list(c) for m, c in self.coefficients.items()}, "after_idle": idle,
                "after_prefill": prefill, "request_path_ms": {"in": self.path_s[0] * 1e3, "out": self.path_s[1] * 1e3}}

    def to_dict(self) -> dict[str, Any]:
        return {"format": FIT_FORMAT, **self.describe(), "copy_gb_s": self.copy_gb_s}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "LinearCostModel":
        idle, prefill = data.get("after_idle"), data.get("after_prefill")
        path = data.get("request_path_ms") or {}
        return cls({m: tuple(c) for m, c in data["coefficients_s"].items()}, data["step_overhead_ms"] / 1e3,
                   data["source"], data.get("copy_gb_s", 5.0),
                   after_idle=(idle["extra_ms"] / 1e3, idle["decay"], idle["tau_ms"] / 1e3) if idle else None,
                   after_prefill=(prefill["us_per_prefill_token"] / 1e6, prefill["decay"]) if prefill else None,
                   path_s=(path.get("in", 0.0) / 1e3, path.get("out", 0.0) / 1e3))


# The history terms' shapes are searched on these grids (their sizes are fitted with the coefficients at each point)
AFTER_IDLE_DECAYS = (0.2, 0.35, 0.5, 0.65, 0.8)
AFTER_IDLE_TAUS_S = (0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2)
AFTER_PREFILL_DECAYS = (0.3, 0.45, 0.6, 0.75)

HistoryTerms = tuple[tuple[float, float, float] | None, tuple[float, float] | None]


def fit_steps(observations: list[tuple[list[BatchShape], float]], members: list[str],
              histories: list[StepHistory] | None = None) -> tuple[dict[str, tuple[float, ...]], HistoryTerms]:
    """Least squares of step seconds on per-member features (a step's time = the sum of its member batches),
    coefficients forced non-negative by dropping negative ones and refitting (a cost cannot be negative); with
    `histories` (step_histories of every observation, aligned) the history terms too:
    their shapes chosen on the grids by the least squared error, their sizes fitted with the rest. The pair is
    (after_idle, after_prefill); a term is left out (None) when its size is not positive, and both unless they
    cut the squared error by at least 1% and by at least a microsecond squared per step."""
    import numpy as np

    width = len(FEATURES)
    order = sorted((m, k) for m in members for k in range(width))
    index = {c: i for i, c in enumerate(order)}
    base = np.zeros((len(observations), len(order)))
    y = np.array([seconds for _, seconds in observations])
    for row, (shapes, _) in enumerate(observations):
        for shape in shapes:
            for k, value in enumerate(features(shape)):
                base[row, index[(shape.member, k)]] += value * shape.layer_fraction

    def solve(extra: list[Any]) -> tuple[dict[str, tuple[float, ...]], list[float], float]:
        x = np.column_stack([base, *extra]) if extra else base
        columns = set(range(x.shape[1]))
        while True:
            keep = sorted(c for c in columns if x[:, c].any())
            solution = np.zeros(x.shape[1])
            if keep:
                solution[keep] = np.linalg.lstsq(x[:, keep], y, rcond=None)[0]
            negative = {c for c in keep if solution[c] < 0}
            if not negative:
                break
            columns -= negative
        error = float(np.sum((x @ solution - y) ** 2))
        coefficients = {m: tuple(float(solution[index[(m, k)]]) for k in range(width)) for m in members}
        return coefficients, [float(v) for v in solution[len(order):]], error

    plain = solve([])
    if not histories or len(histories) != len(observations):
        return plain[0], (None, None)
    best = plain
    terms: HistoryTerms = (None, None)
    prefill_columns = {d: np.array([after_prefill_term(h[2], h[3], d) for h in histories]) for d in AFTER_PREFILL_DECAYS}
    for decay in AFTER_IDLE_DECAYS:
        for tau in AFTER_IDLE_TAUS_S:
            idle_column = np.array([after_idle_term(h[0], h[1], decay, tau) for h in histories])
            for prefill_decay, prefill_column in prefill_columns.items():
                fitted = solve([idle_column, prefill_column])
                if fitted[2] < min(best[2], 0.99 * plain[2]) and plain[2] - fitted[2] > 1e-12 * len(y):
                    idle_size, prefill_size = fitted[1]
                    best = fitted
                    terms = ((idle_size, decay, tau) if idle_size > 0 else None,
                             (prefill_size, prefill_decay) if prefill_size > 0 else None)
    return best[0], terms
