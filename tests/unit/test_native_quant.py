"""The int8 linear kernel (``native_quant.py``) on every ISA this CPU runs: the product of the dequantised
weights, to fp32 rounding, for 1-300 rows, odd shapes and 1-2 threads; and ``QuantLinear`` around it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from torch import nn

from zserve import gguf_quant
from zserve.generator import c_build, native_quant, quant_linear

needs_cc = pytest.mark.skipif(not c_build.has_compiler(), reason="no C compiler here: int8 layers run on torch")


def _tolerance(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """fp32 rounding of a sum over K terms, per output: K * eps * sum |x| |w|, plus a little."""
    return x.shape[-1] * 1.2e-7 * (x.abs().double() @ w.abs().double().T) + 1e-6


# rows: 1-8 one block of rows, 17 blocks of unequal size, 300 many; out: panels of every ISA's width and a
# last partial group of panels; K: one block of 32 and many
@needs_cc
@pytest.mark.parametrize("isa", c_build.runnable())
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 17, 64, 300])
@pytest.mark.parametrize(("out", "k"), [(16, 32), (208, 96), (48, 576)])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_kernel_computes_the_dequantised_product(isa, rows, out, k, threads):
    torch.manual_seed(rows * out + k)
    w, bias = torch.randn(out, k), torch.randn(out)
    # scales per block (as GGUF's Q8_0), not only per row
    q = torch.randint(-127, 128, (out, k), dtype=torch.int8)
    s = torch.rand(out, k // native_quant.BLOCK) * 0.02 + 1e-3
    assert native_quant.applies(out, k, isa)
    qp, sp = native_quant.pack(q, s, isa)
    x = torch.randn(rows, k)
    strided = torch.randn(rows, 2 * k)[:, ::2]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = native_quant.linear(x, qp, sp, bias, isa)
        got_strided = native_quant.linear(strided, qp, sp, None, isa)
    finally:
        torch.set_num_threads(before)
    wd = native_quant.dequantize(q, s)
    want = x.double() @ wd.double().T + bias.double()
    assert ((got.double() - want).abs() <= _tolerance(x, wd)).all()
    want_strided = strided.double() @ wd.double().T
    assert ((got_strided.double() - want_strided).abs() <= _tolerance(strided, wd)).all()
    del w


def test_per_channel_quantisation_is_symmetric_and_within_half_a_step():
    torch.manual_seed(0)
    w = torch.randn(24, 64)
    w[3] = 0  # an all-zero row stays zero
    q, s = native_quant.quantize_rows(w)
    assert q.dtype == torch.int8 and s.shape == (24, 2)
    assert (s[:, :1] == s).all()  # one scale a row
    assert q.abs().amax(dim=1)[torch.arange(24) != 3].eq(127).all()
    assert (native_quant.dequantize(q, s) - w).abs().le(s[:, :1] / 2 + 1e-7).all()
    assert (q[3] == 0).all()


@pytest.mark.parametrize(("out", "k"), [(208, 96), (200, 96), (208, 40)])  # 200, 40: the torch fallback
def test_a_quant_linear_computes_with_its_dequantised_weight(out, k):
    torch.manual_seed(out + k)
    linear = nn.Linear(k, out)
    layer = quant_linear.QuantLinear.from_linear(linear)
    assert layer.native == (c_build.has_compiler() and out % c_build.isa().width == 0 and k % 32 == 0)
    x = torch.randn(2, 5, k)
    with torch.inference_mode():
        got = layer(x)
        want = nn.functional.linear(x, layer.dequantized(), linear.bias)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # int8 values plus fp32 scales (one per 32 inputs) where the kernel takes it: 1.125 bytes a weight
    if layer.native:
        assert layer.weight_bytes() == out * k + 4 * out * k // 32


def test_an_unknown_quantization_is_refused_by_name():
    with pytest.raises(ValueError, match="'int4'"):
        quant_linear.check("int4")
    assert [quant_linear.check(q) for q in ("auto", "none", "int8")] == ["auto", "none", "int8"]


def _gguf_bytes(type_name: str, w: np.ndarray) -> np.ndarray:
    """``w`` in GGUF's ``type_name`` blocks: the gguf package's quantiser; Q4_K, which it lacks, random
    blocks with sane fp16 d and dmin."""
    if type_name != "Q4_K":
        return quants.quantize(w, GGMLQuantizationType[type_name])
    raw = np.random.default_rng(0).integers(0, 256, (w.shape[0], w.shape[1] // 256 * 144), dtype=np.uint8)
    blocks = raw.reshape(-1, 144)
    blocks[:, 0:2] = np.array([0.01], dtype=np.float16).view(np.uint8)
    blocks[:, 2:4] = np.array([0.003], dtype=np.float16).view(np.uint8)
    return raw


@pytest.mark.parametrize("type_name", gguf_quant.SUPPORTED)
def test_gguf_blocks_are_repacked_into_exactly_the_weights_gguf_dequantises(type_name):
    w = np.random.default_rng(1).standard_normal((48, 512)).astype(np.float32)
    raw = _gguf_bytes(type_name, w)
    want = quants.dequantize(raw, GGMLQuantizationType[type_name])
    b = gguf_quant.blocks(raw, type_name, 48, 512)
    assert b.q.dtype == torch.int8 and (b.m is not None) == (type_name in ("Q4_1", "Q4_K"))
    assert np.array_equal(native_quant.dequantize(b.q, b.s, b.m).numpy(), want)


@needs_cc
@pytest.mark.parametrize("isa", c_build.runnable())
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_the_kernel_adds_the_blocks_minimums(isa, rows):
    raw = quants.quantize(np.random.default_rng(rows).standard_normal((64, 256)).astype(np.float32),
                          GGMLQuantizationType.Q4_1)  # fmt: skip
    b = gguf_quant.blocks(raw, "Q4_1", 64, 256)
    layer_q, layer_s = native_quant.pack(b.q, b.s, isa)
    x = torch.randn(rows, 256)
    got = native_quant.linear(x, layer_q, layer_s, None, isa, native_quant.pack_blocks(b.m, isa))
    wd = native_quant.dequantize(b.q, b.s, b.m)
    # the minimums are added a block at a time (times the block's sum of x): rounding bounded by |q s| + |m|
    bound = native_quant.dequantize(b.q, b.s).abs() + native_quant.dequantize(torch.zeros_like(b.q), b.s, b.m).abs()
    assert ((got.double() - x.double() @ wd.double().T).abs() <= _tolerance(x, bound)).all()
