"""Draft acceptance in the simulator: per family and draft->target pair, the per-token probability that a verify
keeps a drafted token (greedy and sampled requests apart), and where each figure comes from.

A simulated verify draws its acceptances from this table (SimExecutor); the core's speculation starts from the same
figures as its priors (speculation.acceptance) and then follows what the verifies show.

Published: vLLM's draft-model speculative decoding (github.com/vllm-project/vllm pull request 24322, MT-Bench,
100 prompts), Qwen3-32B verifying Qwen3-1.7B: 2.79 tokens per verify at k = 3 and 3.12 at k = 4 at temperature 0,
2.61 at k = 3 at temperature 1. A verify of k drafts, each kept with probability a until the first rejection,
yields (1 - a^(k+1)) / (1 - a) tokens; solving that for each figure gives a per-token acceptance of about 0.76
greedy and 0.72 sampled. No figure for another pair of these families is at hand, so every pair of the Qwen3 and
Llama 3.1 families gets these (labelled so). A shipped tiny family's figures are measured on its own members by the
local engine (tables/<family>_speculation.json, e.g. tables/tiny_speculation.json, written by
`python -m eval.simulate.measure_speculation --family F`); a pair the file lacks, or a family with no such file,
gets 0.7, labelled assumed. `mfs simulate --acceptance X` sets every pair to X.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eval.simulate.paths import speculation_table_path

SPECULATION_FORMAT = "mfs-speculation-table/1"      # eval/simulate/measure_speculation.py
PUBLISHED_SOURCE = ("published: vLLM draft-model speculative decoding (vllm-project/vllm pull request 24322), "
                    "MT-Bench, Qwen3-32B verifying Qwen3-1.7B")
# (temperature, k, tokens per verify) as published
PUBLISHED_POINTS = ((0.0, 3, 2.79), (0.0, 4, 3.12), (1.0, 3, 2.61))
ASSUMED_ACCEPTANCE = 0.7


def tokens_per_verify(acceptance: float, k: int) -> float:
    """1 + a + ... + a^k: what a verify of k drafts yields on average (speculation.expected_tokens)."""
    return sum(acceptance ** i for i in range(k + 1))


def per_token_acceptance(tokens: float, k: int) -> float:
    """The a for which a verify of k drafts yields `tokens` on average (bisection: increasing in a)."""
    if not 1.0 <= tokens <= k + 1:
        raise ValueError(f"{tokens} tokens per verify is outside [1, {k + 1}] for k = {k}")
    low, high = 0.0, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        if tokens_per_verify(mid, k) < tokens:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def published_acceptance(temperature: float) -> float:
    """The mean per-token acceptance of the published points at this temperature."""
    values = [per_token_acceptance(tokens, k) for t, k, tokens in PUBLISHED_POINTS if t == temperature]
    return sum(values) / len(values)


@dataclass(frozen=True, slots=True)
class Acceptance:
    greedy: float                 # temperature 0
    sampled: float                # temperature > 0
    source: str

    def for_temperature(self, temperature: float) -> float:
        return self.greedy if temperature == 0 else self.sampled


@dataclass(frozen=True, slots=True)
class AcceptanceTable:
    pairs: dict[str, Acceptance]                    # "draft->target" -> its figures
    default: Acceptance                             # a pair the table does not name
    notes: list[str] = field(default_factory=list)

    def of(self, pair: str) -> Acceptance:
        return self.pairs.get(pair, self.default)

    def priors(self) -> dict[str, float]:
        """speculation.acceptance for the core: each pair's greedy figure (the bench's requests are greedy)."""
        return {pair: a.greedy for pair, a in self.pairs.items()}

    def describe(self) -> dict[str, Any]:
        return {"pairs": {p: {"greedy": round(a.greedy, 4), "sampled": round(a.sampled, 4), "source": a.source}
                          for p, a in self.pairs.items()},
                "default": {"greedy": round(self.default.greedy, 4), "sampled": round(self.default.sampled, 4),
                            "source": self.default.source}, "notes": list(self.notes)}


def pairs_of(member_names: list[str]) -> list[str]:
    """Every draft->target pair speculation makes: the smallest member drafts for each larger one."""
    return [f"{member_names[0]}->{target}" for target in member_names[1:]]


def acceptance_table(family: str, member_names: list[str], override: float | None = None,
                     measured: Path | None = None) -> AcceptanceTable:
    """The figures for `family`'s pairs: --acceptance when given, the published ones for a paper-scale family,
    the family's measured table (`measured`, by default tables/<family>_speculation.json) when it exists, else the
    assumed 0.7."""
    pairs = pairs_of(member_names)
    if override is not None:
        if not 0.0 <= override < 1.0:
            raise ValueError(f"--acceptance {override}: a per-token acceptance is in [0, 1)")
        chosen = Acceptance(override, override, f"--acceptance {override:g}")
        return AcceptanceTable({p: chosen for p in pairs}, chosen)
    if family in ("qwen3", "qwen3-large", "llama3.1", "llama3.1-draft1b"):
        published = Acceptance(published_acceptance(0.0), published_acceptance(1.0), PUBLISHED_SOURCE)
        notes = ["every pair of this family gets the published Qwen3-1.7B -> Qwen3-32B figure (no figure for the "
                 "pair itself is at hand)"]
        return AcceptanceTable({p: published for p in pairs}, published, notes)
    measured = measured or speculation_table_path(family)
    if measured.is_file():
        return load_table(measured, pairs)
    assumed = Acceptance(ASSUMED_ACCEPTANCE, ASSUMED_ACCEPTANCE, "assumed (not measured yet)")
    return AcceptanceTable({p: assumed for p in pairs}, assumed)


def load_table(path: Path, pairs: list[str]) -> AcceptanceTable:
    """The acceptance measured in an mfs-speculation-table/1 file (one entry per pair and temperature:
    draft, target, temperature, per_token_acceptance)."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or data.get("format") != SPECULATION_FORMAT:
        raise ValueError(f"{path}: not an {SPECULATION_FORMAT} file")
    source = str(data.get("source", f"measured ({path.name})"))
    by_pair: dict[str, dict[str, float]] = {}
    for entry in data["acceptance"]:
        kind = "greedy" if float(entry["temperature"]) == 0 else "sampled"
        by_pair.setdefault(f"{entry['draft']}->{entry['target']}", {})[kind] = float(entry["per_token_acceptance"])
    table = {p: Acceptance(v.get("greedy", ASSUMED_ACCEPTANCE), v.get("sampled", v.get("greedy", ASSUMED_ACCEPTANCE)),
                           source) for p, v in by_pair.items()}
    missing = [p for p in pairs if p not in table]
    assumed = Acceptance(ASSUMED_ACCEPTANCE, ASSUMED_ACCEPTANCE, "assumed (not measured yet)")
    notes = [f"{', '.join(missing)}: not in {path.name}, assumed"] if missing else []
    return AcceptanceTable(table, assumed, notes)
