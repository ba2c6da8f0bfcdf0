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


def test_the_kernels_build_for_the_isa_named_and_refuse_one_this_cpu_does_not_run(monkeypatch, caplog):
    best = c_build.runnable()[0]
    assert c_build.isa().name == best and "-march=native" in c_build.isa().flags
    assert c_build.runnable()[-1] == "portable"
    for name in c_build.runnable()[1:]:
        monkeypatch.setenv("ZSERVE_CPU_ISA", name)
        assert c_build.isa() == c_build.ISAS[name]  # a lower ISA: its own flags, not this CPU's
    monkeypatch.setenv("ZSERVE_CPU_ISA", "sse9")
    with caplog.at_level("WARNING", logger="zserve.engine"):
        assert c_build.isa().name == best
    assert "ZSERVE_CPU_ISA=sse9" in caplog.text


@pytest.mark.skipif(not c_build.has_compiler(), reason="no C compiler here")
@pytest.mark.parametrize("name", c_build.runnable())
def test_the_vector_helpers_sum_and_exponentiate_on_every_isa(name, rebuilt):
    """``vsums`` (a tree of shuffles) gives each vector's lane sum in its lane; ``vexp`` is expf to ~2 ulp."""
    import ctypes

    isa = c_build.for_name(name)
    source = (
        c_build.vectors(isa.width)
        + r"""
void sums(const float *p, float *out) { vf v[VW]; for (int i = 0; i < VW; i++) v[i] = vload(p + i * VW);
                                        vstore(out, vsums(v)); }
void exps(const float *x, float *out, int n) { for (int i = 0; i < n; i += VW) vstore(out + i, vexp(vload(x + i))); }
"""
    )
    lib = c_build.build(f"probe-{name}", source, isa.flags, "the probe")
    assert lib is not None
    w = isa.width
    x = torch.randn(w, w)
    out = torch.empty(w)
    lib.sums(ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(out.data_ptr()))
    torch.testing.assert_close(out, x.sum(1), rtol=1e-5, atol=1e-5)
    y = torch.linspace(-87, 88, 64 * w)  # where fp32 has an exp (the kernels clamp outside)
    e = torch.empty_like(y)
    lib.exps(ctypes.c_void_p(y.data_ptr()), ctypes.c_void_p(e.data_ptr()), ctypes.c_int(y.numel()))
    torch.testing.assert_close(e, y.exp(), rtol=1e-6, atol=0)


@pytest.mark.skipif(not c_build.has_compiler(), reason="no C compiler here")
def test_a_damaged_cached_library_is_built_again_not_loaded(monkeypatch, tmp_path):
    """A library cut short after its build (a crash, a bad copy) killed the engine with SIGBUS in dlopen: its seal
    (size, sha256) no longer matches, so it is built again."""
    import subprocess
    import sys

    monkeypatch.setenv("ZSERVE_CACHE_DIR", str(tmp_path))
    code = (
        "from zserve.generator import c_build; "
        "lib = c_build.build('probe', 'int seven(void) { return 7; }', ['-O1', '-shared', '-fPIC'], 'the probe'); "
        "assert lib is not None and lib.seven() == 7"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    [so] = (tmp_path / "kernels").glob("*.so")
    whole = so.read_bytes()
    for size in (0, 4096):
        so.write_bytes(whole[:size])
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, (size, run.returncode, run.stderr[-2000:])
        assert so.read_bytes() == whole
