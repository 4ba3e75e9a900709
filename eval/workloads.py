"""Seeded, tokenised ShareGPT workloads: multi-turn sessions, Poisson session arrivals, think times.

History (`WorkloadSpec.history`): `closed` (the default) is how a chat client talks to a server: turn k+1's
prompt is turn k's prompt, the reply the serving system generated for it, and the next user message, joined
through the chat template (`Turn.user_token_ids` holds the tokens after the reply). `dataset` re-sends the
ShareGPT reply instead (`Turn.prompt_token_ids`, the open-loop replay of earlier benchmarks). Output lengths
are fixed per turn either way, so under `closed` every system sees the same prompt and output lengths.
"""
from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from orchestrator.sharegpt import Conversation, iter_conversations
from orchestrator.serve.tokenizer import FamilyTokenizer

WORKLOADS = ("multiturn", "mixed", "single")
HISTORIES = ("closed", "dataset")
# natural: EOS ends a reply and max_tokens is the cap, as chat clients send it; exact: every reply has the
# dataset reply's length (ignore_eos, max_tokens = that length), for paired comparisons of the same work.
LENGTHS = ("natural", "exact")
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
    history: str = "closed"               # closed: the system's own replies go back; dataset: ShareGPT's
    lengths: str = "natural"              # natural | exact (LENGTHS)

    def __post_init__(self) -> None:
        if self.name not in WORKLOADS:
            raise ValueError(f"workload {self.name!r}: expected one of {', '.join(WORKLOADS)}")
        if self.num_sessions <= 0 or self.rate_sessions_per_s <= 0:
            raise ValueError("num_sessions and rate_sessions_per_s must be positive")
        if self.history not in HISTORIES:
            raise ValueError(f"history {self.history!r}: expected one of {', '.join(HISTORIES)}")
        if self.lengths not in LENGTHS:
            raise ValueError(f"lengths {self.lengths!r}: expected one of {', '.join(LENGTHS)}")


@dataclass(slots=True)
class Turn:
    prompt_token_ids: list[int]           # the whole prompt with ShareGPT's earlier replies (dataset history)
    max_tokens: int                       # the real assistant reply's length, capped
    think_time_s: float                   # pause after the previous turn finished (0 for the first turn)
    # closed history: what follows the previous turn's generated reply (end of the reply, the next user
    # message, the generation prompt); for the first turn the whole prompt. Empty: not known (old files).
    user_token_ids: list[int] = field(default_factory=list)
    # the dataset's own reply, its first max_tokens tokens: what quality is judged on (eval/bench/quality.py).
    # Empty: not known (files of format 2 and older).
    reference_token_ids: list[int] = field(default_factory=list)


def closed_prompt_lengths(turns: Sequence[Turn]) -> list[int]:
    """Prompt lengths of a closed-loop session: the previous prompt + its (fixed-length) reply + the user part."""
    lengths: list[int] = []
    for k, turn in enumerate(turns):
        lengths.append(len(turn.user_token_ids) if k == 0
                       else lengths[-1] + turns[k - 1].max_tokens + len(turn.user_token_ids))
    return lengths


def next_prompt(turn: Turn, previous_prompt: list[int] | None, previous_reply: list[int] | None,
                history: str) -> list[int]:
    """The prompt a chat client sends for `turn`: closed history appends the reply the system generated."""
    if history == "dataset" or previous_prompt is None:
        return list(turn.prompt_token_ids if history == "dataset" or not turn.user_token_ids else turn.user_token_ids)
    return [*previous_prompt, *(previous_reply or []), *turn.user_token_ids]


@dataclass(slots=True)
class Session:
    session_id: str
    kind: str                             # multiturn | short | long
    conversation_id: str
    turns: list[Turn]
    # the session's difficulty as the router reads it (Request.complexity_hint), when the workload sets it
    # (with_mix_phases); None: estimated from each prompt
    complexity: float | None = None


