"""Fused element-wise steps of a decoder layer (engines/local/native/layer_ops.c) for float32 on the CPU: RMSNorm,
SiLU-and-multiply, and rotary embedding with the K/V write into the arena. Each call returns None where it does
not apply (another dtype or device, a layout it does not know, no C compiler), and the model keeps its torch path."""
from __future__ import annotations

import ctypes

import torch

from engines.local import native_kernels

_P = ctypes.c_void_p
_I = ctypes.c_int64


class LayerKernels:
    def __init__(self, library: ctypes.CDLL) -> None:
        self._rms = library.rms_norm_f32
        self._rms.argtypes = [_P, _I, _P, _I, _I, ctypes.c_float, _P]
        self._rms.restype = None
        self._silu_mul = library.silu_mul_f32
        self._silu_mul.argtypes = [_P, _I, _I, _P]
        self._silu_mul.restype = None
        self._rope_write = library.rope_write_kv_f32
        self._rope_write.argtypes = [_P, _I, _I, _I, _I, _P, _P, _P, _I, _I, _I, _I, _P, _P]
        self._rope_write.restype = ctypes.c_int

    @classmethod
    def load(cls) -> LayerKernels | None:
        library = native_kernels.load("layer_ops")
        return None if library is None else cls(library)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
        """x [rows, dim] with unit column stride, weight [dim] -> a new [rows, dim]."""
        if (x.dtype != torch.float32 or weight.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2
                or x.stride(1) != 1 or not weight.is_contiguous()):
            return None
        rows, dim = x.shape
        out = torch.empty(rows, dim)
        self._rms(x.data_ptr(), x.stride(0), weight.data_ptr(), rows, dim, eps, out.data_ptr())
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor | None:
        """gate_up [rows, 2 * inter] (contiguous) -> silu(gate) * up, a new [rows, inter]."""
        if (gate_up.dtype != torch.float32 or gate_up.device.type != "cpu" or gate_up.dim() != 2
                or not gate_up.is_contiguous() or gate_up.shape[1] % 2):
            return None
        rows, width = gate_up.shape
        out = torch.empty(rows, width // 2)
        self._silu_mul(gate_up.data_ptr(), rows, width // 2, out.data_ptr())
        return out

    def rope_write_kv(self, qkv: torch.Tensor, heads: int, kv_heads: int, dim: int, cos: torch.Tensor,
                      signed_sin: torch.Tensor, kv_view: torch.Tensor, pages: torch.Tensor,
                      slots: torch.Tensor) -> bool:
        """Ropes q and k of qkv [rows, (heads + 2 kv_heads) * dim] in place and writes k, v into kv_view
        [pages, 2, block, kv_heads, dim] at (pages[r], slots[r]). False (nothing done) where it does not apply."""
        rows = qkv.shape[0]
        if (qkv.dtype != torch.float32 or kv_view.dtype != torch.float32 or cos.dtype != torch.float32
                or signed_sin.dtype != torch.float32 or qkv.device.type != "cpu" or not qkv.is_contiguous()
                or not cos.is_contiguous() or not signed_sin.is_contiguous()
                or pages.dtype != torch.int64 or slots.dtype != torch.int64
                or not pages.is_contiguous() or not slots.is_contiguous()
                or pages.numel() != rows or slots.numel() != rows or cos.numel() != rows * dim):
            return False
        num_pages, two, block, view_kv_heads, view_dim = kv_view.shape
        if (two, view_kv_heads, view_dim) != (2, kv_heads, dim) or kv_view.stride()[2:] != (kv_heads * dim, dim, 1):
            return False
        status = self._rope_write(qkv.data_ptr(), rows, heads, kv_heads, dim, cos.data_ptr(), signed_sin.data_ptr(),
                                  kv_view.data_ptr(), kv_view.stride(0), kv_view.stride(1), block, num_pages,
                                  pages.data_ptr(), slots.data_ptr())
        return status == 0
