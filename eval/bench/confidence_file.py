"""The recorded confidences file (`mfs-confidences/1`): what `mfs bench --record-confidences FILE` and the
validation write from real replies, one sequence of top-1 probabilities per (request, member) span. The simulator
reads it (eval/simulate/confidence.py: the lookup, and why whole sequences)."""
from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

CONFIDENCE_FORMAT = "mfs-confidences/1"


def request_key(session_id: str, turn_index: int) -> str:
    """The system-independent name of one trace request (the bench's request ids add a system tag)."""
    return f"{session_id}-t{turn_index}"


def spans_of(logprobs: Sequence[float], tokens_by_member: dict[str, int]) -> list[tuple[str, list[float]]]:
    """Splits a reply's logprobs by member, in generation order (escalation only moves to larger members, so
    each member's tokens are one contiguous span and dict order is generation order)."""
    out, start = [], 0
    for member, n in tokens_by_member.items():
        out.append((member, [math.exp(lp) for lp in logprobs[start:start + n]]))
        start += n
    return out


def write_library(records: Iterable[Any], path: str | Path, family: str, note: str) -> dict[str, int]:
    """Writes the confidences of bench RequestRecords (those with output_logprobs). Returns sequences per member."""
    members: dict[str, list[list[float]]] = {}
    by_request: dict[str, int] = {}
    for r in records:
        if not r.ok or not getattr(r, "output_logprobs", None) or len(r.output_logprobs) != r.output_tokens:
            continue
        for member, values in spans_of(r.output_logprobs, r.tokens_by_member or {r.member: r.output_tokens}):
            if not values:
                continue
            key = f"{request_key(r.session_id, r.turn_index)}|{member}"
            if key not in by_request:
                by_request[key] = len(members.setdefault(member, []))
                members[member].append([round(v, 5) for v in values])
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({"format": CONFIDENCE_FORMAT, "family": family, "source": note,
                                      "members": members, "by_request": by_request}))
    return {m: len(v) for m, v in members.items()}
