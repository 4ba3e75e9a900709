"""The native paged decode kernel (engines/local/native/paged_decode.c): same attention as the torch path (gather
+ SDPA) over pages scattered in the arena, a clean fallback on bad input, and a one-line notice without a
compiler."""
from __future__ import annotations

import logging

import pytest
import torch

from conftest_engine import assert_decodes_alike
from engines.local import native_kernels
from engines.local.attention import attend, decode_group
from engines.local.paged_decode import PagedDecodeKernel

NUM_PAGES = 160


@pytest.fixture(scope="module")
def kernel() -> PagedDecodeKernel:
    loaded = PagedDecodeKernel.load()
    if loaded is None:
        pytest.fail("the kernel did not build: this machine has a C compiler (.ci/run's image does)")
    return loaded


def _arena(block: int, kv_heads: int, dim: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    # a page's tail past the K and V halves is unused (as in KVArena): give it garbage the kernel must not read
    page_floats = 2 * block * kv_heads * dim + 8
    storage = torch.randn(NUM_PAGES * page_floats, generator=gen) * 2
    return storage.view(NUM_PAGES, page_floats)[:, :2 * block * kv_heads * dim].view(NUM_PAGES, 2, block,
                                                                                          kv_heads, dim)


@pytest.mark.parametrize("heads, kv_heads, dim, block", [(4, 2, 64, 16), (8, 2, 16, 4), (2, 2, 32, 8),
                                                         (6, 1, 8, 5)])
def test_kernel_matches_gather_and_sdpa(kernel, heads, kv_heads, dim, block):
    kv_view = _arena(block, kv_heads, dim, seed=heads * dim + block)
    kv_rows = (kv_view[:, 0].flatten(1), kv_view[:, 1].flatten(1))
    gen = torch.Generator().manual_seed(7)
    lengths = [1, block, block + 1, 3 * block - 1, 37]            # one key, whole pages, a page plus one, ragged
    num_blocks = max(-(-n // block) for n in lengths)
    layers = 2
    order = torch.randperm(NUM_PAGES, generator=gen)[:len(lengths) * layers * num_blocks]
    tables = order.view(len(lengths), layers, num_blocks)        # pages scattered over the arena
    group = decode_group(list(range(len(lengths))), list(range(len(lengths))), tables, lengths, num_blocks,
                         len(lengths), torch.float32)
    q = torch.randn(len(lengths), heads, dim, generator=gen)
    for layer in range(layers):
        expected = attend(q, kv_rows, group, layer, kv_heads, dim)
        got = attend(q, kv_rows, group, layer, kv_heads, dim, kv_view, kernel)
        assert got.shape == expected.shape
        # fp32 sums in another order and a polynomial exp (within 2 ulp of expf): a few ulp of the values
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=2e-6)
        assert not torch.equal(got, torch.zeros_like(got))


def test_bad_page_ids_or_lengths_fall_back_without_writing(kernel):
    kv_view = _arena(4, 2, 16, seed=1)
    q = torch.randn(2, 4, 16)
    pages = torch.tensor([[0, 1], [2, NUM_PAGES]])                # the second sequence names a page past the end
    assert kernel(q, kv_view, pages.flatten(), torch.tensor([8, 5]), 0.25) is None
    assert kernel(q, kv_view, torch.tensor([0, 1, 2, 3]), torch.tensor([8, 9]), 0.25) is None   # 9 keys > 2 pages
    assert kernel(q, kv_view, torch.tensor([0, 1, 2, 3]), torch.tensor([8, 0]), 0.25) is None   # no key at all
    assert kernel(q.double(), kv_view, torch.tensor([0, 1, 2, 3]), torch.tensor([8, 5]), 0.25) is None
    assert kernel(q, kv_view, torch.tensor([0, 1, 2, 3]), torch.tensor([8, 5]), 0.25) is not None


def test_engine_decodes_the_same_with_and_without_the_kernel(kernel):
    prompts = [[(11 * i + 5 * s) % 4000 + 3 for i in range(20)] for s in range(3)]   # one step prefills them all
    assert_decodes_alike(prompts, "native_attention", "decode_kernel")


def test_no_compiler_says_so_in_one_line(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("MFS_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(native_kernels, "_loaded", {})
    with caplog.at_level(logging.WARNING, logger="mfs.engine"):
        assert PagedDecodeKernel.load() is None
        assert PagedDecodeKernel.load() is None                      # said once, not per model
    notices = [r.getMessage() for r in caplog.records]
    assert len(notices) == 1 and "paged_decode unavailable" in notices[0] and "torch path" in notices[0]
    assert "\n" not in notices[0]


def test_built_once_per_machine_and_reused(monkeypatch, tmp_path):
    monkeypatch.setenv("MFS_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(native_kernels, "_loaded", {})
    assert native_kernels.load("paged_decode") is not None
    built = list(tmp_path.glob("paged_decode-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    monkeypatch.setattr(native_kernels, "_loaded", {})
    assert native_kernels.load("paged_decode") is not None
    assert list(tmp_path.glob("*")) == built and built[0].stat().st_mtime_ns == stamp


def test_an_unusable_cache_folder_builds_in_the_temporary_folder(monkeypatch, tmp_path):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    monkeypatch.setenv("MFS_KERNEL_CACHE", str(not_a_folder / "kernels"))
    monkeypatch.setattr(native_kernels.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    monkeypatch.setattr(native_kernels, "_loaded", {})
    assert native_kernels.load("paged_decode") is not None
    assert len(list((tmp_path / "tmp").glob("mfs-kernels-*/paged_decode-*.so"))) == 1

