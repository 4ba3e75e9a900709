"""Fakes for unit tests of the pure core: a made-up nested family and an executor that checks pages.

FakeExecutor stores, in every page slot it writes, the (token, position) that produced it, and on every
read checks that each position a chunk attends over holds exactly the sequence's token there. A wrong
block table, a prefix hit on the wrong page, or a bad handover fails loudly. Its 'model' is a
deterministic function of the context, so outputs can be compared across runs.
"""
from __future__ import annotations

import json
from pathlib import Path

from eval.composition import load_system_config
from orchestrator.core.config import MFSConfig
from orchestrator.core.family import FamilySpec, MemberSpec
from orchestrator.core.types import MemberName, PageId, SampledToken, StepPlan

VOCAB_SIZE = 50
EOS = 2


def fake_member(name: str, index: int, num_layers: int, lineages: tuple[str, ...], context: int = 512) -> MemberSpec:
    return MemberSpec(name=MemberName(name), index=index, checkpoint_dir=Path("/nonexistent"), architecture="llama",
                      num_layers=num_layers, hidden_size=64, num_heads=2, num_kv_heads=1, head_dim=32,
                      vocab_size=VOCAB_SIZE, context_tokens=context, layer_lineages=lineages,
                      tokenizer_hash="tok", eos_token_ids=(EOS,))


def named_nested_family(names=("tiny-s", "tiny-m", "tiny-l"), depths=(2, 4, 6), context: int = 2048) -> FamilySpec:
    """A nested family with the shipped family's member names (router and escalation tests)."""
    lineage = tuple(f"lin{l}" for l in range(max(depths)))
    return FamilySpec(name="fake", members=tuple(fake_member(n, i, d, lineage[:d], context)
                                                 for i, (n, d) in enumerate(zip(names, depths))))


def nested_family() -> FamilySpec:
    """s = layers 0-1, m = layers 0-3, l = layers 0-5 of one network (shared lineages)."""
    lineage = tuple(f"L{i}" for i in range(6))
    return FamilySpec(name="fake", members=(fake_member("s", 0, 2, lineage[:2]), fake_member("m", 1, 4, lineage[:4]),
                                            fake_member("l", 2, 6, lineage)))


def independent_family() -> FamilySpec:
    return FamilySpec(name="indep", members=(fake_member("s", 0, 2, ("a0", "a1")),
                                             fake_member("l", 1, 4, ("b0", "b1", "b2", "b3"))))


def fake_config(**overrides) -> MFSConfig:
    # 64 dims * 1 kv head * 2 (K,V) * 4 bytes = 256 bytes per token per layer; 1024-byte pages = 4 tokens
    base = {"pool.page_bytes": 1024, "pool.num_pages": 256, "pool.host_tier_mb": 0, "scheduler.max_batch_tokens": 64,
            "scheduler.prefill_chunk_tokens": 16, "scheduler.request_timeout_s": None}
    base.update(overrides)
    return load_system_config(base)       # comparison.* overrides compose a compared system (eval/composition.py)


def fake_vocab() -> list[str]:
    return [f"w{i}" for i in range(VOCAB_SIZE)]


class FakeExecutor:
    """Implements StepExecutor over a dict arena; checks every attended position's page contents."""

    def __init__(self, family: FamilySpec, num_pages: int, page_bytes: int, low_confidence_members=()):
        self.family = family
        self.num_pages = num_pages
        self.page_bytes = page_bytes
        self.slots: dict[tuple[PageId, int], tuple[int, int]] = {}    # (page, slot) -> (token, position)
        self.low_confidence = set(low_confidence_members)
        self.chunks_seen: list = []
        self.released: list = []
        self._context: dict[str, list[int]] = {}

    def _block(self, member: str) -> int:
        return self.family.member(member).tokens_per_block(self.page_bytes, 4)

    def execute(self, plan: StepPlan) -> list[SampledToken]:
        self.release(plan.released_requests)
        out = []
        for batch in plan.batches:
            size = self._block(batch.member)
            for chunk in batch.chunks:
                self.chunks_seen.append((batch.member, chunk))
                context = self._context.setdefault(chunk.request_id, [])
                del context[chunk.start_pos:]
                # every position before the chunk must already hold the right token on every layer
                for layer, table in enumerate(chunk.block_tables):
                    for pos in range(chunk.start_pos):
                        got = self.slots.get((table[pos // size], pos % size))
                        assert got is not None and got[1] == pos, (
                            f"{chunk.request_id} layer {layer} pos {pos}: page holds {got}")
                        if len(context) <= pos:
                            context.append(got[0])
                        assert context[pos] == got[0], f"{chunk.request_id} layer {layer} pos {pos}: {got}"
                for offset, token in enumerate(chunk.token_ids):
                    pos = chunk.start_pos + offset
                    for layer, table in enumerate(chunk.block_tables):
                        if layer < chunk.start_layer:   # handover: lower layers must already be there
                            got = self.slots.get((table[pos // size], pos % size))
                            assert got == (token, pos), f"shared layer {layer} pos {pos}: {got} != {(token, pos)}"
                        else:
                            self.slots[(table[pos // size], pos % size)] = (token, pos)
                    if chunk.start_layer:
                        got = self.slots.get((chunk.residual_table[pos // size], pos % size))
                        assert got == (token, pos), f"residual pos {pos}: {got} != {(token, pos)}"
                    if chunk.residual_table_out is not None:
                        self.slots[(chunk.residual_table_out[pos // size], pos % size)] = (token, pos)
                    context.append(token)
                if chunk.sample:
                    token = (sum(context[-3:]) * 7 + 3) % (VOCAB_SIZE - 3) + 3   # never EOS
                    confident = batch.member not in self.low_confidence
                    out.append(SampledToken(request_id=chunk.request_id, token_id=token, logprob=-0.1,
                                            top1_prob=0.9 if confident else 0.05, top_logprobs=(),
                                            num_drafted=0))
        return out

    def read_page(self, page: PageId) -> bytes:
        data = {str(slot): value for (p, slot), value in self.slots.items() if p == page}
        return json.dumps(data).encode()

    def write_page(self, page: PageId, data: bytes) -> None:
        for slot, value in json.loads(data).items():
            self.slots[(page, int(slot))] = tuple(value)

    def release(self, request_ids) -> None:
        self.released.extend(request_ids)
