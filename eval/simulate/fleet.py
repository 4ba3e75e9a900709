"""Placements (where the members run) and the front router of a fleet.

colocated    every member on one device (one GPU, or this machine): one arena chopped between the members, one
             step runs the member batches one after the other (separate deployments time-share the device, as
             separate processes do; MFS runs them in one loop).
per-member   each member on its own GPUs (tensor parallel when its weights need more than one): each member's
             pages live on its own GPUs, so both systems get a fixed per-member slice sized by that memory; the
             member batches of a step run side by side and the step lasts as long as the slowest (lock-step:
             the core plans one step for all members).
fleet:N      N identical nodes, each holding the family as `--node-placement` says, behind a front router.
pooled:N     N GPUs, each system as it would use them: the family's own systems (MFS and its ablations) place the
             whole family on every GPU group (as many colocated nodes as the GPUs hold, behind the front router),
             the separate deployments give each member its own GPUs (per-member nodes, replicated to fill the N
             GPUs). Same GPUs and the same host memory per GPU for both (eval/simulate/setup.py pooled_setups).
             Each member has home nodes, as many as the deployments give it GPUs (member_homes): a session's
             first turn goes to a home of its member, so a node mostly steps one member alone as a per-member GPU
             does; when that home is congested (SPILL_WAITING) the session spills to the least congested node,
             which holds that member's weights too. That spill is what a shifting mix needs and a per-member
             deployment cannot do. A request escalated to a member its node is not home to moves to that member's
             home (driver.py, node.SimCore.move_out/move_in), as it would move to the larger member's deployment.

The front router is modelled on what is deployed today (sglang-router's cache_aware policy, Dynamo's KV
router): a session sticks to its node while that node is not overloaded; otherwise the node whose routed
prompts share the longest prefix with this one wins when the match covers at least CACHE_THRESHOLD of the
prompt and the nodes are balanced; otherwise the least loaded node. Load = requests in flight on the node.
"""
from __future__ import annotations

import zlib
from collections import OrderedDict
from dataclasses import dataclass

# sglang-router defaults: --cache-threshold 0.5, --balance-abs-threshold 32, --balance-rel-threshold 1.5 (1.0001
# in newer releases; 1.5 keeps more affinity)
CACHE_THRESHOLD = 0.5
BALANCE_ABS_THRESHOLD = 32
BALANCE_REL_THRESHOLD = 1.5
ROUTER_BLOCK_TOKENS = 64            # the router's prefix granularity (it does not know the nodes' block sizes)
ROUTER_BLOCKS_PER_NODE = 200_000    # bounded approximate tree per node (LRU), like the router's max tree size
# member homes: a node with more requests than this waiting for admission is congested, and new sessions spill
# past it. At any load, requests that arrive during a step wait for the next one, so the bar sits above that
# (Qwen3 1.7B/8B/32B on 3 H200, 400 sessions, 5 seeds, SIMULATED: no spill at 8 sessions/s, 40-66 of 400 at 128/s;
# docs/BENCHMARKS.md R5).
SPILL_WAITING = 8


class PlacementError(ValueError):
    """A placement that cannot hold the family (memory) or a malformed --placement."""


@dataclass(frozen=True, slots=True)
class Placement:
    kind: str                       # colocated | per-member | pooled
    num_nodes: int = 1              # > 1: a fleet of nodes of `kind`; pooled: the number of GPUs

    @property
    def label(self) -> str:
        if self.kind == "pooled":
            return f"pooled:{self.num_nodes}"
        return f"fleet:{self.num_nodes}" if self.num_nodes > 1 else self.kind


def parse_placement(text: str, node_placement: str = "colocated") -> Placement:
    if text in ("colocated", "per-member"):
        return Placement(text)
    kind, _, count = text.partition(":")
    if kind not in ("fleet", "pooled"):
        raise PlacementError(f"--placement {text!r}: expected colocated, per-member, fleet:N or pooled:N")
    n = int(count) if count.isdigit() else 0
    if n < 1:
        raise PlacementError(f"--placement {text!r}: {kind}:N needs a positive {'GPU' if kind == 'pooled' else 'node'} "
                             "count")
    if kind == "pooled":
        return Placement("pooled", n)
    if node_placement not in ("colocated", "per-member"):
        raise PlacementError(f"--node-placement {node_placement!r}: expected colocated or per-member")
    return Placement(node_placement, n)


