"""The C kernels for our model's per-layer operations on a CPU (``native_pointwise.py``): each computes what
its torch counterpart in ``llama.py`` does (to rounding), on the strided views the model hands over; widths
the kernels do not take run the torch function; the greedy argmax picks torch's index, ties and NaN too."""

from __future__ import annotations

import pytest
import torch

from zserve.generator import c_build, llama, native_pointwise

pytestmark = pytest.mark.skipif(not c_build.has_compiler(), reason="no C compiler here: these run on torch")


@pytest.fixture(autouse=True, params=c_build.runnable())
def isa(request, monkeypatch):
    """Every test on every instruction set this CPU runs (AVX2 built with -march=haswell on an AVX-512 CPU;
    the portable 4-float build everywhere): each has its own vector width, so its own kernel."""
    monkeypatch.setenv("ZSERVE_CPU_ISA", request.param)
    native_pointwise._library.cache_clear()
    yield request.param
    native_pointwise._library.cache_clear()


def close(got, want):
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 7, 33])
@pytest.mark.parametrize("width", [16, 64, 576])
def test_the_norms_compute_what_torch_does(rows, width):
    torch.manual_seed(rows * width)
    x, residual, weight = torch.randn(rows, width) * 3, torch.randn(rows, width), torch.randn(width)
    assert native_pointwise.applies(x, width)
    close(native_pointwise.rms_norm(x, weight, 1e-6), llama.rms_norm(x, weight, 1e-6))
    got, summed = native_pointwise.add_rms_norm(x, residual, weight, 1e-5)
    want, want_summed = llama.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(summed, want_summed)
    close(got, want)


def test_the_per_head_norm_and_rotary_take_strided_heads_of_the_merged_product():
    """Qwen3's q/k norms and rotary run on [T, heads + kv_heads, D] views of the q/k/v product's rows."""
    torch.manual_seed(0)
    t, heads, kv, d = 9, 6, 2, 64
    qkv = torch.randn(t, (heads + 2 * kv) * d)
    qk = qkv[:, : (heads + kv) * d].view(t, heads + kv, d)
    weight = torch.randn(heads + kv, d)
    close(native_pointwise.rms_norm(qk, weight, 1e-6), llama.rms_norm(qk, weight, 1e-6))
    freqs = torch.arange(3, 3 + t).float()[:, None] * torch.rand(d // 2)
    cos, sin = freqs.cos().unsqueeze(1), freqs.sin().unsqueeze(1)
    close(native_pointwise.rotary(qk, cos, sin), llama.rotary(qk, cos, sin))


@pytest.mark.parametrize("rows", [1, 5, 40])
def test_silu_mul_computes_what_torch_does(rows):
    torch.manual_seed(rows)
    gate_up = torch.randn(rows, 2 * 1536) * 8  # far into both tails of exp
    gate_up[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -90.0])
    close(native_pointwise.silu_mul(gate_up), llama.silu_mul(gate_up))


def test_widths_the_kernels_do_not_take_run_on_torch(monkeypatch):
    calls = []
    monkeypatch.setattr(native_pointwise, "silu_mul", lambda x: calls.append(x) or llama.silu_mul(x))
    leaf = llama._leaf.__wrapped__(llama.silu_mul, "cpu")  # what the model calls on a CPU
    x = torch.randn(3, 2 * 24)
    assert torch.equal(leaf(x), llama.silu_mul(x))  # 24 wide: torch's
    assert calls == []
    leaf(torch.randn(3, 2 * 32))  # 32 wide: the kernel
    assert len(calls) == 1
    assert not native_pointwise.applies(torch.randn(3, 64, dtype=torch.bfloat16), 64)
    assert not native_pointwise.applies(torch.randn(3, 128)[:, ::2], 64)  # not unit stride


def test_the_argmax_picks_torchs_index():
    torch.manual_seed(0)
    logits = torch.randn(6, 49152 + 5)  # a tail past the last vector of 16
    logits[1, 100] = logits[1, 200] = 50.0  # a tie: the first
    logits[2, -1] = 60.0  # in the tail
    logits[3, 7] = float("nan")  # torch's argmax takes a NaN as the largest
    logits[4] = float("-inf")
    assert torch.equal(native_pointwise.argmax(logits), logits.argmax(-1))
