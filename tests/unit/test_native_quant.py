"""The quantised linear kernel (``native_quant.py``) on every ISA this CPU runs (portable and AVX2 forced on
an AVX-512 machine): the product of the dequantised weights, to fp32 rounding, in every format (int8, int8
with minimums, 4-bit two a byte; fp16 or fp32 scales), for 1-300 rows, odd shapes and 1-3 threads; every
GGUF type's blocks through it against the gguf package's dequantisation; and ``QuantLinear`` around it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fuzzing import SLOW
from gguf import GGMLQuantizationType, quants
from torch import nn

from zserve import gguf_quant
from zserve.generator import c_build, kernel_choice, kernel_tune, native_quant, quant_linear

needs_cc = pytest.mark.skipif(not c_build.has_compiler(), reason="no C compiler here: int8 layers run on torch")


def _tolerance(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """fp32 rounding of a sum over K terms, per output: K * eps * sum |x| |w|, plus a little."""
    return x.shape[-1] * 1.2e-7 * (x.abs().double() @ w.abs().double().T) + 1e-6


# the kernel's formats: (bits, with minimums, scales exact in fp16: stored fp16)
FORMS = {
    "i8": (8, False, False),  # per-channel int8
    "i8-f16": (8, False, True),  # Q8_0
    "i8m": (8, True, True),  # a product stacking 8-bit and 4-bit parts
    "u4m-f16": (4, True, True),  # Q4_0, Q4_1
    "u4m": (4, True, False),  # Q4_K
}


def _weights(form: str, out: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
    bits, with_min, half = FORMS[form]
    lo, hi = (0, 16) if bits == 4 else (-127, 128)
    q = torch.randint(lo, hi, (out, k), dtype=torch.int8)
    s = torch.rand(out, k // native_quant.BLOCK) * 0.02 + 1e-3  # scales per block (as GGUF's), not only per row
    m = torch.randn(out, k // native_quant.BLOCK) * 0.05 if with_min else None
    if half:
        s, m = s.half().float(), None if m is None else m.half().float()
    return q, s, m, bits


# rows: 1-8 one block of rows, 17 blocks of unequal size, 300 many; out: panels of every ISA's width and a
# last partial group of panels; K: one block of 32 and many (odd numbers of blocks). CI runs a sample of the rows
# and threads (every form, ISA and shape); ZSERVE_SLOW=1 all of them.
ROWS = [1, 2, 3, 5, 8, 9, 17, 300] if SLOW else [1, 3, 5, 9, 17, 300]
THREADS = [1, 2, 3] if SLOW else [1, 3]


@needs_cc
@pytest.mark.parametrize("isa", c_build.runnable())
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("threads", THREADS)
def test_the_kernel_computes_the_dequantised_product(isa, form, rows, threads):
    for out, k in [(16, 32), (208, 96), (48, 576)]:
        torch.manual_seed(rows * out + k)
        bias = torch.randn(out)
        q, s, m, bits = _weights(form, out, k)
        assert native_quant.applies(out, k, isa)
        w = native_quant.pack(q, s, m, isa, bits)
        assert w.fmt == form.split("-")[0] and w.s.dtype == (torch.float16 if FORMS[form][2] else torch.float32)
        assert w.shape == (out, k) and torch.equal(w.dequantized(), native_quant.dequantize(q, s, m))
        x = torch.randn(rows, k)
        strided = torch.randn(rows, 2 * k)[:, ::2]
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            got = native_quant.linear(x, w, bias)
            got_strided = native_quant.linear(strided, w, None)
        finally:
            torch.set_num_threads(before)
        wd = native_quant.dequantize(q, s, m)
        # the minimums are added a block at a time (times the block's sum of x): rounding bounded by |q s| + |m|
        bound = native_quant.dequantize(q, s).abs() + (0 if m is None else m.abs().repeat_interleave(32, dim=1))
        want = x.double() @ wd.double().T + bias.double()
        assert ((got.double() - want).abs() <= _tolerance(x, bound)).all()
        want_strided = strided.double() @ wd.double().T
        assert ((got_strided.double() - want_strided).abs() <= _tolerance(strided, bound)).all()


@pytest.mark.parametrize("form", FORMS)
def test_packed_weights_take_their_bytes_and_give_back_their_rows(form):
    torch.manual_seed(3)
    q, s, m, bits = _weights(form, 64, 96)
    w = native_quant.pack(q, s, m, bits=bits)
    per_block = (2 if FORMS[form][2] else 4) * (2 if m is not None else 1)
    assert w.nbytes() == 64 * 96 * bits // 8 + 64 * 3 * per_block  # Q4_1: 0.5 + 4/32 = 0.625 bytes a weight
    ids = torch.tensor([0, 63, 17, 17, 5])
    assert torch.equal(w.rows(ids), native_quant.dequantize(q, s, m)[ids])


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
def test_a_quant_linear_computes_with_its_dequantised_weight(out, k, monkeypatch):
    # the fp32-activation kernel, forced (test_native_quant_i8 has the int8 one's)
    monkeypatch.setenv(kernel_tune.QUANT_ACTIVATIONS_ENV, kernel_choice.FP32)
    torch.manual_seed(out + k)
    linear = nn.Linear(k, out)
    layer = quant_linear.QuantLinear.from_linear(linear)
    assert layer.native == (c_build.has_compiler() and out % c_build.isa().width == 0 and k % 32 == 0)
    assert (layer.packed is not None) == layer.native
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
    assert b.q.dtype == torch.int8 and (b.m is not None) == (type_name != "Q8_0")
    assert b.bits == (8 if type_name == "Q8_0" else 4) and (b.bits == 8 or (0 <= b.q.min() and b.q.max() <= 15))
    assert np.array_equal(native_quant.dequantize(b.q, b.s, b.m).numpy(), want)
    # packed for the kernel (4-bit two a byte, scales fp16 where exact): still exactly those weights
    for isa in c_build.runnable():
        packed = native_quant.pack(b.q, b.s, b.m, isa, b.bits)
        assert np.array_equal(packed.dequantized().numpy(), want)
        # what the file stores, and no more: Q8_0 1.0625 bytes a weight, Q4_0 / Q4_1 0.625, Q4_K 0.75
        per_weight = {"Q8_0": 1.0625, "Q4_0": 0.625, "Q4_1": 0.625, "Q4_K": 0.75}[type_name]
        assert packed.nbytes() == 48 * 512 * per_weight


@needs_cc
@pytest.mark.parametrize("isa", c_build.runnable())
@pytest.mark.parametrize("type_name", gguf_quant.SUPPORTED)
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_the_kernel_computes_with_every_gguf_types_blocks(isa, type_name, rows):
    rng = np.random.default_rng(rows)
    raw = _gguf_bytes(type_name, rng.standard_normal((64, 512)).astype(np.float32))
    b = gguf_quant.blocks(raw, type_name, 64, 512)
    w = native_quant.pack(b.q, b.s, b.m, isa, b.bits)
    x = torch.randn(rows, 512)
    got = native_quant.linear(x, w, None)
    wd = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType[type_name]))
    bound = native_quant.dequantize(b.q, b.s).abs() + (0 if b.m is None else b.m.abs().repeat_interleave(32, dim=1))
    assert ((got.double() - x.double() @ wd.double().T).abs() <= _tolerance(x, bound)).all()