@dataclass(slots=True)
class Trace:
    spec: WorkloadSpec
    sessions: list[Session]
    arrival_times_s: list[float]          # one per session, ascending, relative to the replay start
    notes: list[str] = field(default_factory=list)

    @property
    def num_requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)

    def prompt_lengths(self, session: Session) -> list[int]:
        """What the replay will send per turn (closed history: the same for every system)."""
        if self.spec.history == "closed":
            return closed_prompt_lengths(session.turns)
        return [len(t.prompt_token_ids) for t in session.turns]

    def at_rate(self, rate_sessions_per_s: float) -> "Trace":
        """The same sessions arriving at another rate: every gap scaled by old/new rate (the Poisson draws
        scale exactly so: an exponential gap at rate r is -ln(U)/r for the same U)."""
        if rate_sessions_per_s <= 0:
            raise ValueError(f"rate must be positive, got {rate_sessions_per_s}")
        scale = self.spec.rate_sessions_per_s / rate_sessions_per_s
        return Trace(spec=replace(self.spec, rate_sessions_per_s=rate_sessions_per_s), sessions=self.sessions,
                     arrival_times_s=[t * scale for t in self.arrival_times_s], notes=list(self.notes))

    def summary(self) -> dict:
        prompts = [n for s in self.sessions for n in self.prompt_lengths(s)]
        outputs = [t.max_tokens for s in self.sessions for t in s.turns]
        kinds = {k: sum(s.kind == k for s in self.sessions) for k in SESSION_KINDS}
        return {"name": self.spec.name, "seed": self.spec.seed, "num_sessions": len(self.sessions),
                "num_requests": self.num_requests, "rate_sessions_per_s": self.spec.rate_sessions_per_s,
                "mean_think_time_s": self.spec.mean_think_time_s, "max_output_tokens": self.spec.max_output_tokens,
                "max_prompt_tokens": self.spec.max_prompt_tokens, "context_tokens": self.spec.context_tokens,
                "history": self.spec.history, "lengths": self.spec.lengths, "max_turns": self.spec.max_turns,
                "sessions_by_kind": kinds, "prompt_tokens_total": sum(prompts),
                # what the context and the caps do to the sessions (docs/BENCHMARKS.md, Method)
                "mean_prompt_tokens": sum(prompts) / len(prompts) if prompts else None,
                "max_prompt_tokens_sent": max(prompts, default=0),
                "replies_at_cap_share": (sum(n == self.spec.max_output_tokens for n in outputs) / len(outputs)
                                         if outputs else None),
                "output_tokens_total": sum(outputs),
                "duration_arrivals_s": self.arrival_times_s[-1] if self.arrival_times_s else 0.0,
                "notes": list(self.notes)}


# ----------------------------------------------------------------------------- trace files
# A built trace saved as JSON replays anywhere the family is, without the ShareGPT package (a GPU box, a
# colleague's machine) and exactly: token ids, lengths, think times and arrivals are all in the file.
# Format 2 adds each turn's user_token_ids (closed history); a format-1 file replays with dataset history.
# Format 3 adds each turn's reference_token_ids (the dataset's reply, for quality); older files have none.
TRACE_FORMAT = "mfs-trace/3"
OLD_TRACE_FORMATS = ("mfs-trace/1", "mfs-trace/2")
NO_USER_TURNS_FORMATS = ("mfs-trace/1",)


class TraceFileError(ValueError):
    """A trace file that cannot be replayed here (unreadable, another format, another tokenizer)."""


def save_trace(trace: Trace, path: str | Path, tokenizer_hash: str) -> None:
    Path(path).write_bytes(trace_bytes(trace, tokenizer_hash))


def trace_digest(trace: Trace, tokenizer_hash: str) -> str:
    """sha256 of the file save_trace writes: names a trace in a result, so a rebuilt trace can be checked."""
    return hashlib.sha256(trace_bytes(trace, tokenizer_hash)).hexdigest()


