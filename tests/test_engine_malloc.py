"""engines/local/malloc_tuning: a freed multi-MB buffer stays in the heap (no mmap per allocation)."""
from __future__ import annotations

import ctypes
import ctypes.util
import platform

import pytest

from engines.local.malloc_tuning import tune_malloc
from orchestrator.core.config import ConfigError, MFSConfig

glibc_only = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt/mallinfo2 are glibc's")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _mmapped_blocks(libc) -> int:
    libc.mallinfo2.restype = _MallInfo2
    return libc.mallinfo2().hblks


def test_zero_leaves_glibc_alone():
    assert tune_malloc(0) is False


@glibc_only
def test_tuned_malloc_serves_a_4mb_buffer_from_the_heap():
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if not hasattr(libc, "mallinfo2"):
        pytest.skip("glibc older than 2.33")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    assert tune_malloc(32) is True
    before = _mmapped_blocks(libc)
    buffer = libc.malloc(4 << 20)
    assert buffer
    assert _mmapped_blocks(libc) == before          # from the heap, not a fresh mmap
    libc.free(buffer)


def test_config_bounds():
    config = MFSConfig()
    assert config.developer.malloc_mmap_threshold_mb == 32
    config.developer.malloc_mmap_threshold_mb = 64
    with pytest.raises(ConfigError):
        config.validate()
