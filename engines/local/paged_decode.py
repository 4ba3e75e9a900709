"""Decode attention read in place from the arena's pages (engines/local/native/paged_decode.c), for float32 on
the CPU; everything else (prefill chunks, other dtypes or devices, no C compiler) keeps the torch path."""
from __future__ import annotations

import ctypes

import torch

from engines.local import native_kernels

_P = ctypes.c_void_p
_I = ctypes.c_int64


class PagedDecodeKernel:
    """Callable: (q [seqs, heads, dim], kv_view [pages, 2, block, kv_heads, dim], pages [seqs, blocks] int64,
    lengths [seqs] int64, scale) -> out [seqs, heads, dim], or None when the kernel does not apply."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._fn = library.paged_decode_f32
        self._fn.argtypes = [_P, _P, _I, _I, _P, _I, _I, _P, _I, _I, _I, _I, _I, ctypes.c_float, _P]
        self._fn.restype = ctypes.c_int

    @classmethod
    def load(cls) -> PagedDecodeKernel | None:
        library = native_kernels.load("paged_decode")
        return None if library is None else cls(library)

    def __call__(self, q: torch.Tensor, kv_view: torch.Tensor, pages: torch.Tensor, lengths: torch.Tensor,
                 scale: float) -> torch.Tensor | None:
        if q.dtype != torch.float32 or kv_view.dtype != torch.float32 or q.device.type != "cpu":
            return None
        q = q.contiguous()
        seqs, heads, dim = q.shape
        num_pages, two, block, kv_heads, kv_dim = kv_view.shape
        if (two, kv_dim) != (2, dim) or kv_view.stride()[1:] != (block * kv_heads * dim, kv_heads * dim, dim, 1):
            return None
        if seqs == 0 or pages.numel() % seqs or pages.dtype != torch.int64 or lengths.dtype != torch.int64:
            return None
        pages, lengths = pages.contiguous(), lengths.contiguous()
        out = torch.empty_like(q)
        status = self._fn(q.data_ptr(), kv_view.data_ptr(), kv_view.stride(0), kv_view.stride(1),
                          pages.data_ptr(), pages.numel() // seqs, num_pages,
                          lengths.data_ptr(), seqs, heads, kv_heads, dim, block, scale, out.data_ptr())
        return out if status == 0 else None
