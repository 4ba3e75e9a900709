"""Future page demand in the scheduler's pools: the pages reserved for the running requests' remaining
decode (what admission must leave free), what a waiting request needs, and the expected wait before a new
request could be admitted on a member (the router's delay estimate). Reads the scheduler's running and
waiting requests; changes nothing but its own cache. Pure: no clock, no I/O.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Collection

from orchestrator.core.config import MFSConfig
from orchestrator.core.demand import (NewTokenRatio, RunningDemand, decode_profile, expected_final_tokens,
                                      is_length_fixed, peak_growth, steps_until_fit)
from orchestrator.core.family import FamilySpec
from orchestrator.core.kv_cache import KVCacheManager
from orchestrator.core.page_pool import PagePool
from orchestrator.core.sequence import Sequence
from orchestrator.core.types import PageId, Request, RequestId, tuple_new


class PoolDemand:
    def __init__(self, family: FamilySpec, config: MFSConfig, pool: PagePool, kv: KVCacheManager,
                 running: OrderedDict[RequestId, Sequence], waiting: dict[int, deque[Sequence]],
                 capacity_pages: dict[str, int]) -> None:
        self.family = family
        self.config = config
        self.pool = pool
        self.kv = kv
        self._running = running          # the scheduler's own containers (read only here)
        self._waiting = waiting
        self._capacity_pages = capacity_pages
        self._partitioned = config.pool.static_split is not None
        self.ratio = NewTokenRatio(config.scheduler)
        self._cache: dict[str | None, int] = {}   # partition -> reserved_pages; cleared on every change
        self._demands: dict[str | None, list[RunningDemand]] = {}   # partition -> running demands; likewise
        # partition -> reserved_pages_bound: a sum of per-request terms, so an admission adds its own term
        # (admitted) instead of clearing it; everything else clears it
        self._bounds: dict[str | None, int] = {}
        # member -> (tokens per block, pages per block, context tokens): the layout's numbers, read per running
        # request on every arrival and admission (kv.pages_for_tokens through three calls cost more than the sums)
        self._geometry = {m.name: (kv.tokens_per_block(m.name), kv.pages_per_block(m.name), m.context_tokens)
                          for m in family.members}
        # member -> pages_for_tokens(member, n) as one expression (KVLayout.pages_for_tokens: the context cap, then
        # whole blocks of pages_per_block pages); tests/test_scheduler_load.py checks it against the layout's.
        self._pages_for = {name: _pages_rule(*geometry) for name, geometry in self._geometry.items()}

    def clear(self) -> None:
        """The running set or a request's pages changed: reservations must be recomputed."""
        self._cache.clear()
        self._demands.clear()
        self._bounds.clear()

    def admitted(self, seq: Sequence) -> None:
        """`seq` was just admitted (attached, now running): what it changed is its own term. Another running
        request's future_pages reads only that request (its tokens, blocks held, the ratio, which moves once per
        step), so the bound of seq's partition grows by seq's term; the exact reservation and the delay inputs
        also depend on which pages are shared, so they are recomputed."""
        self._cache.clear()
        self._demands.clear()
        part = self.partition_of(seq.member)
        if part in self._bounds:
            self._bounds[part] += self.future_pages(seq)

    def partition_of(self, member: str) -> str | None:
        return member if self._partitioned else None

    def in_partition(self, seq: Sequence, member: str) -> bool:
        return not self._partitioned or seq.member == member

    def future_pages(self, seq: Sequence) -> int:
        """Pages a running request will still allocate for its expected decode."""
        if seq.kv is None:
            return 0
        _, per_block, context = self._geometry[seq.member]
        final = expected_final_tokens(seq, self.ratio.value, context)
        return max(0, self._pages_for[seq.member](final) - len(seq.kv.block_tables[0]) * per_block)

    def reserved_pages(self, member: str, claimed_pages: Collection[PageId] = ()) -> int:
        """Pages reserved for the running requests' remaining decode in `member`'s pool (0 in block mode).
        remaining: every request's pages to its (expected) end, summed. peak: decoding requests of fixed
        length are followed step by step (their growth, then their private pages back when they end) and
        the peak of the sum is reserved; the others count as in remaining. Cached until the state changes.

        claimed_pages: arena pages an admission is about to share (its prefix hits). A running request's
        private page among them stops being private, so its end returns nothing: the reservation the
        admission must leave free is the one after the sharing, not before (issue 13's known bug: a hit
        on a finishing request's pages made the reservation exceed the available pages)."""
        mode = self.config.scheduler.decode_reservation
        if mode == "block":
            return 0
        # Only a page held by exactly one request now can change its owner's credit.
        claimed = frozenset(p for p in claimed_pages if self.pool.refcount(p) == 1)
        part = self.partition_of(member)
        if not claimed:
            cached = self._cache.get(part)
            if cached is not None:
                return cached
        constant, profiles = 0, []
        slack = self.kv.tokens_per_block(member) if self.config.scheduler.preallocate_blocks else 1
        partitioned = self._partitioned
        for seq in self._running.values():
            if partitioned and seq.member != member:
                continue
            if seq.kv is not None and seq.is_decoding() and is_length_fixed(seq):
                _, per_block, context = self._geometry[seq.member]
                final = expected_final_tokens(seq, 1.0, context)
                held = len(seq.kv.block_tables[0]) * per_block
                if claimed:
                    pages = seq.kv.all_pages()
                    private = self.pool.num_private(pages) - sum(1 for p in pages if p in claimed)
                else:
                    private = self.kv.num_private_pages(seq.kv)
                profiles.append(decode_profile(final - len(seq.token_ids) + 1, len(seq.token_ids), final, held, private,
                                               self._pages_for[seq.member], slack, self._geometry[seq.member][0]))
            else:
                constant += self.future_pages(seq)
        reserved = constant + peak_growth(profiles)
        if not claimed:
            self._cache[part] = reserved
        return reserved

    def reserved_pages_bound(self, member: str) -> int:
        """An upper bound of reserved_pages(member) in one pass over the running requests: each decoding request
        of fixed length counted at its whole growth to its end (peak_growth never reserves more for it: its
        growth at any step is at most that, and a request that ended gives pages back). Admission checks this
        first and computes the exact peak only when the bound does not fit (it almost always fits)."""
        mode = self.config.scheduler.decode_reservation
        if mode == "block":
            return 0
        part = self.partition_of(member)
        cached = self._cache.get(part)
        if cached is not None:
            return cached
        bound = self._bounds.get(part)
        if bound is None:
            # future_pages is each request's whole growth to its end when its length is fixed (the ratio does not
            # apply to it) and its expected rest otherwise, the same in either branch of reserved_pages.
            partitioned = self._partitioned
            bound = self._bounds[part] = sum(self.future_pages(seq) for seq in self._running.values()
                                             if not partitioned or seq.member == member)
        return bound

    def demand_pages(self, seq: Sequence) -> int:
        """Pages a waiting request needs to run to its expected end (ignoring prefix hits)."""
        context = self.family.member(seq.member).context_tokens
        return self.kv.pages_for_tokens(seq.member, expected_final_tokens(seq, self.ratio.value, context))

    def delay_and_pressure(self, member: str, request: Request, step_cost_s: float | None) -> dict:
        """MemberLoad's expected_delay_s, pool_pressure and pages_per_token for `request` on `member`."""
        spec = self.family.member(member)
        ppb = self.kv.pages_per_block(member)
        pages_per_token = ppb / self.kv.tokens_per_block(member)
        reserved = self.reserved_pages(member)
        capacity = max(1, self._capacity_pages[member])
        used = self.pool.num_used_pages(member if self._partitioned else None)   # shared pages count once
        pressure = min(1.0, (used + reserved) / capacity)
        step_s = step_cost_s or 0.0
        if len(request.prompt_token_ids) >= spec.context_tokens:
            return {"pool_pressure": pressure, "pages_per_token": pages_per_token, "step_s": step_s}
        need = self.kv.pages_for_tokens(member, len(request.prompt_token_ids) + request.sampling.max_tokens)
        queued_tokens = 0
        for queue in self._waiting.values():
            for seq in queue:
                # Ahead of it: its own member's queue (FCFS per member) and every held (aged) request;
                # other members' waiting requests are bypassed (per-member head-of-line).
                if not seq.is_warmup and self.in_partition(seq, member) and (seq.member == member or seq.held):
                    need += self.demand_pages(seq)
                    queued_tokens += len(seq.token_ids)
        available = self.pool.num_available_pages(member) - reserved
        demands = self._demands.get(self.partition_of(member))
        if demands is None:     # the same for every member of a partition and every arrival until the next change
            demands = self._demands[self.partition_of(member)] = self._running_demands(member)
        steps = steps_until_fit(need, available, demands)
        if steps is None:
            steps = max((d.remaining_steps for d in demands), default=0)
        budget = self.config.scheduler.decode_step_token_budget or self.config.scheduler.max_batch_tokens
        delay_s = (steps + queued_tokens / max(1, budget)) * step_s
        return {"expected_delay_s": delay_s, "pool_pressure": pressure, "pages_per_token": pages_per_token,
                "step_s": step_s}

    def _running_demands(self, member: str) -> list[RunningDemand]:
        """RunningDemand of each running request holding pages in `member`'s partition: the pages it holds, its
        future_pages and its expected remaining steps, from one expected_final_tokens per request."""
        ratio, geometry, pages_for = self.ratio.value, self._geometry, self._pages_for
        partitioned = self._partitioned
        demands = []
        for s in self._running.values():
            if s.kv is None or (partitioned and s.member != member):
                continue
            _, per_block, context = geometry[s.member]
            final = expected_final_tokens(s, ratio, context)
            held = len(s.kv.block_tables[0]) * per_block
            demands.append(tuple_new(RunningDemand, (held, max(0, pages_for[s.member](final) - held),
                                                     max(0, final - len(s.token_ids)) + 1)))
        return demands


def _pages_rule(tokens_per_block: int, pages_per_block: int, context_tokens: int):
    """KVLayout.pages_for_tokens for one member, as a closure over its numbers."""
    def pages_for(num_tokens: int) -> int:
        return -(-min(num_tokens, context_tokens) // tokens_per_block) * pages_per_block
    return pages_for
