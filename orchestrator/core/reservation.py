"""Reservation: what admission leaves free beside the running requests (chosen by name: peak | block |
guaranteed_no_evict), and how long a new request would wait for pages (the router's expected delay). Its caches
are keyed by the running set's version and the new-token ratio, so nobody clears them. Pure: no clock, no I/O.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection
from typing import ClassVar

from orchestrator.core.demand import (DecodeProfile, NewTokenRatio, RunningDemand, expected_final_tokens,
                                      is_length_fixed, peak_growth, steps_until_fit)
from orchestrator.core.kv_cache import PrefixMatch, SeqKV
from orchestrator.core.parts import SchedulerParts
from orchestrator.core.sequence import Sequence
from orchestrator.core.speculation import draft_member_for
from orchestrator.core.types import PageId, Request


class Reservation(ABC):
    """The pool-demand arithmetic over the running set and the waiting queue (demand.py's terms)."""

    name: ClassVar[str] = ""          # ClassVar: a compiled (mypyc) class keeps it on the class

    def __init__(self, parts: SchedulerParts) -> None:
        self.family, self.config, self.pool, self.kv = parts.family, parts.config, parts.pool, parts.kv
        self.running, self.waiting, self.capacity_pages = parts.running, parts.waiting, parts.capacity_pages
        # member -> the members whose requests draw on its pages (None: every member): the pool's answer
        self._scope: dict[str, frozenset[str] | None] = {m.name: parts.pool.members_sharing(m.name)
                                                        for m in parts.family.members}
        self.ratio = NewTokenRatio(parts.config.scheduler)
        # Caches, each valid for one (running.version, ratio) key: scope -> reserved_pages; scope -> running
        # demands; scope -> reserved_pages_bound (a sum of per-request terms: an admission adds its own)
        self._key: tuple[int, float] | None = None
        self._cache: dict[frozenset[str] | None, int] = {}
        self._demands: dict[frozenset[str] | None, list[RunningDemand]] = {}
        self._bounds: dict[frozenset[str] | None, int] = {}
        # member -> (tokens per block, pages per block, context tokens): read per running request on every arrival
        kv = parts.kv
        self._geometry = {m.name: (kv.tokens_per_block(m.name), kv.pages_per_block(m.name), m.context_tokens)
                          for m in parts.family.members}
        # member -> pages_for_tokens(member, n) as one expression (tests/test_scheduler_load.py checks it)
        self._pages_for = {name: _pages_rule(*geometry) for name, geometry in self._geometry.items()}
        # speculation: a draft's tables hold one page per layer per block (no residual), and a verify writes up to
        # max_k positions past the request's last token
        self._draft_pages_for = {m.name: _pages_rule(kv.tokens_per_block(m.name), m.num_layers, m.context_tokens)
                                 for m in parts.family.members}
        spec = parts.config.speculation
        self._verify_tokens = spec.max_k if spec.enabled else 0

    def _fresh(self) -> None:
        key = (self.running.version, self.ratio.value)
        if key != self._key:
            self._key = key
            self._cache.clear()
            self._demands.clear()
            self._bounds.clear()

    def admitted(self, seq: Sequence) -> None:
        """`seq` was just added to the running set: the bound of its scope (a sum of per-request terms) grows by
        its term; the rest depends on which pages are shared, so it is recomputed."""
        bounds = dict(self._bounds) if self._key == (self.running.version - 1, self.ratio.value) else {}
        self._fresh()
        self._bounds.update(bounds)
        scope = self._scope[seq.member]
        if scope in bounds:
            self._bounds[scope] += self.future_pages(seq)

    def scope_of(self, member: str) -> frozenset[str] | None:
        return self._scope[member]

    def shares_pages(self, seq: Sequence, member: str) -> bool:
        """`seq` draws on the pages `member`'s requests draw on."""
        scope = self._scope[member]
        return scope is None or seq.member in scope

    def future_pages(self, seq: Sequence) -> int:
        """Pages a running request will still allocate for its expected decode (its draft's included)."""
        return 0 if seq.kv is None else self._held_and_future(seq)[1]

    def _held_and_future(self, seq: Sequence) -> tuple[int, int, int]:
        """A running request's pages held and still to allocate (its draft's included), and its expected length."""
        assert seq.kv is not None
        _, per_block, context = self._geometry[seq.member]
        final = expected_final_tokens(seq, self.ratio.value, context)
        held = len(seq.kv.block_tables[0]) * per_block
        future = max(0, self._pages_for[seq.member](final) - held)
        draft = seq.draft
        if draft is not None:
            held += draft.kv.num_pages()
            future += max(0, self._draft_pages_for[draft.member](final) - draft.kv.num_pages())
        return held, future, final

    def draft_decode_pages(self, seq: Sequence) -> int:
        """Pages the draft of a request being admitted will allocate beyond its prompt (0 when it drafts not)."""
        member = draft_member_for(self.family, self.config, seq)
        if member is None:
            return 0
        final = expected_final_tokens(seq, self.ratio.value, self._geometry[seq.member][2])
        rule = self._draft_pages_for[member]
        return max(0, rule(final) - rule(len(seq.token_ids)))

    def demand_pages(self, seq: Sequence) -> int:
        """Pages a waiting request needs to run to its expected end (ignoring prefix hits)."""
        context = self.family.member(seq.member).context_tokens
        return self.kv.pages_for_tokens(seq.member, expected_final_tokens(seq, self.ratio.value, context))

    @abstractmethod
    def reserved_pages(self, member: str, claimed_pages: Collection[PageId] = ()) -> int:
        """Pages reserved for the running requests' remaining decode in `member`'s pool."""

    @abstractmethod
    def reserve_beside_running(self, seq: Sequence, match: PrefixMatch, held_pages: int) -> int:
        """Pages attach must leave free for the running requests (and seq's own decode) when seq joins them."""

    def delay_and_pressure(self, member: str, request: Request, step_cost_s: float | None) -> dict:
        """MemberLoad's expected_delay_s, pool_pressure and pages_per_token for `request` on `member`: in steps,
        until the pages it and the queue ahead of it need fit (free beyond the reservation, plus what the running
        requests return as they end), plus the queued tokens over the step budget."""
        self._fresh()
        spec = self.family.member(member)
        ppb = self.kv.pages_per_block(member)
        pages_per_token = ppb / self.kv.tokens_per_block(member)
        reserved = self.reserved_pages(member)
        capacity = max(1, self.capacity_pages[member])
        scope = self._scope[member]
        used = (self.pool.num_used_pages() if scope is None                       # shared pages count once
                else sum(self.pool.num_used_pages(m) for m in scope))
        pressure = min(1.0, (used + reserved) / capacity)
        step_s = step_cost_s or 0.0
        if len(request.prompt_token_ids) >= spec.context_tokens:
            return {"pool_pressure": pressure, "pages_per_token": pages_per_token}
        need = self.kv.pages_for_tokens(member, len(request.prompt_token_ids) + request.sampling.max_tokens)
        queued_tokens = 0
        for seq in self.waiting:
            # Ahead of it: its own member's queue (FCFS per member) and every held (aged) request;
            # other members' waiting requests are bypassed (per-member head-of-line).
            if not seq.is_warmup and self.shares_pages(seq, member) and (seq.member == member or seq.held):
                need += self.demand_pages(seq)
                queued_tokens += len(seq.token_ids)
        available = self.pool.num_available_pages(member) - reserved
        demands = self._demands.get(scope)
        if demands is None:     # the same for every member of a scope and every arrival until the next change
            demands = self._demands[scope] = self._running_demands(member)
        steps = steps_until_fit(need, available, demands)
        if steps is None:
            steps = max((d.remaining_steps for d in demands), default=0)
        budget = self.config.scheduler.decode_step_token_budget or self.config.scheduler.max_batch_tokens
        delay_s = (steps + queued_tokens / max(1, budget)) * step_s
        return {"expected_delay_s": delay_s, "pool_pressure": pressure, "pages_per_token": pages_per_token}

    def _running_demands(self, member: str) -> list[RunningDemand]:
        """RunningDemand of each running request holding pages in `member`'s scope."""
        scope = self._scope[member]
        demands = []
        for s in self.running:
            if s.kv is None or (scope is not None and s.member not in scope):
                continue
            held, future, final = self._held_and_future(s)
            demands.append(RunningDemand(held_pages=held, future_pages=future,
                                         remaining_steps=max(0, final - len(s.token_ids)) + 1))
        return demands


class PeakReservation(Reservation):
    """Admit only beside the peak of the running requests' future page demand: decoding requests of fixed length
    are followed step by step (their growth, then their private pages back when they end), the others count at
    their expected remaining pages."""

    name: ClassVar[str] = "peak"

    def reserved_pages(self, member: str, claimed_pages: Collection[PageId] = ()) -> int:
        """claimed_pages: arena pages an admission is about to share (its prefix hits): a running request's private
        page among them returns nothing at its end, so the reservation is the one after the sharing."""
        self._fresh()
        # Only a page held by exactly one request now can change its owner's credit.
        claimed = frozenset(p for p in claimed_pages if self.pool.refcount(p) == 1)
        scope = self._scope[member]
        if not claimed:
            cached = self._cache.get(scope)
            if cached is not None:
                return cached
        constant, profiles = 0, []
        # a decode's next block is grown one token early (preemption.py), a verify's k positions ahead
        slack = self.kv.tokens_per_block(member) + self._verify_tokens
        for seq in self.running:
            if scope is not None and seq.member not in scope:
                continue
            if seq.kv is not None and seq.is_decoding() and is_length_fixed(seq):
                _, per_block, context = self._geometry[seq.member]
                final = expected_final_tokens(seq, 1.0, context)
                held = len(seq.kv.block_tables[0]) * per_block
                steps, n = final - len(seq.token_ids) + 1, len(seq.token_ids)
                profiles.append(DecodeProfile(steps, n, final, held, self._private(seq.kv, claimed),
                                              self._pages_for[seq.member], slack, self._geometry[seq.member][0]))
                draft = seq.draft
                if draft is not None:
                    profiles.append(DecodeProfile(steps, n, final, draft.kv.num_pages(),
                                                  self._private(draft.kv, claimed),
                                                  self._draft_pages_for[draft.member], slack,
                                                  draft.kv.tokens_per_block))
            else:
                constant += self.future_pages(seq)
        reserved = constant + peak_growth(profiles)
        if not claimed:
            self._cache[scope] = reserved
        return reserved

    def _private(self, kv: SeqKV, claimed: frozenset[PageId]) -> int:
        """Pages only `kv` holds, less those an admission is about to share (claimed)."""
        if not claimed:
            return self.kv.num_private_pages(kv)
        pages = kv.all_pages()
        return self.pool.num_private(pages) - sum(1 for p in pages if p in claimed)

    def reserved_pages_bound(self, member: str) -> int:
        """An upper bound of reserved_pages(member) in one pass: each decoding request of fixed length counted at
        its whole growth to its end (peak_growth never reserves more for it)."""
        self._fresh()
        scope = self._scope[member]
        cached = self._cache.get(scope)
        if cached is not None:
            return cached
        bound = self._bounds.get(scope)
        if bound is None:
            bound = self._bounds[scope] = sum(self.future_pages(seq) for seq in self.running
                                              if scope is None or seq.member in scope)
        return bound

    def reserve_beside_running(self, seq: Sequence, match: PrefixMatch, held_pages: int) -> int:
        """The running requests' reservation plus seq's own decode. The exact peak costs O(running^2), so the
        one-pass bound is used when even it leaves room for every page seq could take: attach then admits exactly
        as it would with the exact one."""
        member = seq.member
        own = max(0, self.demand_pages(seq) - self.kv.pages_for_tokens(member, len(seq.token_ids)))
        other_pages = own + (0 if seq.held else held_pages)
        bound = self.reserved_pages_bound(member)
        blocks = -(-len(seq.token_ids) // self.kv.tokens_per_block(member))
        pages = blocks * self.kv.pages_per_block(member) + match.num_shared_blocks
        available = self.pool.counts()["free"] if seq.is_warmup else self.pool.num_available_pages(member)
        if pages + bound + other_pages <= available:
            return bound + own   # the bound credits no returned pages: prefix claims cannot push the peak above it
        # Its prefix hits on a running request's private pages take them off that request's return.
        claimed = (self.kv.arena_hits(member, match, seq.hashes)
                   if match.num_full_blocks or match.num_shared_blocks else ())
        return self.reserved_pages(member, claimed) + own


class BlockReservation(Reservation):
    """Keep scheduler.decode_reserve_blocks blocks free per admission, whatever the running requests will need (the
    watermark of a single-model server)."""

    name: ClassVar[str] = "block"

    def __init__(self, parts: SchedulerParts) -> None:
        super().__init__(parts)
        self._reserve_pages = {m.name: self.config.scheduler.decode_reserve_blocks * self.kv.pages_per_block(m.name)
                               for m in self.family.members}

    def reserved_pages(self, member: str, claimed_pages: Collection[PageId] = ()) -> int:
        return 0

    def reserve_beside_running(self, seq: Sequence, match: PrefixMatch, held_pages: int) -> int:
        return self._reserve_pages[seq.member]


class GuaranteedNoEvict(PeakReservation):
    """TensorRT-LLM's guaranteed_no_evict: admitted only when prompt + max_tokens fit beside every running
    request's remaining max_tokens in full, so nothing is ever preempted. The peak reservation with the new-token
    ratio held at 1."""

    name: ClassVar[str] = "guaranteed_no_evict"

    def __init__(self, parts: SchedulerParts) -> None:
        super().__init__(parts)
        ratio = self.ratio
        ratio.init = ratio.minimum = ratio.value = 1.0


# scheduler.decode_reservation -> the reservation
RESERVATIONS: dict[str, type[Reservation]] = {cls.name: cls for cls in (PeakReservation, BlockReservation,
                                                                        GuaranteedNoEvict)}


def _pages_rule(tokens_per_block: int, pages_per_block: int, context_tokens: int) -> Callable[[int], int]:
    """KVLayout.pages_for_tokens for one member, as a closure over its numbers."""
    def pages_for(num_tokens: int) -> int:
        return -(-min(num_tokens, context_tokens) // tokens_per_block) * pages_per_block
    return pages_for
