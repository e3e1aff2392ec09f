"""The CPU engine's C kernels: built once into the kernel folder, equal to torch's paths,
and a clear fallback where no compiler is found."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch
import torch.nn.functional as F
from test_attention import HEAD_DIM, make_batch, reference

from distserve_engine import native
from distserve_engine.attention import paged_attention
from distserve_engine.models.layers import RMSNorm

needs_compiler = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                    reason="no C compiler on this machine")


@needs_compiler
def test_the_c_kernel_is_built_once_into_the_kernel_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("DISTSERVE_KERNEL_DIR", str(tmp_path))
    monkeypatch.setattr(native, "_loaded", {})
    assert native.paged_decode() is not None
    built = list(tmp_path.glob("cpu_kernels-*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    assert native.build() == built[0] and built[0].stat().st_mtime_ns == stamp  # not rebuilt


def test_without_a_compiler_decode_falls_back_to_torch_and_says_why(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("DISTSERVE_KERNEL_DIR", str(tmp_path))  # nothing built there
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setattr(native, "_loaded", {})
    with caplog.at_level(logging.WARNING, logger="distserve_engine.native"):
        q, k, v, k_cache, v_cache, meta, full = make_batch([5, 2], [1, 1], seed=2)
        out = paged_attention(q, k, v, k_cache, v_cache, meta, HEAD_DIM**-0.5)
    assert "its C kernels are not available" in caplog.text and "no-such-cc" in caplog.text
    assert meta.buffers  # the torch path gathered the context
    torch.testing.assert_close(out[:1], reference(q[:1], full[0][0], full[0][1], 5),
                               atol=1e-5, rtol=1e-5)


@needs_compiler
@pytest.mark.parametrize("rows", [1, 7])
def test_rms_norm_in_c_matches_torch_on_rows_and_strided_views(rows, monkeypatch):
    kernel, calls = native.rms_norm(), []
    monkeypatch.setattr(native, "rms_norm", lambda: lambda *args: calls.append(args) or kernel(*args))
    torch.manual_seed(rows)
    norm = RMSNorm(576, 1e-5)
    norm.weight.data.normal_()
    fused = torch.randn(rows, 3 * 576) * 4  # a view of its middle third: rows 3*576 apart
    for x in (torch.randn(rows, 576), fused[:, 576:1152]):
        out = norm(x)
        assert out.is_contiguous() and out.shape == x.shape
        torch.testing.assert_close(out, F.rms_norm(x, (576,), norm.weight, 1e-5),
                                   atol=1e-5, rtol=1e-5)
    assert len(calls) == 2  # both through the C kernel
