"""LocalExecutor: the embedded StepExecutor: every member's weights, ONE arena, a sampler; runs step plans."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from orchestrator.family import FamilySpec
from orchestrator.types import PageId, RequestId, SampledToken, StepPlan

from engines.local.arena import KVArena
from engines.local.checkpoint import TORCH_DTYPES, LayerWeights, load_checkpoint
from engines.local.model import PagedCausalLM
from engines.local.sampler import Sampler


class LocalExecutor:
    """Implements orchestrator.engine_api.StepExecutor. All decisions come in the plan; this owns tensors only."""

    def __init__(self, family: FamilySpec, num_pages: int, page_bytes: int, dtype: str = "float32",
                 device: str = "cpu", num_threads: int | None = None) -> None:
        if dtype not in TORCH_DTYPES:
            raise ValueError(f"dtype {dtype!r} is not supported (supported: {', '.join(TORCH_DTYPES)})")
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        self.family = family
        self.num_pages = num_pages
        self.page_bytes = page_bytes
        self.dtype = dtype
        self.device = torch.device(device)
        self.arena = KVArena(num_pages, page_bytes, self.device)
        self.sampler = Sampler(self.device)
        self.models: dict[str, PagedCausalLM] = {}
        # same lineage = same weights for that layer (and all below): load once, share the tensors
        by_lineage: dict[str, LayerWeights] = {}
        shared: dict[int, torch.Tensor] = {}          # a tied head's [in, out] copy, once per embedding
        for member in family.members:
            reuse = {l: by_lineage[lin] for l, lin in enumerate(member.layer_lineages) if lin in by_lineage}
            weights = load_checkpoint(member.checkpoint_dir, dtype=dtype, device=self.device, reuse_layers=reuse)
            for lineage, layer in zip(member.layer_lineages, weights.layers):
                by_lineage.setdefault(lineage, layer)
            self.models[member.name] = PagedCausalLM(member, weights, dtype, shared=shared)

    def model(self, member_name: str) -> PagedCausalLM:
        return self.models[member_name]

    def member_context_tokens(self, member_name: str) -> int:
        return self.family.member(member_name).context_tokens

    def tokens_per_block(self, member_name: str) -> int:
        return self.models[member_name].block_tokens(self.arena)

    def execute(self, plan: StepPlan) -> list[SampledToken]:
        """Page loads were already written by the caller; runs each member batch once, samples, returns tokens
        in chunk order across batches."""
        self.release(plan.released_requests)
        sampled: list[SampledToken] = []
        for batch in plan.batches:
            if not batch.chunks:
                continue
            model = self.models[batch.member]
            logits = model.forward(self.arena, batch.chunks)          # [num_sampling_chunks, vocab]
            sampling_chunks = [c for c in batch.chunks if c.sample]
            sampled.extend(self.sampler.sample(logits, sampling_chunks, model.member.eos_token_ids))
        return sampled

    def read_page(self, page: PageId) -> bytes:
        return self.arena.read_page(page)

    def write_page(self, page: PageId, data: bytes) -> None:
        self.arena.write_page(page, data)

    def release(self, request_ids: Sequence[RequestId]) -> None:
        self.sampler.release(request_ids)
        for model in self.models.values():
            model.forget(request_ids)
