"""fastgen/huge_pages.py: weights streamed as stored move to memory advised for 2 MiB pages,
exactly, and only where that can help; the packed linear keeps following in-place updates."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from shardspeed.inference.fastgen import huge_pages
from shardspeed.inference.fastgen.cpu_prepack import prepack_linears
from shardspeed.ops import cpu_gemv

needs_thp = pytest.mark.skipif(
    not huge_pages._advisable(), reason="no transparent huge pages (madvise) here"
)


@needs_thp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_is_exact_and_starts_on_a_huge_page(dtype) -> None:
    t = torch.randn(1024, 3000).to(dtype)
    copy = huge_pages.huge_page_copy(t)
    assert copy is not None and copy.dtype == dtype and copy.shape == t.shape
    assert torch.equal(copy, t) and copy.data_ptr() != t.data_ptr()
    assert copy.data_ptr() % (2 << 20) == 0 and copy.is_contiguous()
    copy.mul_(2)  # writable, its own memory
    assert torch.equal(copy, t * 2)


def test_nothing_moves_where_it_cannot_help(tmp_path, monkeypatch) -> None:
    big = torch.randn(1024, 2048)
    assert huge_pages.huge_page_copy(torch.randn(100, 100)) is None  # small
    assert huge_pages.huge_page_copy(big[:, :1024]) is None  # not contiguous
    assert huge_pages.huge_page_copy(big[:600]) is None  # part of a larger storage
    setting = tmp_path / "enabled"
    setting.write_text("always madvise [never]\n")
    monkeypatch.setattr(huge_pages, "_THP_SETTING", setting)
    assert huge_pages.thp_mode() == "never" and huge_pages.huge_page_copy(big) is None
    monkeypatch.setattr(huge_pages, "_THP_SETTING", tmp_path / "missing")
    assert huge_pages.thp_mode() == "" and huge_pages.huge_page_copy(big) is None


@needs_thp
@pytest.mark.skipif(
    torch.float32 not in cpu_gemv.kernel_dtypes(), reason="no fp32 GEMV kernel on this CPU"
)
def test_packed_linear_streams_a_huge_page_copy_and_follows_updates() -> None:
    torch.manual_seed(0)
    layer = nn.Linear(1024, 1536).requires_grad_(False)  # 6 MiB of fp32
    before = layer.weight.detach().clone()
    old_ptr = layer.weight.data_ptr()
    assert prepack_linears(nn.Sequential(layer), (torch.float32,)) == 1
    assert layer.weight.data_ptr() != old_ptr and layer.weight.data_ptr() % (2 << 20) == 0
    assert torch.equal(layer.weight, before) and isinstance(layer.weight, nn.Parameter)
    x = torch.randn(1, 1024)  # one row: the GEMV kernel on the parameter as stored
    torch.testing.assert_close(layer(x), F.linear(x, before, layer.bias), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        layer.weight.mul_(-2.0)  # in place on the moved copy: repacked, not served stale
    torch.testing.assert_close(
        layer(x), F.linear(x, before * -2.0, layer.bias), rtol=1e-5, atol=1e-5
    )
