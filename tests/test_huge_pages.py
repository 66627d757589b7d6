"""tinygpt.native.in_huge_pages: the kernels' tiled weights in memory Linux backs with 2 MiB
pages. The copy must equal the tensor, start on a 2 MiB boundary, be released with its last
view, and fall back to an ordinary contiguous tensor where huge pages are not asked for."""

from __future__ import annotations

import gc
import sys

import pytest
import torch

from tinygpt import cpu_kernels as ck
from tinygpt.native import HUGE_PAGE, in_huge_pages

linux = pytest.mark.skipif(sys.platform != "linux", reason="huge pages are asked for on Linux")


def mapped(address: int) -> bool:
    """Whether `address` lies in one of this process's mappings (/proc/self/maps)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            lo, hi = (int(part, 16) for part in line.split()[0].split("-"))
            if lo <= address < hi:
                return True
    return False


@linux
def test_the_copy_equals_the_tensor_starts_on_2_mib_and_is_released_with_its_last_view(
        monkeypatch):
    monkeypatch.delenv("TINYGPT_HUGE_PAGES", raising=False)
    t = torch.randn(1100, 700).t()                   # 3.1 MB, not contiguous
    out = in_huge_pages(t)
    assert torch.equal(out, t) and out.is_contiguous()
    address = out.data_ptr()
    assert address % HUGE_PAGE == 0 and mapped(address)
    view = out[5:9]
    del out
    gc.collect()
    assert mapped(address)                           # a view still holds the mapping
    del view
    gc.collect()
    assert not mapped(address)


def test_small_tensors_and_the_switch_give_an_ordinary_tensor(monkeypatch):
    small = torch.randn(100, 100).t()
    out = in_huge_pages(small)
    assert torch.equal(out, small) and out.is_contiguous()
    monkeypatch.setenv("TINYGPT_HUGE_PAGES", "0")
    big = torch.randn(1100, 700)
    assert in_huge_pages(big) is big                 # already contiguous: itself


@linux
@pytest.mark.skipif(ck.available() is not None, reason=str(ck.available()))
def test_tiles_live_in_huge_pages_and_multiply_the_same(monkeypatch):
    """A weight's tiles (float32, bfloat16, Q8_0, Q4_1) start on a 2 MiB boundary, and the
    products on them equal those on tiles in ordinary memory (TINYGPT_HUGE_PAGES=0) exactly."""
    w = torch.randn(6144, 576, generator=torch.Generator().manual_seed(0)) * 0.05  # Q4_1 2.2 MB
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(1))
    for fmt in ("fp32", "bf16", "q8_0", "q4_1"):
        monkeypatch.delenv("TINYGPT_HUGE_PAGES", raising=False)
        huge = ck.TiledLinear(w, fmt=fmt)
        monkeypatch.setenv("TINYGPT_HUGE_PAGES", "0")
        plain = ck.TiledLinear(w, fmt=fmt)
        assert huge.tiled.data_ptr() % HUGE_PAGE == 0, fmt
        assert torch.equal(huge.tiled, plain.tiled), fmt
        assert torch.equal(huge(x)[0], plain(x)[0]), fmt
