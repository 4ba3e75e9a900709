"""PagedCausalLM: one member's Llama/Qwen2 forward over the shared arena, all chunks of a step in one varlen pass
(chunks of nested smaller members too: each leaves at its own exit depth)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from orchestrator.core.family import MemberSpec
from orchestrator.core.types import SeqChunk

from engines.local.arena import KVArena
from engines.local.attention import AttnGroup, attend, decode_group, prefill_group
from engines.local.checkpoint import CheckpointWeights, LayerWeights
from engines.local.layer_kernels import LayerKernels
from engines.local.paged_decode import PagedDecodeKernel


_TABLE_CACHE_LIMIT = 4096     # requests whose table tensors are kept; release() normally drops them first


@dataclass(slots=True)
class _Segment:
    """Layers [first_layer, end_layer) run over the same set of chunks (chunks join at their start_layer and
    leave at their exit depth). Per-layer lists are indexed by layer - first_layer."""

    first_layer: int
    end_layer: int
    rows: torch.Tensor | None       # [t] rows of the step's hidden buffer; None = every row
    kv_pages: torch.Tensor          # [layers, t] int64: the page each row's K and V go to, per layer
    kv_slots: torch.Tensor          # [t] int64: the slot within that page
    writes: list[tuple[torch.Tensor, ...]] | None  # torch path, per layer: (page, K-or-V, slot) of K rows then V rows
    cos: torch.Tensor               # [t, 1, head_dim]
    sin: torch.Tensor               # [t, 1, head_dim], first half negated (see _rope)
    groups: list[AttnGroup]


@dataclass(slots=True)
class _KMajor:
    """A layer's matmul weights as [in, out] (x @ w): CPU BLAS runs this layout ~25% faster than F.linear's."""

    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    gate_up: torch.Tensor
    down: torch.Tensor
    input_norm: torch.Tensor
    post_norm: torch.Tensor


def _k_major(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> [in, out] contiguous; a weight already stored that way is only viewed."""
    transposed = weight.t()
    return transposed if transposed.is_contiguous() else transposed.contiguous()


