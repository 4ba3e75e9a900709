"""PagedCausalLM: one member's Llama/Qwen2 forward over the shared arena, all chunks of a step in one varlen pass."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from orchestrator.family import MemberSpec
from orchestrator.types import SeqChunk

from engines.local.arena import KVArena
from engines.local.checkpoint import CheckpointWeights, LayerWeights


@dataclass(slots=True)
class _AttnGroup:
    """Queries attended together: all single-token decodes, or one multi-token (prefill) chunk."""

    rows: torch.Tensor | slice      # the group's rows among the segment's tokens
    num_seqs: int
    q_tokens: int                   # new tokens per sequence (1 for the decode group)
    pages: torch.Tensor             # [num_layers, num_seqs * num_blocks] page ids (padding -> page 0, masked)
    num_blocks: int
    mask: torch.Tensor              # [num_seqs, 1, groups * q_tokens, num_blocks * B] bool, True = attend


@dataclass(slots=True)
class _Segment:
    """Layers [first_layer, end_layer) run over the same set of chunks (chunks join at their start_layer)."""

    first_layer: int
    end_layer: int
    rows: torch.Tensor | None       # [t] rows of the step's hidden buffer; None = every row
    write_pages: torch.Tensor       # [num_layers, t] page receiving each token's K/V per layer
    write_slots: torch.Tensor       # [t] slot inside that page
    cos: torch.Tensor               # [t, 1, head_dim]
    sin: torch.Tensor               # [t, 1, head_dim], first half negated (see _rope)
    groups: list[_AttnGroup]


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)          # one fused op on the hot path
    # float32 statistics, as transformers does, so fp16/bf16 match it too
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rope; signed_sin carries the minus of the first half, so the rotation is a plain roll."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * signed_sin


def _padded(table: list, num_blocks: int) -> list:
    return (list(table[:num_blocks]) + [0] * num_blocks)[:num_blocks]


class PagedCausalLM:
    """One member's weights plus the paged forward. Holds no KV: every forward gets the arena."""

    def __init__(self, member: MemberSpec, weights: CheckpointWeights, dtype: str = "float32") -> None:
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

    def block_tokens(self, arena: KVArena) -> int:
        return self.member.tokens_per_block(arena.page_bytes, self.torch_dtype.itemsize)

    @torch.inference_mode()
    def forward(self, arena: KVArena, chunks: list[SeqChunk], all_logits: bool = False) -> torch.Tensor:
        """Runs every chunk; returns float32 logits [num_sampling_chunks, vocab] (last position of each chunk
        with sample=True, in chunk order) or, with all_logits, [total_new_tokens, vocab] in chunk order."""
        if not chunks:
            return torch.empty(0, self.config.vocab_size, device=self.device)
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
        for segment in self._segments(chunks, offsets, block):
            x = hidden if segment.rows is None else hidden[segment.rows]
            for layer in range(segment.first_layer, segment.end_layer):
                x = self._layer(self.weights.layers[layer], layer, x, segment, kv_view, kv_rows, block)
            if segment.rows is None:
                hidden = x
            else:
                hidden[segment.rows] = x
        self._write_residuals(arena, chunks, offsets, block, hidden)
        if all_logits:
            rows = hidden
        else:
            rows = hidden[[offsets[i + 1] - 1 for i, c in enumerate(chunks) if c.sample]]
        normed = _rms_norm(rows, self.weights.norm, self.config.rms_norm_eps)
        return F.linear(normed, self.weights.lm_head).float()

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
            positions = range(chunk.start_pos, chunk.start_pos + len(chunk.token_ids))
            pages = torch.tensor([chunk.residual_table[p // block] for p in positions], device=self.device)
            slots = torch.tensor([p % block for p in positions], device=self.device)
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
            positions = range(chunk.start_pos, chunk.start_pos + len(chunk.token_ids))
            pages = torch.tensor([chunk.residual_table_out[p // block] for p in positions], device=self.device)
            slots = torch.tensor([p % block for p in positions], device=self.device)
            residual[pages, slots] = hidden[offsets[i]:offsets[i + 1]]

    def _segments(self, chunks: list[SeqChunk], offsets: list[int], block: int) -> list[_Segment]:
        num_layers = self.config.num_layers
        starts = sorted({c.start_layer for c in chunks if c.start_layer < num_layers})
        segments = []
        for first, end in zip(starts, starts[1:] + [num_layers]):
            active = [i for i, c in enumerate(chunks) if c.start_layer <= first]
            segments.append(self._segment(chunks, offsets, active, first, end, block))
        return segments

    def _segment(self, chunks: list[SeqChunk], offsets: list[int], active: list[int], first: int, end: int,
                 block: int) -> _Segment:
        num_layers, device = self.config.num_layers, self.device
        positions: list[int] = []
        write_pages: list[list[int]] = [[] for _ in range(num_layers)]
        decode_rows: list[int] = []
        decode_tables: list[list[list[int]]] = []
        decode_lengths: list[int] = []
        groups: list[_AttnGroup] = []
        for i in active:
            chunk = chunks[i]
            n, start = len(chunk.token_ids), chunk.start_pos
            total = start + n
            num_blocks = -(-total // block)
            if len(chunk.block_tables) != num_layers:
                raise ValueError(f"chunk {chunk.request_id}: {len(chunk.block_tables)} block tables for "
                                 f"{num_layers} layers")
            for layer in range(first, num_layers):
                if len(chunk.block_tables[layer]) < num_blocks:
                    raise ValueError(f"chunk {chunk.request_id}: layer {layer} has {len(chunk.block_tables[layer])} "
                                     f"pages, positions up to {total} need {num_blocks}")
            table = [_padded(chunk.block_tables[l], num_blocks) for l in range(num_layers)]
            row0 = len(positions)
            chunk_positions = list(range(start, total))
            positions.extend(chunk_positions)
            for layer in range(num_layers):
                write_pages[layer].extend(table[layer][p // block] for p in chunk_positions)
            if n == 1:
                decode_rows.append(row0)
                decode_tables.append(table)
                decode_lengths.append(total)
            else:
                groups.append(self._prefill_group(row0, n, start, table, num_blocks, block))
        if decode_rows:
            groups.append(self._decode_group(decode_rows, decode_tables, decode_lengths, block, len(positions)))
        every_row = len(active) == len(chunks)
        rows = None if every_row else torch.cat([torch.arange(offsets[i], offsets[i + 1]) for i in active]).to(device)
        position_tensor = torch.tensor(positions, device=device)
        freqs = position_tensor[:, None].float() * self.weights.inv_freq[None, :]   # [t, head_dim // 2]
        angles = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        signed_sin = torch.cat((-freqs[:, None, :].sin(), freqs[:, None, :].sin()), dim=-1)
        return _Segment(
            first_layer=first, end_layer=end, rows=rows,
            write_pages=torch.tensor(write_pages, device=device), write_slots=position_tensor % block,
            cos=angles.cos().to(self.torch_dtype), sin=signed_sin.to(self.torch_dtype), groups=groups)

    def _prefill_group(self, row0: int, n: int, start: int, table: list[list[int]], num_blocks: int,
                       block: int) -> _AttnGroup:
        query_pos = torch.arange(start, start + n, device=self.device)
        key_pos = torch.arange(num_blocks * block, device=self.device)
        mask = key_pos[None, :] <= query_pos[:, None]                        # [n, keys], causal
        mask = mask.repeat(self.num_groups, 1)[None, None]                   # [1, 1, groups * n, keys]
        pages = torch.tensor(table, device=self.device)                    # [layers, blocks]
        return _AttnGroup(rows=slice(row0, row0 + n), num_seqs=1, q_tokens=n, pages=pages, num_blocks=num_blocks,
                          mask=mask)

    def _decode_group(self, rows: list[int], tables: list[list[list[int]]], lengths: list[int], block: int,
                      num_tokens: int) -> _AttnGroup:
        num_blocks = max(-(-length // block) for length in lengths)
        padded = [[_padded(t, num_blocks) for t in table] for table in tables]
        pages = torch.tensor(padded, device=self.device).transpose(0, 1).reshape(len(tables[0]), -1)
        key_pos = torch.arange(num_blocks * block, device=self.device)
        length_tensor = torch.tensor(lengths, device=self.device)
        mask = (key_pos[None, :] < length_tensor[:, None])[:, None, None, :]  # [seqs, 1, 1, keys]
        all_rows = rows == list(range(num_tokens))
        row_index = slice(0, num_tokens) if all_rows else torch.tensor(rows, device=self.device)
        return _AttnGroup(rows=row_index, num_seqs=len(rows), q_tokens=1, pages=pages, num_blocks=num_blocks,
                          mask=mask)

    def _layer(self, w: LayerWeights, layer: int, x: torch.Tensor, segment: _Segment, kv_view: torch.Tensor,
               kv_rows: tuple[torch.Tensor, torch.Tensor], block: int) -> torch.Tensor:
        config = self.config
        t, heads, kv_heads, dim = x.shape[0], config.num_heads, config.num_kv_heads, config.head_dim
        qkv = F.linear(_rms_norm(x, w.input_norm, config.rms_norm_eps), w.qkv, w.qkv_bias)
        q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
        q = _rope(q.view(t, heads, dim), segment.cos, segment.sin)              # [t, heads, dim]
        k = _rope(k.view(t, kv_heads, dim), segment.cos, segment.sin)           # [t, kv_heads, dim]
        # write first, then read every position back from the pages: one code path for cached and new keys
        kv_view[segment.write_pages[layer], :, segment.write_slots] = torch.stack((k, v.view(t, kv_heads, dim)), 1)
        only = segment.groups[0] if len(segment.groups) == 1 else None
        if only is not None and isinstance(only.rows, slice) and only.rows == slice(0, t):   # no scatter needed
            out = self._attend(q, kv_rows, only, layer, block)
        else:
            out = q.new_empty(t, heads, dim)
            for group in segment.groups:
                out[group.rows] = self._attend(q[group.rows], kv_rows, group, layer, block)
        x = x + F.linear(out.reshape(t, heads * dim), w.o, w.o_bias)
        gate, up = F.linear(_rms_norm(x, w.post_norm, config.rms_norm_eps), w.gate_up).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, w.down)

    def _attend(self, q: torch.Tensor, kv_rows: tuple[torch.Tensor, torch.Tensor], group: _AttnGroup, layer: int,
                block: int) -> torch.Tensor:
        """q [seqs * q_tokens, heads, dim] -> [seqs * q_tokens, heads, dim]."""
        config = self.config
        seqs, n, kv_heads, dim, groups = group.num_seqs, group.q_tokens, config.num_kv_heads, config.head_dim, \
            self.num_groups
        k_rows, v_rows = kv_rows
        page_index = group.pages[layer]                                       # [seqs * blocks]
        num_keys = group.num_blocks * block
        # one row per page (K or V half): index_select copies whole contiguous rows, and the result's
        # blocks and slots merge into one key axis without another copy
        k = k_rows.index_select(0, page_index).view(seqs, num_keys, kv_heads, dim).transpose(1, 2)
        v = v_rows.index_select(0, page_index).view(seqs, num_keys, kv_heads, dim).transpose(1, 2)
        # GQA without repeating K/V: a kv head's query heads become extra query rows
        q = q.view(seqs, n, kv_heads, groups, dim).permute(0, 2, 3, 1, 4).reshape(seqs, kv_heads, groups * n, dim)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=group.mask)  # [seqs, kv_heads, g * n, dim]
        return out.view(seqs, kv_heads, groups, n, dim).permute(0, 3, 1, 2, 4).reshape(seqs * n, -1, dim)
