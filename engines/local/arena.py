"""The KV arena: ONE uint8 device tensor of fixed-size pages, with per-member strided views (no copies)."""
from __future__ import annotations

import torch

from orchestrator.core.family import FamilyError, MemberSpec
from orchestrator.core.types import PageId

from engines.local.checkpoint import TORCH_DTYPES


class KVArena:
    """num_pages pages of page_bytes each. A page holds one layer's K and V for one block of one member
    (or one residual block); which page holds what is decided by the core's ledger, not here."""

    def __init__(self, num_pages: int, page_bytes: int, device: str | torch.device = "cpu") -> None:
        if num_pages < 1 or page_bytes < 1:
            raise ValueError(f"arena needs num_pages >= 1 and page_bytes >= 1, got {num_pages}, {page_bytes}")
        self.num_pages = num_pages
        self.page_bytes = page_bytes
        self.device = torch.device(device)
        self.storage = torch.zeros(num_pages * page_bytes, dtype=torch.uint8, device=self.device)
        self._kv_views: dict[tuple[str, str], torch.Tensor] = {}
        self._residual_views: dict[tuple[str, str], torch.Tensor | None] = {}

    def _pages(self, dtype: str) -> torch.Tensor:
        """[num_pages, page_bytes // dtype_bytes] elements of `dtype`, aliasing the storage."""
        torch_dtype = TORCH_DTYPES[dtype]
        dtype_bytes = torch_dtype.itemsize
        if self.page_bytes % dtype_bytes:
            raise FamilyError(f"page_bytes {self.page_bytes} is not a multiple of {dtype} size {dtype_bytes}")
        return self.storage.view(torch_dtype).view(self.num_pages, self.page_bytes // dtype_bytes)

    def kv_view(self, member: MemberSpec, dtype: str) -> torch.Tensor:
        """[num_pages, 2, tokens_per_block, kv_heads, head_dim]; the page tail past 2*B*H*D is unused."""
        key = (member.name, dtype)
        if key not in self._kv_views:
            dtype_bytes = TORCH_DTYPES[dtype].itemsize
            block_tokens = member.tokens_per_block(self.page_bytes, dtype_bytes)
            used = 2 * block_tokens * member.num_kv_heads * member.head_dim
            self._kv_views[key] = self._pages(dtype)[:, :used].view(
                self.num_pages, 2, block_tokens, member.num_kv_heads, member.head_dim)
        return self._kv_views[key]

    def residual_view(self, member: MemberSpec, dtype: str) -> torch.Tensor | None:
        """[num_pages, tokens_per_block, hidden], or None when a residual block does not fit a page."""
        key = (member.name, dtype)
        if key not in self._residual_views:
            dtype_bytes = TORCH_DTYPES[dtype].itemsize
            view = None
            if member.residual_fits_page(self.page_bytes, dtype_bytes):
                block_tokens = member.tokens_per_block(self.page_bytes, dtype_bytes)
                used = block_tokens * member.hidden_size
                view = self._pages(dtype)[:, :used].view(self.num_pages, block_tokens, member.hidden_size)
            self._residual_views[key] = view
        return self._residual_views[key]

    def _check(self, page: PageId) -> None:
        if not 0 <= page < self.num_pages:
            raise IndexError(f"page {page} outside the arena [0, {self.num_pages})")

    def read_page(self, page: PageId) -> bytes:
        self._check(page)
        start = page * self.page_bytes
        return self.storage[start:start + self.page_bytes].cpu().numpy().tobytes()

    def write_page(self, page: PageId, data: bytes) -> None:
        self._check(page)
        if len(data) != self.page_bytes:
            raise ValueError(f"page {page}: got {len(data)} bytes, a page holds {self.page_bytes}")
        start = page * self.page_bytes
        source = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self.storage[start:start + self.page_bytes].copy_(source)