def _prepare_layer(w: LayerWeights) -> _KMajor:
    """Rebinds the layer's fields to views of the [in, out] storage, so a layer shared by several members
    (same lineage) is transposed once and the [out, in] copy is freed."""
    qkv, o, gate_up, down = _k_major(w.qkv), _k_major(w.o), _k_major(w.gate_up), _k_major(w.down)
    w.qkv, w.o, w.gate_up, w.down = qkv.t(), o.t(), gate_up.t(), down.t()
    return _KMajor(qkv=qkv, qkv_bias=w.qkv_bias, o=o, o_bias=w.o_bias, gate_up=gate_up, down=down,
                   input_norm=w.input_norm, post_norm=w.post_norm)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)          # one op on the hot path
    # float32 statistics, as transformers does, so fp16/bf16 match it too
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rope; signed_sin carries the minus of the first half, so the rotation is a plain roll."""
    return torch.roll(x, x.shape[-1] // 2, dims=-1).mul_(signed_sin).addcmul_(x, cos)


def _padded(table: list, num_blocks: int) -> list:
    return (list(table[:num_blocks]) + [0] * num_blocks)[:num_blocks]


class PagedCausalLM:
    """One member's weights plus the paged forward. Holds no KV: every forward gets the arena."""

    def __init__(self, member: MemberSpec, weights: CheckpointWeights, dtype: str = "float32",
                 shared: dict[int, torch.Tensor] | None = None,
                 decode_kernel: PagedDecodeKernel | None = None,
                 layer_kernels: LayerKernels | None = None) -> None:
        """decode_kernel: decode attention read in place from the pages (None: gather + SDPA).
        layer_kernels: RMSNorm, rope with the K/V write, and SiLU-and-multiply each as one native call
        (None: torch operators)."""
        config = weights.config
        if (config.num_layers, config.hidden_size, config.num_kv_heads, config.head_dim) != (
                member.num_layers, member.hidden_size, member.num_kv_heads, member.head_dim):
            raise ValueError(f"member {member.name}: checkpoint shapes disagree with its MemberSpec")
        self.member = member
        self.weights = weights
        self.config = config
        self.dtype = dtype
        self.device = weights.embed.device
        self.torch_dtype = weights.embed.dtype
        self.num_groups = config.num_heads // config.num_kv_heads   # query heads per kv head
        self.layers = [_prepare_layer(w) for w in weights.layers]
        self.decode_kernel = decode_kernel
        self.layer_kernels = layer_kernels if dtype == "float32" and self.device.type == "cpu" else None
        self._table_cache: dict[str, tuple[list[list[int]], torch.Tensor]] = {}
        # a tied head stays the embedding (lookups want rows); its [in, out] copy is shared between members
        shared = {} if shared is None else shared
        if weights.lm_head is weights.embed:
            self.head = shared.setdefault(id(weights.embed), _k_major(weights.embed))
        else:
            self.head = _k_major(weights.lm_head)
            weights.lm_head = self.head.t()

    def block_tokens(self, arena: KVArena) -> int:
        return self.member.tokens_per_block(arena.page_bytes, self.torch_dtype.itemsize)

    @torch.inference_mode()
    def forward(self, arena: KVArena, chunks: list[SeqChunk], all_logits: bool = False,
                exits: Sequence[int] | None = None) -> torch.Tensor:
        """Runs every chunk; returns float32 logits [num_sampling_chunks, vocab] (last position of each chunk
        with sample=True, in chunk order) or, with all_logits, [total_new_tokens, vocab] in chunk order.
        exits: per chunk, the depth it leaves at (default: all layers); a chunk with exit e belongs to a member
        nested in this one (layers 0..e-1 and the embedding, norm and head identical: the caller checks) and has
        e block tables; its logits and residual_table_out are taken at depth e."""
        if not chunks:
            return torch.empty(0, self.config.vocab_size, device=self.device)
        exits = [self.config.num_layers] * len(chunks) if exits is None else list(exits)
        if len(exits) != len(chunks) or not all(0 < e <= self.config.num_layers for e in exits):
            raise ValueError(f"exits {exits} must give each of {len(chunks)} chunks a depth in "
                             f"[1, {self.config.num_layers}]")
        kv_view = arena.kv_view(self.member, self.dtype)
        block = kv_view.shape[2]
        kv_rows = (kv_view[:, 0].flatten(1), kv_view[:, 1].flatten(1))   # K, V: [pages, B * kv_heads * dim] views
        lengths = [len(c.token_ids) for c in chunks]
        if min(lengths) < 1:
            raise ValueError("every chunk needs at least one token")
        offsets = [0]
        for n in lengths:
            offsets.append(offsets[-1] + n)
        hidden = self._input_hidden(arena, chunks, offsets, block)     # [T, hidden]
        for segment in self._segments(chunks, exits, offsets, block):
            x = hidden if segment.rows is None else hidden[segment.rows]
            for layer in range(segment.first_layer, segment.end_layer):
                x = self._layer(self.layers[layer], layer - segment.first_layer, x, segment, kv_view, kv_rows)
            if segment.rows is None:
                hidden = x
            else:
                hidden[segment.rows] = x
        self._write_residuals(arena, chunks, offsets, block, hidden)
        last_rows = [offsets[i + 1] - 1 for i, c in enumerate(chunks) if c.sample]
        if all_logits or len(last_rows) == offsets[-1]:               # every row is wanted: no gather
            rows = hidden
        else:
            rows = hidden[torch.tensor(last_rows, dtype=torch.long, device=self.device)]
        normed = self._norm(rows, self.weights.norm)
        return torch.mm(normed, self.head).float()

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.layer_kernels is not None:
            out = self.layer_kernels.rms_norm(x, weight, self.config.rms_norm_eps)
            if out is not None:
                return out
        return _rms_norm(x, weight, self.config.rms_norm_eps)

    def _input_hidden(self, arena: KVArena, chunks: list[SeqChunk], offsets: list[int], block: int) -> torch.Tensor:
        token_ids = torch.tensor([t for c in chunks for t in c.token_ids], device=self.device)
        hidden = F.embedding(token_ids, self.weights.embed)
        for i, chunk in enumerate(chunks):
            if chunk.start_layer == 0:
                continue
            residual = arena.residual_view(self.member, self.dtype)
            if residual is None or chunk.residual_table is None:
                raise ValueError(f"chunk {chunk.request_id}: start_layer {chunk.start_layer} needs residual "
                                 "pages that fit the arena's page size")
            pages, slots = self._residual_index(chunk, chunk.residual_table, block)
            hidden[offsets[i]:offsets[i + 1]] = residual[pages, slots]
        return hidden

    def _write_residuals(self, arena: KVArena, chunks: list[SeqChunk], offsets: list[int], block: int,
                         hidden: torch.Tensor) -> None:
        for i, chunk in enumerate(chunks):
            if chunk.residual_table_out is None:
                continue
            residual = arena.residual_view(self.member, self.dtype)
            if residual is None:
                raise ValueError(f"chunk {chunk.request_id}: residual blocks do not fit the arena's page size")
            pages, slots = self._residual_index(chunk, chunk.residual_table_out, block)
            residual[pages, slots] = hidden[offsets[i]:offsets[i + 1]]

    def _residual_index(self, chunk: SeqChunk, table: list, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        positions = range(chunk.start_pos, chunk.start_pos + len(chunk.token_ids))
        pages = torch.tensor([table[p // block] for p in positions], device=self.device)
        return pages, torch.tensor([p % block for p in positions], device=self.device)

    def _segments(self, chunks: list[SeqChunk], exits: list[int], offsets: list[int], block: int) -> list[_Segment]:
        """A new segment wherever a chunk joins (start_layer) or leaves (exit): rows that left keep their
        hidden state at their exit depth."""
        for chunk, exit_depth in zip(chunks, exits):
            if len(chunk.block_tables) != exit_depth:
                raise ValueError(f"chunk {chunk.request_id}: {len(chunk.block_tables)} block tables for "
                                 f"{exit_depth} layers")
        bounds = sorted({c.start_layer for c in chunks} | set(exits))
        segments = []
        for first, end in zip(bounds, bounds[1:]):
            active = [i for i, (c, e) in enumerate(zip(chunks, exits)) if c.start_layer <= first and end <= e]
            if active:
                segments.append(self._segment(chunks, offsets, active, first, end, block))
        return segments

    def _segment(self, chunks: list[SeqChunk], offsets: list[int], active: list[int], first: int, end: int,
                 block: int) -> _Segment:
        """Every index tensor the segment's layers need, built once (per-layer work is then only indexing)."""
        device = self.device
        counts, starts, num_blocks = [], [], []
        for i in active:
            chunk = chunks[i]
            total = chunk.start_pos + len(chunk.token_ids)
            blocks = -(-total // block)
            for layer in range(first, end):
                if len(chunk.block_tables[layer]) < blocks:
                    raise ValueError(f"chunk {chunk.request_id}: layer {layer} has {len(chunk.block_tables[layer])} "
                                     f"pages, positions up to {total} need {blocks}")
            counts.append(len(chunk.token_ids))
            starts.append(chunk.start_pos)
            num_blocks.append(blocks)
        widest = max(num_blocks)
        tables = self._tables([chunks[i] for i in active], widest, first, end)   # [chunks, end - first, widest]
        positions = [p for s, n in zip(starts, counts) for p in range(s, s + n)]
        position_tensor = torch.tensor(positions, device=device)
        t = len(positions)
        owner = torch.tensor([c for c, n in enumerate(counts) for _ in range(n)], device=device)
        slots = position_tensor % block
        kv_pages = tables[owner, :, position_tensor // block].t().contiguous()        # [layers, t]
        writes = None if self.layer_kernels is not None else self._torch_writes(kv_pages, slots)
        groups, decode, decode_rows, row0 = [], [], [], 0
        for c, (n, start) in enumerate(zip(counts, starts)):
            if n == 1:
                decode.append(c)
                decode_rows.append(row0)
            else:
                groups.append(prefill_group(row0, n, start, tables[c, :, :num_blocks[c]], self.num_groups,
                                            self.torch_dtype))
            row0 += n
        if decode:
            groups.append(decode_group(decode, decode_rows, tables, [starts[c] + 1 for c in decode],
                                       max(num_blocks[c] for c in decode), t, self.torch_dtype))
        every_row = len(active) == len(chunks)
        rows = None if every_row else torch.cat([torch.arange(offsets[i], offsets[i + 1]) for i in active]).to(device)
        freqs = position_tensor[:, None].float() * self.weights.inv_freq[None, :]   # [t, head_dim // 2]
        angles = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        signed_sin = torch.cat((-freqs[:, None, :].sin(), freqs[:, None, :].sin()), dim=-1)
        return _Segment(first_layer=first, end_layer=end, rows=rows, kv_pages=kv_pages, kv_slots=slots, writes=writes,
                        cos=angles.cos().to(self.torch_dtype), sin=signed_sin.to(self.torch_dtype), groups=groups)

    @staticmethod
    def _torch_writes(kv_pages: torch.Tensor, slots: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
        """Per layer, the index_put_ index of the segment's K rows then V rows: (page, K-or-V, slot)."""
        t = slots.shape[0]
        kind = torch.arange(2, device=slots.device).repeat_interleave(t)
        slots2 = slots.repeat(2)
        return [(pages, kind, slots2) for pages in kv_pages.repeat(1, 2).unbind(0)]

    def _tables(self, chunks: list[SeqChunk], widest: int, first: int, end: int) -> torch.Tensor:
        """[chunks, end - first, widest] page ids of layers [first, end) (0-padded). A request's table tensor is
        kept between steps and rebuilt only when its block tables changed (a decode changes them once per block)."""
        if len(self._table_cache) > _TABLE_CACHE_LIMIT:
            self._table_cache.clear()
        columns = []
        for chunk in chunks:
            cached = self._table_cache.get(chunk.request_id)
            if cached is None or cached[0] != chunk.block_tables:
                width = max(len(t) for t in chunk.block_tables)
                tensor = torch.tensor([_padded(t, width) for t in chunk.block_tables], device=self.device).t()
                cached = ([list(t) for t in chunk.block_tables], tensor)        # a copy: the core appends in place
                self._table_cache[chunk.request_id] = cached
            columns.append(cached[1][:, first:end])                             # [width, end - first]
        return pad_sequence(columns, batch_first=True)[:, :widest].transpose(1, 2)

    def forget(self, request_ids) -> None:
        for request_id in request_ids:
            self._table_cache.pop(request_id, None)

    def _layer(self, w: _KMajor, layer: int, x: torch.Tensor, segment: _Segment, kv_view: torch.Tensor,
               kv_rows: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """layer: index within the segment (its writes and pages)."""
        config = self.config
        t, heads, kv_heads, dim = x.shape[0], config.num_heads, config.num_kv_heads, config.head_dim
        kernels = self.layer_kernels
        normed = self._norm(x, w.input_norm)
        qkv = torch.mm(normed, w.qkv) if w.qkv_bias is None else torch.addmm(w.qkv_bias, normed, w.qkv)
        # write first, then read every position back from the pages: one code path for cached and new keys
        if kernels is not None and kernels.rope_write_kv(qkv, heads, kv_heads, dim, segment.cos, segment.sin,
                                                         kv_view, segment.kv_pages[layer], segment.kv_slots):
            q = qkv[:, :heads * dim].view(t, heads, dim)           # roped in place
        else:
            # rope q and k together: one set of ops for both
            qk = _rope(qkv[:, :(heads + kv_heads) * dim].view(t, heads + kv_heads, dim), segment.cos, segment.sin)
            q, k = qk[:, :heads], qk[:, heads:]
            v = qkv[:, (heads + kv_heads) * dim:].view(t, kv_heads, dim)
            if segment.writes is None:
                segment.writes = self._torch_writes(segment.kv_pages, segment.kv_slots)
            kv_view.index_put_(segment.writes[layer], torch.cat((k, v)))
        only = segment.groups[0] if len(segment.groups) == 1 else None
        if only is not None and isinstance(only.rows, slice) and only.rows == slice(0, t):   # no scatter needed
            out = attend(q, kv_rows, only, layer, kv_heads, dim, kv_view, self.decode_kernel)
        else:
            out = q.new_empty(t, heads, dim)
            for group in segment.groups:
                out[group.rows] = attend(q[group.rows], kv_rows, group, layer, kv_heads, dim, kv_view,
                                         self.decode_kernel)
        attended = out.reshape(t, heads * dim)
        # residual adds fused into the matmuls
        x = torch.addmm(x, attended, w.o) if w.o_bias is None else torch.addmm(x + w.o_bias, attended, w.o)
        gate_up = torch.mm(self._norm(x, w.post_norm), w.gate_up)
        activated = kernels.silu_mul(gate_up) if kernels is not None else None
        if activated is None:
            gate, up = gate_up.chunk(2, dim=-1)
            activated = F.silu(gate).mul_(up)
        return torch.addmm(x, activated, w.down)
