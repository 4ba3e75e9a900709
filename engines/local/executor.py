"""LocalExecutor: the embedded StepExecutor: every member's weights, ONE arena, a sampler; runs step plans."""
from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from orchestrator.core.config import MFSConfig
from orchestrator.core.family import FamilySpec, MemberSpec
from orchestrator.core.draft_length import plan_forwards
from orchestrator.core.errors import RequestFault
from orchestrator.core.types import ForwardShape, MemberBatch, PageId, RequestId, SampledToken, SeqChunk, StepPlan

from engines.local.arena import KVArena
from engines.local.checkpoint import TORCH_DTYPES, LayerWeights, load_checkpoint
from engines.local.layer_kernels import LayerKernels
from engines.local.malloc_tuning import tune_malloc
from engines.local.model import PagedCausalLM
from engines.local.paged_decode import PagedDecodeKernel
from engines.local.sampler import Sampler
from engines.local.speculation import Drafts, accept, check_draft, check_ride, draft, verify_rows
from engines.local.step_costs import MeasuredStepCosts, ride


def nests_in(small: PagedCausalLM, large: PagedCausalLM) -> bool:
    """small is large's lower layers: same lineages for its layers (lineage covers embedding, rope and every
    layer below) and equal final norm and head, which the lineage does not cover."""
    a, b = small.config, large.config
    n = small.member.num_layers
    return (small.member.layer_lineages == large.member.layer_lineages[:n]
            and (a.arch, a.hidden_size, a.num_heads, a.num_kv_heads, a.head_dim, a.vocab_size, a.rms_norm_eps)
            == (b.arch, b.hidden_size, b.num_heads, b.num_kv_heads, b.head_dim, b.vocab_size, b.rms_norm_eps)
            and small.torch_dtype == large.torch_dtype
            and all(torch.equal(x, y) for x, y in ((small.weights.embed, large.weights.embed),
                                                  (small.weights.norm, large.weights.norm),
                                                  (small.head, large.head),
                                                  (small.weights.inv_freq, large.weights.inv_freq))))


def merge_groups(members: list[MemberSpec], nested_pairs: set[tuple[str, str]]) -> list[tuple[str, list[int]]]:
    """(host member, batch indices in plan order) per forward, forwards in plan order of their first batch:
    each batch joins the largest host it nests in (nothing nests: one forward per batch, as listed)."""
    order = sorted(range(len(members)), key=lambda i: -members[i].num_layers)   # stable: plan order on ties
    groups: dict[str, list[int]] = {}
    for i in order:
        name = members[i].name
        host = next((h for h in groups if h == name or (name, h) in nested_pairs), name)
        groups.setdefault(host, []).append(i)
    return sorted(((host, sorted(indices)) for host, indices in groups.items()), key=lambda g: g[1][0])


_KEYS_PER_ROW_COST = 256         # keys one row attends to that cost about as much as its matmuls (tiny-l, CPU)


def split_point(chunks: list[SeqChunk]) -> int:
    """Where to cut a step's chunks in two parts of about equal cost (0: do not split). Cost of a chunk: its
    rows through the matmuls plus, for attention, the keys each row reads (a decode at 160 tokens of context
    costs about 1.6 rows, a 128-token prefill chunk about 128 x 1.5)."""
    if len(chunks) < 2:
        return 0
    costs = [len(c.token_ids) * (1.0 + (c.start_pos + len(c.token_ids)) / _KEYS_PER_ROW_COST) for c in chunks]
    half, running = sum(costs) / 2, 0.0
    for i, cost in enumerate(costs[:-1]):
        if running + cost / 2 >= half:
            return max(i, 1)
        running += cost
    return len(chunks) - 1


