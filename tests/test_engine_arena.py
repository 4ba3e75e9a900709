"""KV arena: one storage tensor, per-member strided views that alias it, page byte round trips."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engines.local.arena import KVArena
from orchestrator.core.family import MemberSpec
from orchestrator.core.types import MemberName, PageId


def _member(name: str, kv_heads: int = 2, head_dim: int = 16, hidden: int = 64) -> MemberSpec:
    return MemberSpec(name=MemberName(name), index=0, checkpoint_dir=Path("/nonexistent"), architecture="llama",
                      num_layers=2, hidden_size=hidden, num_heads=4, num_kv_heads=kv_heads, head_dim=head_dim,
                      vocab_size=256, context_tokens=256, layer_lineages=("a", "b"), tokenizer_hash="t",
                      eos_token_ids=(2,))


def test_kv_view_shape_stride_and_aliasing():
    arena = KVArena(num_pages=5, page_bytes=1500)
    member = _member("m")
    view = arena.kv_view(member, "float32")                 # 256 B per token -> 5 raw -> 4 tokens, tail unused
    assert view.shape == (5, 2, 4, 2, 16)
    assert view.stride(0) == 1500 // 4
    assert view.untyped_storage().data_ptr() == arena.storage.untyped_storage().data_ptr()
    view[3, 1, 2] = 7.0
    raw = torch.frombuffer(bytearray(arena.read_page(PageId(3))), dtype=torch.float32)
    assert raw[(1 * 4 + 2) * 32:(1 * 4 + 3) * 32].eq(7.0).all()
    assert raw[2 * 4 * 32:].eq(0).all()                   # tail and other slots untouched
    assert arena.read_page(PageId(2)) == bytes(1500)


def test_members_and_dtypes_share_the_same_pages():
    arena = KVArena(num_pages=4, page_bytes=1024)
    wide, narrow = _member("wide"), _member("narrow", kv_heads=1, head_dim=8)
    assert arena.kv_view(narrow, "float16").shape == (4, 2, 32, 1, 8)
    arena.kv_view(wide, "float32")[1].fill_(1.5)
    assert arena.kv_view(narrow, "float32")[1].eq(1.5).all()   # any page serves any member


def test_residual_view_only_when_it_fits():
    arena = KVArena(num_pages=3, page_bytes=1024)
    assert arena.residual_view(_member("m"), "float32").shape == (3, 4, 64)
    assert arena.residual_view(_member("wide", hidden=128), "float32") is None


def test_write_read_round_trip_and_bounds():
    arena = KVArena(num_pages=3, page_bytes=64)
    data = bytes(range(64))
    arena.write_page(PageId(1), data)
    assert arena.read_page(PageId(1)) == data
    assert arena.read_page(PageId(0)) == bytes(64)
    with pytest.raises(IndexError):
        arena.read_page(PageId(3))
    with pytest.raises(ValueError):
        arena.write_page(PageId(0), b"short")
