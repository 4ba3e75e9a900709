"""The `mfs-step-table/1` file: what one step of each member costs, on a grid, and how to read between points.

Per member:
  decode_ms[batch][context]     a step of `batch` decoding requests whose mean context is `context` tokens
  prefill_ms[tokens][prefix]    a prefill of `tokens` new tokens after `prefix` tokens already cached
  mix_overlap                   a step holding both costs max(P, D) + mix_overlap * min(P, D) (weights are read
                                once for both; fitted by whoever built the table)
  ride_overlap                  a batch of a nested member that rides in a larger member's forward (the local
                                engine's merged forward: its layers are the host's lower layers) costs
                                ride_overlap x what it costs alone; 1.0 (the default, and what a table without
                                the field means) prices it as a forward of its own
plus the facts that size memory (hf_config, weight_bytes, tp) when the table describes a GPU.
Between grid points values are interpolated linearly in each axis; beyond the last point they are extrapolated
from the last two (decode time grows with batch and context), below the first they are clamped.
"""
from __future__ import annotations

import bisect
import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

TABLE_FORMAT = "mfs-step-table/1"


class StepTableError(ValueError):
    """A step table that cannot be used: unreadable, another format, a member missing, a ragged grid."""


@dataclass(frozen=True, slots=True)
class Grid2D:
    """Values on a rectilinear grid (xs ascending, ys ascending, values[i][j] at (xs[i], ys[j]))."""

    xs: tuple[float, ...]
    ys: tuple[float, ...]
    values: tuple[tuple[float, ...], ...]

    def __post_init__(self) -> None:
        if not self.xs or not self.ys or len(self.values) != len(self.xs) or any(len(r) != len(self.ys) for r in self.values):
            raise StepTableError(f"grid of {len(self.xs)} x {len(self.ys)} points has rows {[len(r) for r in self.values]}")
        if list(self.xs) != sorted(set(self.xs)) or list(self.ys) != sorted(set(self.ys)):
            raise StepTableError("grid axes must be strictly ascending")

    def __call__(self, x: float, y: float) -> float:
        i, tx = _locate(self.xs, x)
        j, ty = _locate(self.ys, y)
        v = self.values
        if len(self.xs) == 1:
            return _lerp(v[0][j], v[0][j + 1], ty) if len(self.ys) > 1 else v[0][0]
        if len(self.ys) == 1:
            return _lerp(v[i][0], v[i + 1][0], tx)
        low = _lerp(v[i][j], v[i][j + 1], ty)
        high = _lerp(v[i + 1][j], v[i + 1][j + 1], ty)
        return max(0.0, _lerp(low, high, tx))

    def to_dict(self, x_name: str, y_name: str) -> dict[str, Any]:
        return {x_name: list(self.xs), y_name: list(self.ys), "ms": [list(r) for r in self.values]}

    @classmethod
    def from_dict(cls, data: dict[str, Any], x_name: str, y_name: str) -> "Grid2D":
        try:
            return cls(tuple(float(x) for x in data[x_name]), tuple(float(y) for y in data[y_name]),
                       tuple(tuple(float(v) for v in row) for row in data["ms"]))
        except (KeyError, TypeError) as exc:
            raise StepTableError(f"grid needs {x_name!r}, {y_name!r} and 'ms' ({exc})") from None


def _locate(axis: tuple[float, ...], value: float) -> tuple[int, float]:
    """Index of the lower neighbour and the fraction towards the upper one (clamped below, extrapolated above)."""
    if len(axis) == 1:
        return 0, 0.0
    if value <= axis[0]:
        return 0, 0.0
    i = min(bisect.bisect_right(axis, value) - 1, len(axis) - 2)
    return i, (value - axis[i]) / (axis[i + 1] - axis[i])


def _lerp(a: float, b: float, t: float) -> float:
    return a + (b - a) * t


@dataclass(frozen=True, slots=True)
class MemberCosts:
    decode_ms: Grid2D                    # (batch, context tokens)
    prefill_ms: Grid2D                   # (new tokens, cached prefix tokens)
    mix_overlap: float = 0.0
    ride_overlap: float = 1.0            # cost of riding in a larger member's forward, as a share of its own
    model: str | None = None             # the model id the costs were computed for
    tp: int = 1                          # GPUs the member spans (tensor parallel)
    weight_bytes: int | None = None      # per member, all GPUs together
    hf_config: dict[str, Any] | None = None
    # (prompt tokens, decoding requests): what a prefill chunk adds to a decode step of that batch, from
    # aiconfigurator's own mixed step (mixed_step_latency less decode_step_latency, at a context of 1,024: it
    # hardly moves with the context); None in tables built before it was recorded. Read with --mixed-steps grid.
    mixed_extra_ms: Grid2D | None = None