class LocalExecutor:
    """Implements orchestrator.core.engine_api.StepExecutor. All decisions come in the plan; this owns tensors only."""

    def __init__(self, family: FamilySpec, num_pages: int, page_bytes: int, dtype: str = "float32",
                 device: str = "cpu", num_threads: int | None = None, merge_nested: bool = True,
                 malloc_mmap_threshold_mb: int = 32, native_attention: bool = True,
                 parallel_forwards: int = 1, native_layer_ops: bool = True, measure_steps: bool = False,
                 drafts_ride: bool = True) -> None:
        """malloc_mmap_threshold_mb: see engines/local/malloc_tuning.py (process-wide; 0 = glibc defaults).
        native_attention: float32 CPU decodes read K/V in place from the pages (engines/local/paged_decode.py;
        compiled on first use, the torch path where no C compiler exists).
        native_layer_ops: float32 CPU forwards run RMSNorm, rope with the K/V write and SiLU-and-multiply as one
        native call each (engines/local/layer_kernels.py; the torch path where no C compiler exists).
        parallel_forwards: 2 splits each CPU forward of two or more chunks in two halves run on two threads.
        measure_steps: time every step and fit what steps cost (`step_costs`, engines/local/step_costs.py), which
        the core prices speculation's draft length with (EngineCore.attach_executor); off, it drafts a fixed length.
        drafts_ride: a drafting member's own batch (with no nested host in the step) runs in its drafts' catch-up
        forward instead of a forward of its own (run_drafts)."""
        if dtype not in TORCH_DTYPES:
            raise ValueError(f"dtype {dtype!r} is not supported (supported: {', '.join(TORCH_DTYPES)})")
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        self.malloc_tuned = tune_malloc(malloc_mmap_threshold_mb)
        self.family = family
        self.num_pages = num_pages
        self.page_bytes = page_bytes
        self.dtype = dtype
        self.device = torch.device(device)
        self.arena = KVArena(num_pages, page_bytes, self.device)
        self.sampler = Sampler(self.device)
        if parallel_forwards not in (1, 2):
            raise ValueError(f"parallel_forwards must be 1 or 2, got {parallel_forwards}")
        self._helper = (ThreadPoolExecutor(1, thread_name_prefix="mfs-forward")
                        if parallel_forwards == 2 and self.device.type == "cpu" else None)
        self.models: dict[str, PagedCausalLM] = {}
        self.drafts_ride = drafts_ride
        self.step_costs = MeasuredStepCosts(family.member_names, self.riders_of) if measure_steps else None
        self.last_riders: frozenset[str] = frozenset()     # the members whose batch rode in the last step
        uses_kernel = native_attention and dtype == "float32" and self.device.type == "cpu"
        self.decode_kernel = PagedDecodeKernel.load() if uses_kernel else None
        on_cpu_f32 = dtype == "float32" and self.device.type == "cpu"
        self.layer_kernels = LayerKernels.load() if native_layer_ops and on_cpu_f32 else None
        # same lineage = same weights for that layer (and all below): load once, share the tensors
        by_lineage: dict[str, LayerWeights] = {}
        shared: dict[int, torch.Tensor] = {}          # a tied head's [in, out] copy, once per embedding
        for member in family.members:
            reuse = {l: by_lineage[lin] for l, lin in enumerate(member.layer_lineages) if lin in by_lineage}
            weights = load_checkpoint(member.checkpoint_dir, dtype=dtype, device=self.device, reuse_layers=reuse)
            for lineage, layer in zip(member.layer_lineages, weights.layers):
                by_lineage.setdefault(lineage, layer)
            self.models[member.name] = PagedCausalLM(member, weights, dtype, shared=shared,
                                                     decode_kernel=self.decode_kernel,
                                                     layer_kernels=self.layer_kernels)
        # (smaller, larger) pairs whose batches may run as one forward on the larger model; checked once here
        self.nested_pairs: set[tuple[str, str]] = set()
        if merge_nested:
            self.nested_pairs = {(a.name, b.name) for a in family.members for b in family.members
                                 if a.num_layers < b.num_layers and nests_in(self.models[a.name], self.models[b.name])}

    def model(self, member_name: str) -> PagedCausalLM:
        return self.models[member_name]

    def tokens_per_block(self, member_name: str) -> int:
        return self.models[member_name].block_tokens(self.arena)

    def execute(self, plan: StepPlan) -> list[SampledToken]:
        """Page loads were already written by the caller; runs the drafts of chunks that speculate
        (engines/local/speculation.py), then one forward per group of nested member batches (one per batch when
        nothing nests; each split in two on two threads with parallel_forwards), samples per batch, returns
        tokens in chunk order across batches (a drafting chunk's 1 to k + 1 tokens in order, in its place).
        Raises RequestFault, once every other request is sampled, when some requests' own sampling failed."""
        began = time.perf_counter()
        sampled = self._execute(plan)
        if self.step_costs is not None:
            self.step_costs.observe(ride(plan_forwards(plan), self.last_riders), time.perf_counter() - began)
        faults = self.sampler.take_faults()
        if faults:
            raise RequestFault(faults, [token for token in sampled if token.request_id not in faults])
        return sampled

    def may_ride(self, members: list[str], groups: list[tuple[str, list[int]]] | None = None) -> dict[str, int]:
        """member -> index, for the batches (members in plan order; groups: their merge_groups, where known) that
        may ride in their member's drafts' catch-up forward: each with a forward of its own, with drafts_ride."""
        if not self.drafts_ride:
            return {}
        if groups is None:
            groups = merge_groups([self.models[m].member for m in members], self.nested_pairs)
        return {members[indices[0]]: indices[0] for _, indices in groups if len(indices) == 1}

    def riders_of(self, forwards: Sequence[ForwardShape]) -> set[str]:
        """The members whose own batch a step of these forwards would run in their drafts' catch-up forward, as
        _execute and run_drafts decide it: a batch that may ride, of a drafting member, verifying nothing itself."""
        drafting = {f.member for f in forwards if f.is_draft}
        batches = [f for f in forwards if not f.is_draft]
        alone = self.may_ride([f.member for f in batches])
        return {f.member for f in batches if f.member in alone and f.member in drafting and not f.verifies}

    def _execute(self, plan: StepPlan) -> list[SampledToken]:
        self.sampler.take_faults()                                # none of a step that failed as a whole
        self.release(plan.released_requests)
        batches = [b for b in plan.batches if b.chunks]
        groups = merge_groups([self.models[b.member].member for b in batches], self.nested_pairs)
        # a drafting member's own batch with a forward of its own runs in its drafts' catch-up forward
        alone = self.may_ride([b.member for b in batches], groups)
        # request -> its drafts; rider batch -> its logits; request -> the tokens it took riding the draft forwards
        drafted, logits, rode = self.run_drafts(batches, alone)
        self.last_riders = frozenset(batches[i].member for i in logits)
        whole = batches
        if rode:                                                  # chunks that rode are done: no rows of their own
            batches = [MemberBatch(b.member, [c for c in b.chunks if not c.ride_tokens]) for b in batches]
        rows = batches
        if drafted:                                               # a drafting chunk becomes its k + 1 verify rows
            rows = [MemberBatch(b.member, [r for c in b.chunks for r in (
                verify_rows(c, drafted[c.request_id].tokens) if c.draft is not None else (c,))]) for b in batches]
        for host, indices in groups:
            if len(indices) == 1 and indices[0] in logits:
                continue                                          # it rode in its drafts' catch-up forward
            chunks = [c for i in indices for c in rows[i].chunks]
            if not chunks:
                for i in indices:
                    logits[i] = torch.empty(0)
                continue                                          # every chunk rode the draft forwards
            exits = [self.models[rows[i].member].member.num_layers for i in indices for _ in rows[i].chunks]
            merged = self._forward(self.models[host], chunks, exits)
            row = 0
            for i in indices:                                     # split the rows back per batch
                count = sum(c.sample for c in rows[i].chunks)
                logits[i] = merged[row:row + count]
                row += count
        sampled: list[SampledToken] = []
        for i, batch in enumerate(batches):
            eos = self.models[batch.member].member.eos_token_ids
            if drafted and any(c.draft is not None for c in batch.chunks):
                tokens = self._sample_verifying(batch, logits[i], drafted)
            else:
                tokens = self.sampler.sample(logits[i], [c for c in batch.chunks if c.sample], eos)
            if rode and len(batch.chunks) < len(whole[i].chunks):
                tokens = _in_chunk_order(whole[i], tokens, rode)
            sampled.extend(tokens)
        return sampled

    def run_drafts(self, batches: list[MemberBatch], riders: dict[str, int] | None = None,
                   ) -> tuple[dict[RequestId, Drafts], dict[int, torch.Tensor], dict[RequestId, list[SampledToken]]]:
        """The drafts of every chunk with a DraftSpec, batched per drafting member (and the target's EOS ids,
        which min_tokens bans). riders: member -> index of its batch in `batches` that may ride in that member's
        catch-up forward (one read of its weights, not two: only one engine running the whole family can); the
        second value gives each batch that rode its logits [sampling rows, vocab]. A member's chunks with
        ride_tokens ride its draft forwards (engines/local/speculation.py); the third value gives their tokens."""
        jobs: dict[tuple[str, tuple[int, ...]], list[SeqChunk]] = {}
        decoders: dict[str, list[SeqChunk]] = {}
        for batch in batches:
            target = self.models[batch.member]
            for chunk in batch.chunks:
                if chunk.ride_tokens and chunk.draft is None:
                    check_ride(chunk, target.config.num_layers)
                    decoders.setdefault(batch.member, []).append(chunk)
                    continue
                if chunk.draft is None:
                    continue
                drafter = self.models.get(chunk.draft.member)
                if drafter is None or drafter.config.vocab_size != target.config.vocab_size:
                    raise ValueError(f"chunk {chunk.request_id}: {chunk.draft.member!r} cannot draft for "
                                     f"{batch.member!r} (not a member of this family with its vocabulary)")
                check_draft(chunk, drafter.config.num_layers)
                jobs.setdefault((chunk.draft.member, tuple(target.member.eos_token_ids)), []).append(chunk)
        for member in decoders:
            if not any(m == member for m, _ in jobs):
                jobs[(member, ())] = []         # decodes ride forwards of their own member even with no draft
        drafted: dict[RequestId, Drafts] = {}
        rode: dict[int, torch.Tensor] = {}
        ridden: dict[RequestId, list[SampledToken]] = {}
        for (member, eos), chunks in jobs.items():
            model = self.models[member]
            rider = (riders or {}).get(member)
            if rider is not None and (rider in rode or any(c.draft is not None for c in batches[rider].chunks)):
                rider = None                    # one job a member carries it; a drafting batch verifies later
            own = [c for c in batches[rider].chunks if not c.ride_tokens] if rider is not None else []
            if rider is not None and not own:
                rider = None                    # every chunk of the batch rides every forward
            got, logits, tokens = draft(
                model, lambda m, rows: self._forward(m, rows, [m.config.num_layers] * len(rows)), self.sampler,
                chunks, eos, own, decoders.pop(member, ()))
            drafted.update(got)
            ridden.update(tokens)
            if rider is not None and logits is not None:
                rode[rider] = logits
        return drafted, rode, ridden

    def _sample_verifying(self, batch: MemberBatch, logits: torch.Tensor,
                          drafted: dict[RequestId, Drafts]) -> list[SampledToken]:
        """A batch's tokens where some chunks verify drafts: the plain sampling chunks sampled together, each
        drafting chunk's rows through the acceptance rule; in chunk order."""
        member = self.models[batch.member].member
        eos = member.eos_token_ids
        plain_rows, plain_chunks = [], []
        row = 0
        for chunk in batch.chunks:
            if chunk.draft is not None:
                row += 1 + chunk.draft.num_tokens
            elif chunk.sample:
                plain_rows.append(row)
                plain_chunks.append(chunk)
                row += 1
        plain = ({t.request_id: t for t in self.sampler.sample(logits[plain_rows], plain_chunks, eos)}
                 if plain_chunks else {})
        out: list[SampledToken] = []
        row = 0
        for chunk in batch.chunks:
            if chunk.draft is not None:
                drafts = drafted[chunk.request_id]
                n = 1 + len(drafts.tokens)
                try:
                    out.extend(accept(self.sampler, logits[row:row + n], verify_rows(chunk, drafts.tokens), drafts,
                                      eos, member.context_tokens))
                except Exception as exc:                          # its own verification: it fails alone
                    self.sampler.fault(chunk, exc, logits.shape[-1])
                row += n
            elif chunk.sample:
                if chunk.request_id in plain:                     # not when its own sampling failed
                    out.append(plain[chunk.request_id])
                row += 1
        return out

    def _forward(self, model: PagedCausalLM, chunks: list[SeqChunk], exits: list[int]) -> torch.Tensor:
        """One forward, or (parallel_forwards) two over the chunks' first and second part at once: torch's ops
        and the native kernel release the GIL, so the second thread computes on another core. Chunks of one
        step belong to different requests and write disjoint page slots (a verifying request's rows stay in one
        half), so the halves never touch the same bytes; the logits come back in chunk order."""
        split = split_point(chunks) if self._helper is not None else 0
        while 0 < split < len(chunks) and chunks[split].request_id == chunks[split - 1].request_id:
            split += 1          # a verifying request's rows read each other's K/V: one half has them all
        if split == len(chunks):
            split = 0
        if split == 0:
            return model.forward(self.arena, chunks, exits=exits)
        second = self._helper.submit(model.forward, self.arena, chunks[split:], exits=exits[split:])
        try:
            first = model.forward(self.arena, chunks[:split], exits=exits[:split])
        finally:
            rest = second.result()                                # joined even when the first half failed
        return torch.cat((first, rest))

    def read_page(self, page: PageId) -> bytes:
        return self.arena.read_page(page)

    def write_page(self, page: PageId, data: bytes) -> None:
        self.arena.write_page(page, data)

    def release(self, request_ids: Sequence[RequestId]) -> None:
        self.sampler.release(request_ids)
        for model in self.models.values():
            model.forget(request_ids)


