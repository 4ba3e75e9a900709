"""Paged attention for one layer: query groups (decodes together, each prefill chunk alone) over gathered pages."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engines.local.paged_decode import PagedDecodeKernel


@dataclass(slots=True)
class AttnGroup:
    """Queries attended together: all single-token decodes, or one multi-token (prefill) chunk."""

    rows: torch.Tensor | slice      # the group's rows among the segment's tokens
    num_seqs: int
    q_tokens: int                   # new tokens per sequence (1 for the decode group)
    pages: list[torch.Tensor]       # per segment layer: [num_seqs * num_blocks] page ids (padding -> page 0, masked)
    num_keys: int                   # keys attended per sequence (a prefix of the gathered blocks)
    mask: torch.Tensor | None       # additive [seqs, 1, groups * q_tokens | 1, num_keys]; None = attend to all
    key_lengths: torch.Tensor | None = None   # decode group: [seqs] int64 keys per sequence (the native kernel's)


def prefill_group(row0: int, n: int, start: int, table: torch.Tensor, num_groups: int,
                  dtype: torch.dtype) -> AttnGroup:
    """table [layers, blocks]: one chunk's pages; its n queries attend causally to positions [0, start + n)."""
    device = table.device
    total = start + n
    query_pos = torch.arange(start, total, device=device)
    key_pos = torch.arange(total, device=device)
    mask = torch.zeros(n, total, dtype=dtype, device=device)
    mask.masked_fill_(key_pos[None, :] > query_pos[:, None], float("-inf"))
    mask = mask.repeat(num_groups, 1)[None, None]                   # [1, 1, groups * n, keys]
    return AttnGroup(rows=slice(row0, row0 + n), num_seqs=1, q_tokens=n, pages=list(table.unbind(0)),
                     num_keys=total, mask=mask)


def decode_group(members: list[int], rows: list[int], tables: torch.Tensor, lengths: list[int],
                 num_blocks: int, num_tokens: int, dtype: torch.dtype) -> AttnGroup:
    """members: indices into tables [chunks, layers, blocks]; rows: their token rows; lengths: keys per sequence."""
    device = tables.device
    pages = tables[torch.tensor(members, device=device), :, :num_blocks]           # [seqs, layers, blocks]
    pages = pages.transpose(0, 1).contiguous().view(tables.shape[1], -1)        # [layers, seqs * blocks]
    longest = max(lengths)
    mask = None
    if min(lengths) != longest:                 # equal lengths: slicing the keys is the whole mask
        key_pos = torch.arange(longest, device=device)
        length_tensor = torch.tensor(lengths, device=device)
        hidden = key_pos[None, :] >= length_tensor[:, None]                      # [seqs, keys]
        mask = torch.zeros(len(members), 1, 1, longest, dtype=dtype, device=device)
        mask.masked_fill_(hidden[:, None, None, :], float("-inf"))
    all_rows = rows == list(range(num_tokens))
    row_index = slice(0, num_tokens) if all_rows else torch.tensor(rows, device=device)
    return AttnGroup(rows=row_index, num_seqs=len(members), q_tokens=1,
                     pages=list(pages.unbind(0)), num_keys=longest, mask=mask,
                     key_lengths=torch.tensor(lengths, dtype=torch.int64, device=device))


def attend(q: torch.Tensor, kv_rows: tuple[torch.Tensor, torch.Tensor], group: AttnGroup, layer: int,
           kv_heads: int, head_dim: int, kv_view: torch.Tensor | None = None,
           decode_kernel: PagedDecodeKernel | None = None) -> torch.Tensor:
    """q [seqs * q_tokens, heads, dim] -> [seqs * q_tokens, heads, dim]; layer indexes group.pages.
    With decode_kernel and kv_view, a decode group reads its keys in place (paged_decode.py) where it can."""
    seqs, n, dim = group.num_seqs, group.q_tokens, head_dim
    if decode_kernel is not None and n == 1 and group.key_lengths is not None and kv_view is not None:
        out = decode_kernel(q, kv_view, group.pages[layer], group.key_lengths, dim ** -0.5)
        if out is not None:
            return out
    groups = q.shape[1] // kv_heads
    k_rows, v_rows = kv_rows
    page_index = group.pages[layer]                                       # [seqs * blocks]
    # one row per page (K or V half): index_select copies whole contiguous rows, and the result's
    # blocks and slots merge into one key axis without another copy; padding past num_keys is sliced off
    k = k_rows.index_select(0, page_index)
    v = v_rows.index_select(0, page_index)
    k = k.view(seqs, -1, kv_heads, dim)[:, :group.num_keys].transpose(1, 2)
    v = v.view(seqs, -1, kv_heads, dim)[:, :group.num_keys].transpose(1, 2)
    # GQA without repeating K/V: a kv head's query heads become extra query rows
    if n == 1:
        q = q.view(seqs, kv_heads, groups, dim)
    else:
        q = q.view(seqs, n, kv_heads, groups, dim).permute(0, 2, 3, 1, 4).reshape(seqs, kv_heads, groups * n, dim)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=group.mask)  # [seqs, kv_heads, g * n, dim]
    # reshape, not view: CUDA's fused kernels return this shape with heads and rows strided apart
    if n == 1:
        return out.reshape(seqs, kv_heads * groups, dim)
    return out.reshape(seqs, kv_heads, groups, n, dim).permute(0, 3, 1, 2, 4).reshape(seqs * n, -1, dim)