def trace_bytes(trace: Trace, tokenizer_hash: str) -> bytes:
    # The sessions as asdict would give them (same keys, same order), without its deep copy of every token list.
    sessions = [{"session_id": s.session_id, "kind": s.kind, "conversation_id": s.conversation_id,
                 "turns": [{"prompt_token_ids": t.prompt_token_ids, "max_tokens": t.max_tokens,
                            "think_time_s": t.think_time_s, "user_token_ids": t.user_token_ids,
                            "reference_token_ids": t.reference_token_ids} for t in s.turns],
                 # only when set, so a trace without it keeps its bytes (and its sha256)
                 **({"complexity": s.complexity} if s.complexity is not None else {})}
                for s in trace.sessions]
    data = {"format": TRACE_FORMAT, "tokenizer_hash": tokenizer_hash, "spec": asdict(trace.spec),
            "arrival_times_s": trace.arrival_times_s, "notes": trace.notes, "sessions": sessions}
    return json.dumps(data).encode()


def load_trace(path: str | Path, tokenizer_hash: str) -> Trace:
    """The trace saved by save_trace; a file from another format or another tokenizer is refused (its token
    ids would mean different text) with TraceFileError."""
    try:
        data: dict[str, Any] = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise TraceFileError(f"trace file {path}: cannot read it as JSON ({exc})") from None
    fmt = data.get("format") if isinstance(data, dict) else None
    if fmt != TRACE_FORMAT and fmt not in OLD_TRACE_FORMATS:
        raise TraceFileError(f"trace file {path}: not an {TRACE_FORMAT} file (format {fmt!r})")
    if data.get("tokenizer_hash") != tokenizer_hash:
        raise TraceFileError(f"trace file {path}: tokenised with tokenizer {data.get('tokenizer_hash')!r}, "
                             f"this family's is {tokenizer_hash!r}")
    try:
        sessions = [Session(s["session_id"], s["kind"], s["conversation_id"],
                            [Turn(list(t["prompt_token_ids"]), int(t["max_tokens"]), float(t["think_time_s"]),
                                  list(t.get("user_token_ids") or ()), list(t.get("reference_token_ids") or ()))
                             for t in s["turns"]],
                            None if s.get("complexity") is None else float(s["complexity"]))
                    for s in data["sessions"]]
        spec = dict(data["spec"])
        notes = list(data.get("notes", []))
        if fmt in NO_USER_TURNS_FORMATS:   # no user turns recorded: only the dataset replay is possible
            spec["history"] = "dataset"
            notes.append(f"{fmt} trace file: no user turns recorded, replayed with dataset history (open loop)")
        trace = Trace(spec=WorkloadSpec(**spec), sessions=sessions,
                      arrival_times_s=[float(t) for t in data["arrival_times_s"]], notes=notes)
    except (KeyError, TypeError, ValueError) as exc:
        raise TraceFileError(f"trace file {path}: malformed ({type(exc).__name__}: {exc})") from None
    if len(trace.arrival_times_s) != len(trace.sessions):
        raise TraceFileError(f"trace file {path}: {len(trace.sessions)} sessions but "
                             f"{len(trace.arrival_times_s)} arrival times")
    if trace.spec.history == "closed" and any(not t.user_token_ids for s in trace.sessions for t in s.turns):
        raise TraceFileError(f"trace file {path}: closed history but a turn has no user_token_ids")
    return trace


def with_history(trace: Trace, history: str) -> Trace:
    """The same trace replayed with another history; closed history needs the user turns (format 2)."""
    if history == trace.spec.history:
        return trace
    if history == "closed" and any(not t.user_token_ids for s in trace.sessions for t in s.turns):
        raise TraceFileError("this trace holds no user turns (format 1): only --history dataset can replay it")
    return Trace(spec=replace(trace.spec, history=history), sessions=trace.sessions,
                 arrival_times_s=list(trace.arrival_times_s), notes=list(trace.notes))


def with_lengths(trace: Trace, lengths: str) -> Trace:
    """The same trace replayed with natural or exact reply lengths (LENGTHS)."""
    if lengths == trace.spec.lengths:
        return trace
    return Trace(spec=replace(trace.spec, lengths=lengths), sessions=trace.sessions,
                 arrival_times_s=list(trace.arrival_times_s), notes=list(trace.notes))


