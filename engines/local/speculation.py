"""Self-speculation in a nested family: a decode on a large member drafts tokens with the smallest member
nested in it (its lower layers, the same norm and head) and checks them in the step's own forward.

A chunk with draft_tokens = k at position p: the drafter runs k one-token passes (positions p .. p+k-1, its
layers only), each proposing the next token greedily; the chunk then enters the step's forward as k + 1
one-token rows (the last real token and the k drafts at positions p .. p+k), all layers, so every row reads
the keys written by the rows before it in the same layer (the forward writes a layer's K/V before it attends).
The member's greedy token after row j is taken while row j's input was right: row 0 always, row j > 0 when
draft j equals the member's token after row j - 1. Rows past the first wrong draft wrote K/V and residuals the
core does not count as computed; the next step writes those positions again. The tokens are the member's own
greedy tokens: speculation changes the cost of a step, never its output."""
from __future__ import annotations

from dataclasses import replace

from orchestrator.core.types import RequestId, SampledToken, SeqChunk

from engines.local.arena import KVArena
from engines.local.model import PagedCausalLM


def speculating(chunk: SeqChunk) -> bool:
    return chunk.draft_tokens > 0 and chunk.sample and len(chunk.token_ids) == 1 and chunk.start_layer == 0 \
        and chunk.sampling.temperature == 0 and not chunk.sampling.penalized    # the drafter's argmax is raw


def draft(drafter: PagedCausalLM, arena: KVArena, chunks: list[SeqChunk]) -> dict[RequestId, list[int]]:
    """Runs the drafter over every chunk at once, one pass per drafted position (a chunk stops after its own
    draft_tokens); returns each request's proposed tokens."""
    depth = drafter.config.num_layers
    drafted: dict[RequestId, list[int]] = {c.request_id: [] for c in chunks}
    for step in range(max(c.draft_tokens for c in chunks)):
        active = [c for c in chunks if c.draft_tokens > step]
        rows = [SeqChunk(request_id=c.request_id, token_ids=[(drafted[c.request_id] or c.token_ids)[-1]],
                         start_pos=c.start_pos + step, block_tables=c.block_tables[:depth], sample=True,
                         sampling=c.sampling)
                for c in active]
        for chunk, token in zip(active, drafter.forward(arena, rows).argmax(dim=-1).tolist()):
            drafted[chunk.request_id].append(token)
    return drafted


def rows_of(chunk: SeqChunk, drafts: list[int]) -> list[SeqChunk]:
    """The chunk as 1 + len(drafts) one-token rows at consecutive positions (same tables and residual pages)."""
    return [replace(chunk, token_ids=[token], start_pos=chunk.start_pos + j, num_generated=chunk.num_generated + j,
                    draft_tokens=0)
            for j, token in enumerate([chunk.token_ids[0], *drafts])]


def accepted(tokens: list[SampledToken], drafts: list[int]) -> list[SampledToken]:
    """tokens: the member's token after each row (len(drafts) + 1). Keeps them while the row's input was right."""
    kept = [tokens[0]]
    for j, proposal in enumerate(drafts):
        if proposal != tokens[j].token_id:
            break
        kept.append(tokens[j + 1])
    return kept
