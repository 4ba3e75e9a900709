"""Seeded, tokenised ShareGPT workloads: multi-turn sessions, Poisson session arrivals, think times."""
from __future__ import annotations

import json
import random
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.sharegpt import Conversation, iter_conversations
from orchestrator.serve.tokenizer import FamilyTokenizer

WORKLOADS = ("multiturn", "mixed", "single")
SESSION_KINDS = ("multiturn", "short", "long")
# `mixed`: fixed proportions of short single-turn, long single-turn and multi-turn sessions.
MIXED_PROPORTIONS = {"short": 0.3, "long": 0.2, "multiturn": 0.5}


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    name: str = "multiturn"               # multiturn | mixed | single
    num_sessions: int = 24
    rate_sessions_per_s: float = 0.5      # Poisson session arrivals
    seed: int = 0
    context_tokens: int = 1024            # the members' context: prompt + output must fit
    max_prompt_tokens: int = 1024         # extra cap (quick mode keeps CPU prefill small)
    max_output_tokens: int = 128          # cap on the real reply's token length
    min_output_tokens: int = 1
    max_turns: int = 4                    # user turns replayed per multi-turn session
    mean_think_time_s: float = 2.0        # exponential think time between a reply and the next turn
    short_max_prompt_tokens: int = 128    # a `short` single-turn prompt is at most this long
    long_min_prompt_tokens: int = 256     # a `long` single-turn prompt is at least this long
    conversation_pool: int = 1500         # ShareGPT conversations read (then shuffled with the seed)

    def __post_init__(self) -> None:
        if self.name not in WORKLOADS:
            raise ValueError(f"workload {self.name!r}: expected one of {', '.join(WORKLOADS)}")
        if self.num_sessions <= 0 or self.rate_sessions_per_s <= 0:
            raise ValueError("num_sessions and rate_sessions_per_s must be positive")


@dataclass(slots=True)
class Turn:
    prompt_token_ids: list[int]
    max_tokens: int                       # the real assistant reply's length, capped
    think_time_s: float                   # pause after the previous turn finished (0 for the first turn)


@dataclass(slots=True)
class Session:
    session_id: str
    kind: str                             # multiturn | short | long
    conversation_id: str
    turns: list[Turn]


@dataclass(slots=True)
class Trace:
    spec: WorkloadSpec
    sessions: list[Session]
    arrival_times_s: list[float]          # one per session, ascending, relative to the replay start
    notes: list[str] = field(default_factory=list)

    @property
    def num_requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)

    def summary(self) -> dict:
        prompts = [len(t.prompt_token_ids) for s in self.sessions for t in s.turns]
        outputs = [t.max_tokens for s in self.sessions for t in s.turns]
        kinds = {k: sum(s.kind == k for s in self.sessions) for k in SESSION_KINDS}
        return {"name": self.spec.name, "seed": self.spec.seed, "num_sessions": len(self.sessions),
                "num_requests": self.num_requests, "rate_sessions_per_s": self.spec.rate_sessions_per_s,
                "mean_think_time_s": self.spec.mean_think_time_s, "max_output_tokens": self.spec.max_output_tokens,
                "max_prompt_tokens": self.spec.max_prompt_tokens, "context_tokens": self.spec.context_tokens,
                "sessions_by_kind": kinds, "prompt_tokens_total": sum(prompts),
                "output_tokens_total": sum(outputs),
                "duration_arrivals_s": self.arrival_times_s[-1] if self.arrival_times_s else 0.0,
                "notes": list(self.notes)}


# ----------------------------------------------------------------------------- trace files
# A built trace saved as JSON replays anywhere the family is, without the ShareGPT package (a GPU box, a
# colleague's machine) and exactly: token ids, lengths, think times and arrivals are all in the file.
TRACE_FORMAT = "mfs-trace/1"


class TraceFileError(ValueError):
    """A trace file that cannot be replayed here (unreadable, another format, another tokenizer)."""


def save_trace(trace: Trace, path: str | Path, tokenizer_hash: str) -> None:
    data = {"format": TRACE_FORMAT, "tokenizer_hash": tokenizer_hash, "spec": asdict(trace.spec),
            "arrival_times_s": trace.arrival_times_s, "notes": trace.notes,
            "sessions": [asdict(s) for s in trace.sessions]}
    Path(path).write_text(json.dumps(data))


