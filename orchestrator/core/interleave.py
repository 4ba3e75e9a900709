"""Which members run in a step (scheduler.member_interleave).

When the members share one device, a step runs the forwards of the members it includes one after the other, so
every running request waits for every included member's forward before its next token. `lockstep` (the
default) includes every member with work in every step: the period between two tokens is the same for all,
the sum of the members' forwards. `cost_weighted` lets a cheap member step more often than an expensive one:
member m is included at a rate f_m proportional to sqrt(n_m / c_m) (n_m its running requests, c_m its cost
per forward). Of all rates that keep the device busy (sum of f_m * c_m fixed), these minimise the mean time
between tokens over the running requests, sum(n_m / f_m) / sum(n_m) (Lagrange: n_m / f_m**2 = lambda * c_m).
By the rule alone (arithmetic, not a measurement): with as many requests on an 8B member as on a 70B one, at
aiconfigurator's TensorRT-LLM decode costs on two H200s (3.3 and 20.5 ms a forward), the 8B's requests get a
token about twice as often, the 70B's wait about a fifth longer between tokens, and the mean falls by ~15%:
a mean bought with the large member's tail. Independent deployments cannot do this: each process steps its
own model and the device time-slices them.

The member with the highest rate (the pacer) runs in every step; each other member earns rate/pacer rate of
a turn per step and runs when it has a whole one, so over time it runs that share of the steps. A member
without work earns nothing and keeps no credit (no burst when it gets work again).

Pure core: no torch, no I/O.
"""
from __future__ import annotations

import math
from collections.abc import Mapping

from orchestrator.core.config import ConfigError
from orchestrator.core.family import FamilySpec


def member_costs(family: FamilySpec, configured: Mapping[str, float] | None = None) -> dict[str, float]:
    """Relative cost of one forward per member: the configured values, else the member's weight bytes (a decode
    forward on a GPU reads all of them: memory-bound), else an estimate of them from the shapes. The configured
    values are checked against the family here (the config alone does not know its members)."""
    if configured:
        key = "config key 'scheduler.member_step_costs'"
        unknown = set(configured) - set(family.member_names)
        if unknown:
            raise ConfigError(f"{key}: names members not in family {family.name}: {sorted(unknown)}")
        missing = set(family.member_names) - set(configured)
        if missing:
            raise ConfigError(f"{key}: lacks members {sorted(missing)}")
        if any(float(v) <= 0 for v in configured.values()):
            raise ConfigError(f"{key}: every cost must be positive")
        return {n: float(configured[n]) for n in family.member_names}
    costs: dict[str, float] = {}
    for m in family.members:
        weights = m.serving.get("weight_bytes")
        if not weights:
            # attention (q, o at full width; k, v at the KV width) and a gated MLP of ~8/3 the width, per layer,
            # plus the embedding: the parameters a decode forward reads. (eval.systems.member_weight_bytes, which
            # reads checkpoint file sizes, gives ratios within 1% of these for the tiny family; BENCHMARKS'
            # simulated tiny figures were made with this estimate, and that 1% moves them: section 9.)
            h, kv = m.hidden_size, m.num_kv_heads * m.head_dim
            weights = m.num_layers * (2 * h * h + 2 * h * kv + 8 * h * h) + m.vocab_size * h
        costs[m.name] = float(weights)
    return costs


class MemberInterleave:
    """mode: one of config.MEMBER_INTERLEAVE_MODES (MFSConfig.validate checks it)."""

    def __init__(self, mode: str, costs: Mapping[str, float]) -> None:
        self.mode = mode
        self.costs = dict(costs)
        self._credit = {name: 0.0 for name in costs}
        self.share = {name: 1.0 for name in costs}     # the share of steps each member ran in, last decided

    def choose(self, running: Mapping[str, int]) -> set[str]:
        """The members to include in this step, given each member's running requests (members with 0 have no
        work). lockstep: all of them."""
        busy = {name: n for name, n in running.items() if n > 0}
        if self.mode == "lockstep" or len(busy) <= 1:
            for name in self._credit:
                if name not in busy:
                    self._credit[name] = 0.0
            return set(busy)
        rate = {name: math.sqrt(n / self.costs[name]) for name, n in busy.items()}
        top = max(rate.values())
        chosen = set()
        for name in self._credit:
            if name not in busy:
                self._credit[name] = 0.0
                continue
            share = rate[name] / top
            self.share[name] = share
            credit = self._credit[name] + share
            if credit >= 1.0 - 1e-9:
                credit -= 1.0
                chosen.add(name)
            self._credit[name] = credit
        return chosen
