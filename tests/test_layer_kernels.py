"""The native layer kernels (engines/local/native/layer_ops.c): the same values as the torch operators they
replace, nothing written on bad input, and the engine decodes the same tokens with and without them."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest_engine import assert_decodes_alike
from engines.local.layer_kernels import LayerKernels
from engines.local.model import _rms_norm, _rope


@pytest.fixture(scope="module")
def kernels() -> LayerKernels:
    loaded = LayerKernels.load()
    if loaded is None:
        pytest.fail("the kernels did not build: this machine has a C compiler (.ci/run's image does)")
    return loaded


@pytest.mark.parametrize("rows, dim", [(1, 8), (5, 256), (33, 640)])
def test_rms_norm_matches_torch(kernels, rows, dim):
    gen = torch.Generator().manual_seed(rows * dim)
    x, weight = torch.randn(rows, dim, generator=gen) * 3, torch.randn(dim, generator=gen)
    torch.testing.assert_close(kernels.rms_norm(x, weight, 1e-6), _rms_norm(x, weight, 1e-6), rtol=1e-5, atol=1e-6)
    wide = torch.randn(rows, dim + 7, generator=gen)[:, :dim]               # rows strided apart: still applies
    torch.testing.assert_close(kernels.rms_norm(wide, weight, 1e-5), _rms_norm(wide, weight, 1e-5),
                               rtol=1e-5, atol=1e-6)
    assert kernels.rms_norm(x.double(), weight.double(), 1e-6) is None
    if rows > 1:
        assert kernels.rms_norm(x.t().contiguous().t(), weight, 1e-6) is None   # columns strided: torch's job


@pytest.mark.parametrize("rows, inter", [(1, 4), (7, 640), (32, 100)])
def test_silu_mul_matches_torch(kernels, rows, inter):
    gen = torch.Generator().manual_seed(inter)
    gate_up = torch.randn(rows, 2 * inter, generator=gen) * 6
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -88.5])[:min(4, inter)]   # the exp's clamps
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(kernels.silu_mul(gate_up), F.silu(gate) * up, rtol=1e-5, atol=1e-6)
    assert kernels.silu_mul(gate_up[:, 1:].contiguous()) is None            # odd width: no gate/up halves
    if rows > 1:
        assert kernels.silu_mul(gate_up[:, 2:]) is None                     # not contiguous


def _arena(pages: int, block: int, kv_heads: int, dim: int) -> torch.Tensor:
    page_floats = 2 * block * kv_heads * dim + 8                            # a page tail the kernel must not touch
    storage = torch.zeros(pages * page_floats)
    return storage.view(pages, page_floats)[:, :2 * block * kv_heads * dim].view(pages, 2, block, kv_heads, dim)


@pytest.mark.parametrize("heads, kv_heads, dim, block", [(4, 2, 64, 16), (6, 1, 8, 5), (2, 2, 32, 8)])
def test_rope_and_kv_write_match_torch(kernels, heads, kv_heads, dim, block):
    gen = torch.Generator().manual_seed(heads * dim)
    rows, pages = 9, 12
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=gen)
    angles = torch.rand(rows, 1, dim // 2, generator=gen) * 40
    cos = torch.cat((angles, angles), -1).cos()
    signed_sin = torch.cat((-angles.sin(), angles.sin()), -1)
    # a distinct (page, slot) per row: distinct slots where a block has room for every row, else distinct pages
    if rows <= block:
        page_ids, slots = torch.randint(0, pages, (rows,), generator=gen), torch.randperm(block, generator=gen)[:rows]
    else:
        page_ids, slots = torch.arange(rows) % pages, torch.randint(0, block, (rows,), generator=gen)
    expected_view = _arena(pages, block, kv_heads, dim)
    qk = _rope(qkv[:, :(heads + kv_heads) * dim].view(rows, heads + kv_heads, dim), cos, signed_sin)
    v = qkv[:, (heads + kv_heads) * dim:].view(rows, kv_heads, dim)
    expected_view[page_ids, 0, slots] = qk[:, heads:]
    expected_view[page_ids, 1, slots] = v
    got_view = _arena(pages, block, kv_heads, dim)
    got = qkv.clone()
    assert kernels.rope_write_kv(got, heads, kv_heads, dim, cos.contiguous(), signed_sin.contiguous(), got_view,
                                 page_ids, slots)
    torch.testing.assert_close(got[:, :heads * dim].view(rows, heads, dim), qk[:, :heads], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_view, expected_view, rtol=1e-5, atol=1e-6)
    whole = torch.tensor([], dtype=torch.float32).set_(got_view.untyped_storage())   # the arena with page tails
    tails = whole.view(pages, got_view.stride(0))[:, 2 * block * kv_heads * dim:]
    assert torch.count_nonzero(tails) == 0


def test_rope_write_refuses_bad_slots_without_writing(kernels):
    heads, kv_heads, dim, block = 2, 1, 8, 4
    qkv = torch.randn(2, (heads + 2 * kv_heads) * dim)
    cos, sin = torch.ones(2, 1, dim), torch.zeros(2, 1, dim)
    view = _arena(3, block, kv_heads, dim)
    before = qkv.clone()
    assert not kernels.rope_write_kv(qkv, heads, kv_heads, dim, cos, sin, view, torch.tensor([0, 3]),
                                     torch.tensor([0, 1]))                   # page 3 of 3
    assert not kernels.rope_write_kv(qkv, heads, kv_heads, dim, cos, sin, view, torch.tensor([0, 1]),
                                     torch.tensor([0, block]))               # slot past the block
    assert torch.equal(qkv, before) and torch.count_nonzero(view) == 0
    assert kernels.rope_write_kv(qkv, heads, kv_heads, dim, cos, sin, view, torch.tensor([0, 2]),
                                 torch.tensor([3, 1]))
    assert torch.count_nonzero(view) > 0


def test_engine_decodes_the_same_with_and_without_the_kernels(kernels):
    """Prefill and decode through the real executor, both ways."""
    assert_decodes_alike([[(13 * i + 7 * s) % 4000 + 3 for i in range(21)] for s in range(3)], "native_layer_ops",
                         "layer_kernels")