def load_trace(path: str | Path, tokenizer_hash: str) -> Trace:
    """The trace saved by save_trace; a file from another format or another tokenizer is refused (its token
    ids would mean different text) with TraceFileError."""
    try:
        data: dict[str, Any] = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise TraceFileError(f"trace file {path}: cannot read it as JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != TRACE_FORMAT:
        raise TraceFileError(f"trace file {path}: not an {TRACE_FORMAT} file (format {data.get('format') if isinstance(data, dict) else None!r})")
    if data.get("tokenizer_hash") != tokenizer_hash:
        raise TraceFileError(f"trace file {path}: tokenised with tokenizer {data.get('tokenizer_hash')!r}, "
                             f"this family's is {tokenizer_hash!r}")
    try:
        sessions = [Session(s["session_id"], s["kind"], s["conversation_id"],
                            [Turn(list(t["prompt_token_ids"]), int(t["max_tokens"]), float(t["think_time_s"]))
                             for t in s["turns"]])
                    for s in data["sessions"]]
        trace = Trace(spec=WorkloadSpec(**data["spec"]), sessions=sessions,
                      arrival_times_s=[float(t) for t in data["arrival_times_s"]], notes=list(data.get("notes", [])))
    except (KeyError, TypeError, ValueError) as exc:
        raise TraceFileError(f"trace file {path}: malformed ({type(exc).__name__}: {exc})") from None
    if len(trace.arrival_times_s) != len(trace.sessions):
        raise TraceFileError(f"trace file {path}: {len(trace.sessions)} sessions but "
                             f"{len(trace.arrival_times_s)} arrival times")
    return trace


def kind_counts(name: str, num_sessions: int) -> dict[str, int]:
    """Exact session counts per kind (largest remainder), so a mix has its proportions at any size."""
    if name == "multiturn":
        return {"multiturn": num_sessions, "short": 0, "long": 0}
    if name == "single":
        return {"multiturn": 0, "short": num_sessions, "long": 0}
    exact = {k: num_sessions * p for k, p in MIXED_PROPORTIONS.items()}
    counts = {k: int(x) for k, x in exact.items()}
    for k in sorted(exact, key=lambda k: exact[k] - counts[k], reverse=True)[: num_sessions - sum(counts.values())]:
        counts[k] += 1
    return {k: counts.get(k, 0) for k in SESSION_KINDS}


def poisson_arrivals(num: int, rate_per_s: float, rng: random.Random) -> list[float]:
    """Cumulative exponential gaps; the first session arrives at t=0 so replays start at once."""
    times, now_s = [], 0.0
    for i in range(num):
        if i:
            now_s += rng.expovariate(rate_per_s)
        times.append(now_s)
    return times


def build_trace(spec: WorkloadSpec, tokenizer: FamilyTokenizer,
                conversations: Iterable[Conversation] | None = None) -> Trace:
    """Deterministic for (spec, tokenizer, conversations); separate RNG streams so, e.g., changing the
    rate does not change which conversations are chosen."""
    pool = list(conversations) if conversations is not None else list(iter_conversations(limit=spec.conversation_pool))
    random.Random(f"{spec.seed}-pool").shuffle(pool)
    counts = kind_counts(spec.name, spec.num_sessions)
    kinds = [k for k in SESSION_KINDS for _ in range(counts[k])]
    random.Random(f"{spec.seed}-kinds").shuffle(kinds)
    think_rng = random.Random(f"{spec.seed}-think")
    builder = _SessionBuilder(spec, tokenizer, pool)
    sessions, notes = [], []
    for index, kind in enumerate(kinds):
        session = builder.next_session(kind, f"s{index}", think_rng)
        if session is None:
            notes.append(f"ran out of ShareGPT conversations for a {kind!r} session (pool {len(pool)})")
            continue
        sessions.append(session)
    arrivals = poisson_arrivals(len(sessions), spec.rate_sessions_per_s, random.Random(f"{spec.seed}-arrivals"))
    return Trace(spec=spec, sessions=sessions, arrival_times_s=arrivals, notes=notes)


class _SessionBuilder:
    """Hands out each conversation at most once; one cursor per kind over the shuffled pool."""

    def __init__(self, spec: WorkloadSpec, tokenizer: FamilyTokenizer, pool: Sequence[Conversation]):
        self.spec, self.tokenizer, self.pool = spec, tokenizer, pool
        self.used: set[int] = set()
        self.cursor = {k: 0 for k in SESSION_KINDS}

    def next_session(self, kind: str, session_id: str, think_rng: random.Random) -> Session | None:
        while self.cursor[kind] < len(self.pool):
            index = self.cursor[kind]
            self.cursor[kind] += 1
            if index in self.used:
                continue
            turns = self._turns(kind, self.pool[index], think_rng)
            if turns:
                self.used.add(index)
                return Session(session_id, kind, self.pool[index].conversation_id, turns)
        return None

    def _turns(self, kind: str, conversation: Conversation, think_rng: random.Random) -> list[Turn] | None:
        fitting = self._fitting_turns(conversation)
        if kind == "multiturn":
            if len(fitting) < 2:
                return None  # a multi-turn session needs at least two turns to show reuse
            turns = fitting[: self.spec.max_turns]
            # Think times drawn only for accepted sessions: the stream stays aligned across kinds.
            return [Turn(p, n, 0.0 if k == 0 else think_rng.expovariate(1.0 / self.spec.mean_think_time_s))
                    for k, (p, n) in enumerate(turns)]
        if kind == "short":
            if not fitting or len(fitting[0][0]) > self.spec.short_max_prompt_tokens:
                return None
            return [Turn(fitting[0][0], fitting[0][1], 0.0)]
        # long: the longest fitting history, sent as ONE request with a cold start (no earlier turns).
        longest = [t for t in fitting if len(t[0]) >= self.spec.long_min_prompt_tokens]
        if not longest:
            return None
        return [Turn(longest[-1][0], longest[-1][1], 0.0)]

    def _fitting_turns(self, conversation: Conversation) -> list[tuple[list[int], int]]:
        """(prompt ids, output tokens) for each user turn whose prompt + reply fit; stops at the first that
        does not (later turns only grow)."""
        spec, out = self.spec, []
        messages = list(conversation.messages)
        for index in range(0, len(messages) - 1, 2):
            reply = messages[index + 1]
            if messages[index]["role"] != "user" or reply["role"] != "assistant":
                break
            prompt = self.tokenizer.apply_chat_template(messages[: index + 1], add_generation_prompt=True)
            reply_tokens = len(self.tokenizer.encode(reply["content"], add_special_tokens=False))
            max_tokens = max(spec.min_output_tokens, min(spec.max_output_tokens, reply_tokens))
            if len(prompt) > spec.max_prompt_tokens or len(prompt) + max_tokens > spec.context_tokens:
                break
            out.append((prompt, max_tokens))
        return out