def with_mix_phases(trace: Trace, fractions: Sequence[float], top_threshold: float, seed: int) -> Trace:
    """The same sessions in a traffic mix that shifts: the sessions, in arrival order, fall into len(fractions)
    phases of equal size; in phase i a session is for the largest member with probability fractions[i] (its
    complexity drawn uniformly above top_threshold, the router's lower bound of the largest member's band), else
    for the smaller members (uniformly below it, so each smaller member gets its band's width). Every system routes
    on these complexities (Request.complexity_hint) instead of estimating them from the prompts."""
    if not fractions or any(not 0.0 <= f <= 1.0 for f in fractions):
        raise ValueError(f"mix phases {list(fractions)}: expected fractions between 0 and 1")
    if not 0.0 < top_threshold < 1.0:
        raise ValueError(f"the largest member's complexity bound {top_threshold} is not inside (0, 1)")
    rng = random.Random(f"{seed}-mix")
    order = sorted(range(len(trace.sessions)), key=lambda i: trace.arrival_times_s[i])
    sessions = list(trace.sessions)
    for rank, index in enumerate(order):
        fraction = fractions[rank * len(fractions) // len(order)]
        large = rng.random() < fraction
        u = rng.random()
        complexity = top_threshold + u * (1.0 - top_threshold) if large else u * top_threshold
        sessions[index] = replace(sessions[index], complexity=complexity)
    note = (f"mix phases {','.join(f'{f:g}' for f in fractions)}: share of sessions for the largest member in each "
            f"of {len(fractions)} equal phases of arrivals (complexity above {top_threshold:g})")
    return Trace(spec=trace.spec, sessions=sessions, arrival_times_s=list(trace.arrival_times_s),
                 notes=[*trace.notes, note])


def natural_lengths(trace: Trace, request_key) -> dict[str, int]:
    """request key -> the dataset reply's length, for the turns whose reply ended before the cap: where a
    simulated reply of natural length ends (its EOS follows that many tokens)."""
    if trace.spec.lengths != "natural":
        return {}
    cap = trace.spec.max_output_tokens
    return {request_key(s.session_id, k): t.max_tokens for s in trace.sessions for k, t in enumerate(s.turns)
            if t.max_tokens < cap}


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
        self._max_token_bytes = tokenizer.max_token_bytes()
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
        # Only the turns a kind uses are tokenised: the first max_turns (at least 2: fewer rejects the
        # session), the first, or all of them (long: the longest that fits).
        limit = {"multiturn": max(2, self.spec.max_turns), "short": 1}.get(kind)
        fitting = self._fitting_turns(conversation, closed=kind == "multiturn" and self.spec.history == "closed",
                                      limit=limit)
        if kind == "multiturn":
            if len(fitting) < 2:
                return None  # a multi-turn session needs at least two turns to show reuse
            turns = fitting[: self.spec.max_turns]
            # Think times drawn only for accepted sessions: the stream stays aligned across kinds.
            return [replace(t, think_time_s=0.0 if k == 0 else think_rng.expovariate(1.0 / self.spec.mean_think_time_s))
                    for k, t in enumerate(turns)]
        # Single-turn sessions: the prompt is the dataset's whole history, sent once (no earlier reply of ours).
        if kind == "short":
            if not fitting or len(fitting[0].prompt_token_ids) > self.spec.short_max_prompt_tokens:
                return None
            first = fitting[0]
            return [Turn(first.prompt_token_ids, first.max_tokens, 0.0, list(first.prompt_token_ids),
                         first.reference_token_ids)]
        # long: the longest fitting history, sent as ONE request with a cold start (no earlier turns).
        longest = [t for t in fitting if len(t.prompt_token_ids) >= self.spec.long_min_prompt_tokens]
        if not longest:
            return None
        last = longest[-1]
        return [Turn(last.prompt_token_ids, last.max_tokens, 0.0, list(last.prompt_token_ids), last.reference_token_ids)]

    def _fitting_turns(self, conversation: Conversation, closed: bool, limit: int | None = None) -> list[Turn]:
        """One Turn (think time 0) per user turn whose prompt + reply fit, measured the way the replay will
        send it (closed: our own fixed-length replies; else the dataset's); stops at the first that does
        not (later turns only grow), or after `limit` turns.

        Tokenising is the cost of a trace (ShareGPT has texts of 10^5 characters): a text is encoded only when
        its tokens are used, and never when its length alone (at least bytes / max_token_bytes tokens) already
        decides; the turns are exactly those of encoding everything."""
        spec, out = self.spec, []
        messages = list(conversation.messages)
        closed_length = 0
        for index in range(0, len(messages) - 1, 2):
            if limit is not None and len(out) >= limit:
                break
            reply = messages[index + 1]
            if messages[index]["role"] != "user" or reply["role"] != "assistant":
                break
            if self._at_least_tokens(reply["content"]) >= spec.max_output_tokens:
                max_tokens = max(spec.min_output_tokens, spec.max_output_tokens)
            else:
                reply_tokens = len(self.tokenizer.encode(reply["content"], add_special_tokens=False))
                max_tokens = max(spec.min_output_tokens, min(spec.max_output_tokens, reply_tokens))
            prompt_text = self.tokenizer.render_chat(messages[: index + 1], add_generation_prompt=True)
            if index == 0 or not closed:
                # The whole prompt is sent (first turn, or dataset history): too long by its size alone?
                if self._too_long(self._at_least_tokens(prompt_text), max_tokens):
                    break
                prompt = self.tokenizer.encode(prompt_text, add_special_tokens=False)
                user = prompt if index == 0 else self._user_part(messages[: index + 1])
            else:
                # Closed history sends our prompt so far, our reply and this user part: decide on those first.
                user = self._user_part(messages[: index + 1])
                if self._too_long(closed_length + out[-1].max_tokens + len(user), max_tokens):
                    break
                prompt = self.tokenizer.encode(prompt_text, add_special_tokens=False)
            length = len(user) if index == 0 else closed_length + out[-1].max_tokens + len(user)
            sent = length if closed else len(prompt)
            if self._too_long(sent, max_tokens):
                break
            closed_length = length
            out.append(Turn(prompt, max_tokens, 0.0, user, self._reference(reply["content"], max_tokens)))
        return out

    def _reference(self, text: str, max_tokens: int) -> list[int]:
        """The first max_tokens tokens of the dataset's reply. Only a prefix is encoded when the tokenizer bounds
        a token's bytes: (max_tokens + 16) tokens' worth of characters hold at least that many tokens, and a cut
        changes only the tokens of the word it cuts, well past the ones kept."""
        if self._max_token_bytes is not None:
            text = text[: (max_tokens + 16) * self._max_token_bytes]
        return self.tokenizer.encode(text, add_special_tokens=False)[:max_tokens]

    def _too_long(self, sent_tokens: int, max_tokens: int) -> bool:
        return sent_tokens > self.spec.max_prompt_tokens or sent_tokens + max_tokens > self.spec.context_tokens

    def _at_least_tokens(self, text: str) -> int:
        """A lower bound on the tokens of text (0 when the tokenizer gives none): a byte-level BPE token stands
        for at most max_token_bytes bytes."""
        if self._max_token_bytes is None:
            return 0
        return -(-len(text.encode()) // self._max_token_bytes)

    def _user_part(self, messages: list[dict[str, str]]) -> list[int]:
        """The tokens a chat client appends after the previous reply: the template rendered with a marker in
        place of that reply, everything after the marker (end of the reply, the user message, the
        generation prompt)."""
        marker = "\u2063MFS-REPLY\u2063"
        rendered = self.tokenizer.render_chat(
            [*messages[:-2], {"role": "assistant", "content": marker}, messages[-1]], add_generation_prompt=True)
        before, found, after = rendered.partition(marker)
        if not found:
            raise ValueError("the chat template dropped the assistant reply: closed history cannot be built")
        return self.tokenizer.encode(after, add_special_tokens=False)
