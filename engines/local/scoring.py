"""Log-likelihood of a token sequence's tail under one member (eval), via a prefill over a small private arena."""
from __future__ import annotations

import torch

from orchestrator.core.types import PageId, RequestId, SamplingParams, SeqChunk

from engines.local.arena import KVArena
from engines.local.executor import LocalExecutor
from engines.local.model import PagedCausalLM

_DEFAULT_BLOCK_TOKENS = 16


def score_tokens(executor_or_model: LocalExecutor | PagedCausalLM, member_name: str, token_ids: list[int],
                 start: int) -> list[float]:
    """log p(token_ids[i] | token_ids[:i]) for i in [start, len(token_ids)); start >= 1.

    Uses its own arena so the serving arena and its ledger are untouched.
    """
    if not 1 <= start <= len(token_ids):
        raise ValueError(f"start must be in [1, {len(token_ids)}], got {start}")
    if start == len(token_ids):
        return []
    logits = sequence_logits(executor_or_model, member_name, token_ids)    # [len - 1, vocab]
    logprobs = torch.log_softmax(logits[start - 1:], dim=-1)
    targets = torch.tensor(token_ids[start:], device=logprobs.device)
    return logprobs.gather(1, targets[:, None])[:, 0].tolist()


def sequence_logits(executor_or_model: LocalExecutor | PagedCausalLM, member_name: str,
                    token_ids: list[int]) -> torch.Tensor:
    """float32 logits [len(token_ids) - 1, vocab]: row i predicts token_ids[i + 1]."""
    model = executor_or_model.model(member_name) if isinstance(executor_or_model, LocalExecutor) \
        else executor_or_model
    if model.member.name != member_name:
        raise ValueError(f"model is member {model.member.name!r}, asked to score with {member_name!r}")
    if len(token_ids) < 2:
        raise ValueError("need at least two tokens")
    member, dtype_bytes = model.member, model.torch_dtype.itemsize
    page_bytes = (executor_or_model.page_bytes if isinstance(executor_or_model, LocalExecutor)
                  else _DEFAULT_BLOCK_TOKENS * member.kv_bytes_per_token_per_layer(dtype_bytes))
    block = member.tokens_per_block(page_bytes, dtype_bytes)
    num_positions = len(token_ids) - 1                 # the last token is only a target
    num_blocks = -(-num_positions // block)
    arena = KVArena(member.num_layers * num_blocks, page_bytes, model.device)
    tables = [[PageId(layer * num_blocks + b) for b in range(num_blocks)] for layer in range(member.num_layers)]
    chunk = SeqChunk(request_id=RequestId("score"), token_ids=list(token_ids[:-1]), start_pos=0,
                     block_tables=tables, sample=False, sampling=SamplingParams())
    return model.forward(arena, [chunk], all_logits=True)