@dataclass(frozen=True, slots=True)
class StepTable:
    source: str                          # "aiconfigurator-core 0.12.0 ..." | "measured: local engine ..."
    members: dict[str, MemberCosts]
    gpu: str | None = None
    backend: str | None = None
    gpu_memory_bytes: int | None = None
    step_overhead_ms: float = 0.0        # the serving loop's cost per step outside the forward
    copy_gb_s: float = 25.0              # arena <-> host tier copy bandwidth
    notes: list[str] = field(default_factory=list)

    def scaled(self, factor: float, note: str) -> "StepTable":
        """The same table on a machine `factor` times slower: every decode and prefill time times factor."""
        def grid(g: Grid2D) -> Grid2D:
            return Grid2D(g.xs, g.ys, tuple(tuple(v * factor for v in row) for row in g.values))
        members = {n: replace(m, decode_ms=grid(m.decode_ms), prefill_ms=grid(m.prefill_ms),
                              mixed_extra_ms=grid(m.mixed_extra_ms) if m.mixed_extra_ms is not None else None)
                   for n, m in self.members.items()}
        return replace(self, members=members, notes=[*self.notes, note])

    def member(self, name: str) -> MemberCosts:
        try:
            return self.members[name]
        except KeyError:
            raise StepTableError(f"step table ({self.source}) has no member {name!r}; it has "
                                 f"{', '.join(self.members)}") from None

    def to_dict(self) -> dict[str, Any]:
        return {"format": TABLE_FORMAT, "source": self.source, "gpu": self.gpu, "backend": self.backend,
                "gpu_memory_bytes": self.gpu_memory_bytes, "step_overhead_ms": self.step_overhead_ms,
                "copy_gb_s": self.copy_gb_s, "notes": list(self.notes),
                "members": {name: {"model": m.model, "tp": m.tp, "weight_bytes": m.weight_bytes,
                                   "mix_overlap": m.mix_overlap, "ride_overlap": m.ride_overlap,
                                   "hf_config": m.hf_config,
                                   "decode_ms": m.decode_ms.to_dict("batch", "context"),
                                   "prefill_ms": m.prefill_ms.to_dict("tokens", "prefix"),
                                   **({"mixed_extra_ms": m.mixed_extra_ms.to_dict("tokens", "batch")}
                                      if m.mixed_extra_ms is not None else {})}
                            for name, m in self.members.items()}}

    @classmethod
    def from_dict(cls, data: Any, where: str = "step table") -> "StepTable":
        if not isinstance(data, dict) or data.get("format") != TABLE_FORMAT:
            got = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise StepTableError(f"{where}: not an {TABLE_FORMAT} file (format {got!r})")
        try:
            members = {name: MemberCosts(decode_ms=Grid2D.from_dict(m["decode_ms"], "batch", "context"),
                                         prefill_ms=Grid2D.from_dict(m["prefill_ms"], "tokens", "prefix"),
                                         mix_overlap=float(m.get("mix_overlap", 0.0)),
                                         ride_overlap=float(m.get("ride_overlap", 1.0)), model=m.get("model"),
                                         tp=int(m.get("tp", 1)), weight_bytes=m.get("weight_bytes"),
                                         hf_config=m.get("hf_config"),
                                         mixed_extra_ms=Grid2D.from_dict(m["mixed_extra_ms"], "tokens", "batch")
                                         if "mixed_extra_ms" in m else None)
                       for name, m in data["members"].items()}
        except (KeyError, TypeError, AttributeError) as exc:
            raise StepTableError(f"{where}: malformed member entry ({type(exc).__name__}: {exc})") from None
        if not members:
            raise StepTableError(f"{where}: no members")
        return cls(source=str(data.get("source", "?")), members=members, gpu=data.get("gpu"),
                   backend=data.get("backend"), gpu_memory_bytes=data.get("gpu_memory_bytes"),
                   step_overhead_ms=float(data.get("step_overhead_ms", 0.0)),
                   copy_gb_s=float(data.get("copy_gb_s", 25.0)), notes=list(data.get("notes", [])))


def save_table(table: StepTable, path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(table.to_dict(), indent=1))


def load_table(path: str | Path) -> StepTable:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise StepTableError(f"step table {path}: cannot read it as JSON ({exc})") from None
    return StepTable.from_dict(data, f"step table {path}")
