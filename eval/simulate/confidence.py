"""Per-token confidences for simulated replies, taken from the real tiny family rather than invented.

`mfs bench --record-confidences FILE` writes, for every served reply, the top-1 probability of each generated
token on each member (greedy decoding: the sampled token is the top-1, so its probability is exp(logprob)), one
sequence per (request, member) span: an `mfs-confidences/1` file (eval/bench/confidence_file.py). The simulator looks a value up by
(request key, member, position):
  - the request's own recorded sequence on that member when the file has one (a replay of the same trace);
  - otherwise a recorded sequence of that member picked by a hash of (seed, request key, member);
and reads position p of it (wrapping around a shorter sequence). Whole sequences keep the runs of low confidence
that make the rolling-window monitor fire; independent draws per token would average them away. The lookup
depends on nothing a system decides, so every system sees the same value for the same request, member and
position. For a family other than the recorded one, member i of n borrows the recorded member at the same
relative size (smallest -> smallest, largest -> largest): the assumption is stated in the result JSON.
"""
from __future__ import annotations

import json
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from eval.bench.confidence_file import CONFIDENCE_FORMAT, request_key  # noqa: F401 (request_key: driver.py reads it here)
from eval.simulate.paths import DEFAULT_LIBRARY


class ConfidenceFileError(ValueError):
    """A confidences file that cannot be used (unreadable, another format, a member with no sequence)."""


class Confidences(Protocol):
    """What the simulated executor reads: a reply's per-token confidence on a member (ConfidenceLibrary, or the
    parametric escalation model of escalation_model.py)."""

    def value(self, key: str, member: str, position: int) -> float: ...


@dataclass(slots=True)
class ConfidenceLibrary:
    family: str
    source: str
    members: dict[str, list[list[float]]]          # recorded member -> sequences
    by_request: dict[str, int] = field(default_factory=dict)
    seed: int = 0
    _mapping: dict[str, str] = field(default_factory=dict)
    _chosen: dict[tuple[str, str], list[float]] = field(default_factory=dict)   # (key, member) -> its sequence

    @classmethod
    def load(cls, path: str | Path = DEFAULT_LIBRARY, seed: int = 0) -> "ConfidenceLibrary":
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ConfidenceFileError(f"confidences file {path}: cannot read it as JSON ({exc})") from None
        if not isinstance(data, dict) or data.get("format") != CONFIDENCE_FORMAT:
            raise ConfidenceFileError(f"confidences file {path}: not an {CONFIDENCE_FORMAT} file")
        members = {m: [list(map(float, s)) for s in seqs if s] for m, seqs in data.get("members", {}).items()}
        members = {m: s for m, s in members.items() if s}
        if not members:
            raise ConfidenceFileError(f"confidences file {path}: no recorded sequence")
        return cls(family=str(data.get("family")), source=str(data.get("source", "")), members=members,
                   by_request=dict(data.get("by_request", {})), seed=seed)

    def map_members(self, simulated: Sequence[str], recorded_order: Sequence[str]) -> dict[str, str]:
        """Simulated member i of n -> the recorded member at the same relative size (recorded_order small to large,
        limited to members that have sequences; a tie goes to the larger)."""
        have = [m for m in recorded_order if m in self.members] or sorted(self.members)
        n, k = len(simulated), len(have)
        self._mapping = {name: have[int(i * (k - 1) / (n - 1) + 0.5) if n > 1 else k - 1]
                         for i, name in enumerate(simulated)}
        self._chosen.clear()
        return dict(self._mapping)

    def value(self, key: str, member: str, position: int) -> float:
        seq = self._chosen.get((key, member))
        if seq is None:         # chosen once per request and member (value() runs for every simulated token)
            seq = self._chosen[(key, member)] = self._sequence(key, member)
        return seq[position % len(seq)]

    def _sequence(self, key: str, member: str) -> list[float]:
        recorded = self._mapping.get(member, member)
        sequences = self.members.get(recorded)
        if sequences is None:
            raise ConfidenceFileError(f"no recorded confidences for member {member!r} (recorded: {', '.join(self.members)})")
        index = self.by_request.get(f"{key}|{recorded}")
        if index is None or index >= len(sequences):
            index = zlib.crc32(f"{self.seed}|{key}|{recorded}".encode()) % len(sequences)
        return sequences[index]

    def describe(self) -> dict[str, Any]:
        return {"family": self.family, "source": self.source,
                "sequences_by_member": {m: len(s) for m, s in self.members.items()},
                "member_mapping": dict(self._mapping),
                "assumption": ("per-token top-1 probabilities replayed from the real tiny family's replies: the "
                               "request's own recorded sequence on that member when recorded, else a recorded "
                               "sequence of the mapped member chosen by hash(seed, request, member); the same "
                               "request, member and position get the same value in every system. For a family "
                               "other than the recorded one this assumes its members are as (un)sure as the tiny "
                               "members of the same rank.")}


def merge_files(paths: Sequence[str | Path], out: str | Path) -> dict[str, int]:
    """One library from several recordings (e.g. every rate of a validation run); a request's own sequence is taken
    from the first file that has it. Returns sequences per member."""
    members: dict[str, list[list[float]]] = {}
    by_request: dict[str, int] = {}
    sources, family = [], None
    for path in paths:
        data = json.loads(Path(path).read_text())
        family = family or data.get("family")
        sources.append(str(data.get("source", path)))
        for member, seqs in data.get("members", {}).items():
            offset = len(members.setdefault(member, []))
            members[member].extend(seqs)
            for key, index in data.get("by_request", {}).items():
                if key.endswith(f"|{member}") and key not in by_request:
                    by_request[key] = offset + index
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps({"format": CONFIDENCE_FORMAT, "family": family, "source": "; ".join(sources),
                                     "members": members, "by_request": by_request}))
    return {m: len(s) for m, s in members.items()}


if __name__ == "__main__":      # python -m eval.simulate.confidence OUT IN [IN ...]
    import sys

    print(merge_files(sys.argv[2:], sys.argv[1]))
