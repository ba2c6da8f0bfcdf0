"""What the engine does when its C kernels cannot be built: a compiler that fails, or none at all, is a
warning and the torch/oneDNN paths, never an error at load or a wrong answer."""

from __future__ import annotations

import shutil

import pytest
import torch
from torch import nn

from zserve.generator import c_build, cpu_linear, llama, native, native_linear, native_pointwise

_LIBRARIES = (native._library, native_linear._library, native_pointwise._library)


@pytest.fixture
def rebuilt(monkeypatch, tmp_path):
    """Every kernel library built afresh into an empty cache, and the real ones back afterwards."""
    monkeypatch.setenv("ZSERVE_CACHE_DIR", str(tmp_path))
    for library in _LIBRARIES:
        library.cache_clear()
    yield
    for library in _LIBRARIES:
        library.cache_clear()


def test_a_compiler_that_fails_is_a_warning_and_no_library(monkeypatch, rebuilt, caplog):
    monkeypatch.setenv("CC", shutil.which("false") or "false")
    with caplog.at_level("WARNING", logger="zserve.engine"):
        assert c_build.build("probe", "int f(void) { return 0; }", c_build.FLAGS, "the probe") is None
    assert "could not build the probe's kernel" in caplog.text


def test_without_a_compiler_products_and_norms_run_on_onednn_and_torch(monkeypatch, rebuilt, caplog):
    monkeypatch.setenv("CC", "no-such-cc")
    torch.manual_seed(0)
    linear = nn.Linear(64, 32)
    x = torch.randn(5, 64)
    with caplog.at_level("WARNING", logger="zserve.engine"):
        packed = cpu_linear.PackedLinear(linear)
        assert not packed.native
        assert not native_pointwise.applies(x, 64)
    assert "no C compiler" in caplog.text
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), linear(x), rtol=1e-4, atol=1e-4)
    leaf = llama._leaf.__wrapped__(llama.rms_norm, "cpu")
    weight = torch.randn(64)
    assert torch.equal(leaf(x, weight, 1e-6), llama.rms_norm(x, weight, 1e-6))