def executor_from_config(config: MFSConfig, family: FamilySpec, num_pages: int, page_bytes: int, *, device: str,
                         num_threads: int | None, parallel_forwards: int) -> LocalExecutor:
    """The LocalExecutor `config` asks for over an arena of num_pages pages of page_bytes: its dtype, the developer
    switches, and speculation's step costs and rides. Where it runs is the caller's (device, torch's threads,
    parallel forwards: the edge's engine and the Triton python backend decide them differently)."""
    developer, speculation = config.developer, config.speculation
    return LocalExecutor(family, num_pages=num_pages, page_bytes=page_bytes, dtype=config.engine.dtype,
                         device=device, num_threads=num_threads,
                         malloc_mmap_threshold_mb=developer.malloc_mmap_threshold_mb,
                         native_attention=developer.native_attention, native_layer_ops=developer.native_layer_ops,
                         parallel_forwards=parallel_forwards,
                         measure_steps=speculation.enabled, drafts_ride=speculation.drafts_ride)


def _in_chunk_order(batch: MemberBatch, tokens: list[SampledToken],
                    rode: dict[RequestId, list[SampledToken]]) -> list[SampledToken]:
    """A batch's tokens in its chunk order: those sampled from its forward (`tokens`, grouped by request) and those
    of the chunks that rode the draft forwards, each in its chunk's place."""
    by_request: dict[RequestId, list[SampledToken]] = {}
    for token in tokens:
        by_request.setdefault(token.request_id, []).append(token)
    out: list[SampledToken] = []
    for chunk in batch.chunks:
        got = rode.get(chunk.request_id) if chunk.ride_tokens else None
        out.extend(got if got is not None else by_request.get(chunk.request_id, ()))
    return out