def member_homes(num_nodes: int, gpus_per_member: dict[str, int]) -> list[tuple[str, ...]]:
    """Each node's home members: the nodes shared out in proportion to the GPUs each member's own deployment has
    (largest remainder), every member at least one node while there are as many nodes as members; with fewer
    nodes than members, members share homes in order (node i is home to members i, i + n, ...)."""
    names = list(gpus_per_member)
    if num_nodes < len(names):
        return [tuple(names[i::num_nodes]) for i in range(num_nodes)]
    spare = num_nodes - len(names)
    total = sum(gpus_per_member.values())
    exact = {n: spare * gpus_per_member[n] / total for n in names}
    counts = {n: 1 + int(exact[n]) for n in names}
    for n in sorted(names, key=lambda n: exact[n] - int(exact[n]), reverse=True)[: num_nodes - sum(counts.values())]:
        counts[n] += 1
    return [(n,) for n in names for _ in range(counts[n])]


class FrontRouter:
    """Session affinity, then approximate prefix affinity under a balance check, then least load. With member
    homes (pooled placement) and the request's member known: session affinity, then the least busy of its
    member's homes, each while that node is not congested, else the least congested node (_route_home)."""

    def __init__(self, num_nodes: int, homes: list[tuple[str, ...]] | None = None) -> None:
        self.num_nodes = num_nodes
        self.homes = homes
        self._sessions: dict[str, int] = {}
        self._trees: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_nodes)]
        self.decisions = {"session": 0, "prefix": 0, "load": 0}
        if homes is not None:
            self.decisions.update(home=0, spill=0, moved=0)

    @staticmethod
    def prefix_keys(token_ids: list[int]) -> list[int]:
        keys, parent = [], 0
        for start in range(0, len(token_ids) - ROUTER_BLOCK_TOKENS + 1, ROUTER_BLOCK_TOKENS):
            parent = zlib.crc32(repr(token_ids[start:start + ROUTER_BLOCK_TOKENS]).encode(), parent)
            keys.append(parent)
        return keys

    def route(self, session_id: str | None, token_ids: list[int], loads: list[int], member: str | None = None,
              waiting: list[int] | None = None) -> int:
        """member: the member the request is for, as the nodes' router will judge it; waiting: each node's
        requests not yet admitted (member homes need both)."""
        if self.num_nodes == 1:
            return 0
        low, high = min(loads), max(loads)
        balanced = not _overloaded(high, low)
        keys = self.prefix_keys(token_ids)
        homes = ([i for i, h in enumerate(self.homes) if member in h] if self.homes is not None and member else [])
        node = self._sessions.get(session_id) if session_id else None
        reason = "session"
        if homes and waiting is not None:
            node, reason = self._route_home(node, homes, loads, waiting)
        elif node is None or (not balanced and loads[node] == high):
            node, reason = None, "load"
            if balanced and keys:
                best, best_len = 0, -1
                for i, tree in enumerate(self._trees):
                    n = 0
                    while n < len(keys) and keys[n] in tree:
                        n += 1
                    if n > best_len or (n == best_len and loads[i] < loads[best]):
                        best, best_len = i, n
                if best_len / len(keys) >= CACHE_THRESHOLD:
                    node, reason = best, "prefix"
            if node is None:
                node = min(range(self.num_nodes), key=lambda i: (loads[i], i))
        self.decisions[reason] += 1
        if session_id:
            self._sessions[session_id] = node
        tree = self._trees[node]
        for key in keys:
            tree[key] = None
            tree.move_to_end(key)
        while len(tree) > ROUTER_BLOCKS_PER_NODE:
            tree.popitem(last=False)
        return node

    def move(self, member: str, source: int, loads: list[int], waiting: list[int]) -> int:
        """Where a request on node `source` escalated to `member` continues: that member's least busy home while
        that node is not congested, else the least congested node. The session's later turns stay with `source`,
        where its first turn's member is (their member starts there, as in a deployment with session affinity)."""
        node, _ = self._home_or_spill([i for i, h in enumerate(self.homes or ()) if member in h], loads, waiting)
        if node != source:
            self.decisions["moved"] += 1
        return node

    def _route_home(self, node: int | None, homes: list[int], loads: list[int], waiting: list[int]) -> tuple[int, str]:
        """A session stays on its node while that node is not congested; otherwise _home_or_spill."""
        if node is not None and waiting[node] <= SPILL_WAITING:
            return node, "session"
        return self._home_or_spill(homes, loads, waiting)

    def _home_or_spill(self, homes: list[int], loads: list[int], waiting: list[int]) -> tuple[int, str]:
        """The least busy of `homes` while it is not congested (more than SPILL_WAITING requests waiting for
        admission), else the least congested node."""
        home = min(homes, key=lambda i: (waiting[i], loads[i], i))
        if waiting[home] <= SPILL_WAITING:
            return home, "home"
        return min(range(self.num_nodes), key=lambda i: (waiting[i], loads[i], i)), "spill"


def _overloaded(load: int, lowest: int) -> bool:
    """sglang-router's imbalance test, of one node against the least loaded."""
    return load - lowest > BALANCE_ABS_THRESHOLD and load > BALANCE_REL_THRESHOLD * max(lowest, 1)
