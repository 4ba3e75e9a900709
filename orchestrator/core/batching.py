"""Batch formation: which running requests step, their decode tokens and prefill chunks under the token budget."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from orchestrator.core.config import SchedulerConfig
from orchestrator.core.events import Stats
from orchestrator.core.parts import StepScope
from orchestrator.core.request_queue import RunningSet
from orchestrator.core.sequence import Sequence
from orchestrator.core.types import MemberBatch, MemberName, SeqChunk, StepPlan


class StepMembers(Protocol):
    def select(self, running: Iterable[Sequence]) -> Iterable[Sequence]:
        """Those of `running` (the step's scope alone) that step."""


class EveryMember:
    """Every member with running requests runs in every step."""

    def select(self, running: Iterable[Sequence]) -> Iterable[Sequence]:
        return running


class BatchFormer:
    """Decodes first (one token each), then prefill chunks in admission order until the token budget is spent."""

    def __init__(self, config: SchedulerConfig, stats: Stats, step_members: StepMembers | None = None,
                 scope: StepScope | None = None) -> None:
        self.config = config
        self.stats = stats
        self.step_members = step_members or EveryMember()
        self.scope = scope or StepScope()

    def build(self, plan: StepPlan, running: RunningSet) -> None:
        cfg = self.config
        members = self.scope.members
        stepping = self.step_members.select(running if members is None else
                                            [s for s in running if s.member in members])
        budget_tokens = cfg.max_batch_tokens
        chunk_limit = cfg.prefill_chunk_tokens
        if cfg.decode_step_token_budget is not None and any(s.is_decoding() for s in stepping):
            # Stall-aware: while requests decode, prefill chunks fill the step only up to this budget,
            # so a long prompt costs the decoders a few slightly longer steps, not one very long one.
            budget_tokens = min(budget_tokens, cfg.decode_step_token_budget)
        batches: dict[str, list[SeqChunk]] = {}
        prefills = []
        for seq in stepping:
            if seq.is_decoding():
                pos = len(seq.token_ids) - 1
                batches.setdefault(seq.member, []).append(chunk_of(seq, pos, pos + 1, sample=True))
                budget_tokens -= 1
            else:
                prefills.append(seq)
        for seq in prefills:
            if budget_tokens <= 0:
                break
            start = seq.num_computed_tokens
            stop_at = seq.shared_until_tokens if start < seq.shared_until_tokens else len(seq.token_ids)
            end = min(stop_at, start + chunk_limit, start + budget_tokens)
            sample = end == len(seq.token_ids) and not seq.is_warmup
            batches.setdefault(seq.member, []).append(chunk_of(seq, start, end, sample=sample))
            budget_tokens -= end - start
        plan.batches = [MemberBatch(MemberName(m), chunks) for m, chunks in batches.items()]
        if batches:
            self.stats.on_member_steps(batches)


def chunk_of(seq: Sequence, start: int, end: int, sample: bool) -> SeqChunk:
    """Positions [start, end) of `seq` as one chunk of its member's forward, with the block tables they read."""
    kv = seq.kv
    assert kv is not None
    blocks_needed = -(-end // kv.tokens_per_block)
    start_layer = seq.shared_depth if start < seq.shared_until_tokens else 0
    residual_in = None
    if start_layer:
        # The engine indexes residual pages by block from 0; blocks before the handover range
        # are never read, so any valid page pads them.
        first = min(kv.residual_in)
        residual_in = [kv.residual_in.get(b, kv.residual_in[first]) for b in range(blocks_needed)]
    tables, residual_out = kv.tables_upto(blocks_needed)
    return SeqChunk(request_id=seq.request_id, token_ids=seq.token_ids[start:end], start_pos=start,
                    block_tables=tables, sample=sample, sampling=seq.request.sampling, start_layer=start_layer,
                    residual_table=residual_in, residual_table_out=residual_out, num_generated=seq.num_generated)
