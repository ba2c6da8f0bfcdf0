"""The int8-activation kernel (``native_quant_i8.py``) on every ISA this CPU runs (portable and AVX2 forced on
an AVX-512 machine; AVX-512 VNNI where present): the activations quantised in C exactly as the torch reference
quantises them; the product equal to the reference (the dequantised weights times the int8-quantised
activations, in float64) to fp32 rounding, and within the stated bound of the fp32-activation product, in every
format, for 1-300 rows, odd shapes and 1-3 threads; every GGUF type's blocks through it; and ``QuantLinear``
with each kernel forced and chosen by measurement."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from fuzzing import SLOW
from gguf import GGMLQuantizationType, quants
from test_native_quant import FORMS, ROWS, THREADS, _gguf_bytes, _weights
from torch import nn

from zserve import gguf_quant
from zserve.generator import c_build, kernel_choice, kernel_tune, native_quant, quant_linear
from zserve.generator import native_quant_i8 as i8

needs_cc = pytest.mark.skipif(not c_build.has_compiler(), reason="no C compiler here: int8 layers run on torch")
EPS = 1.2e-7  # fp32's unit roundoff, and a little


def _bounds(x, q, s, m, bias, terms=i8.TERMS):
    """(fp32 rounding of the kernel's sums: (K/32 + 4) eps times the sum of the terms' magnitudes; what int8
    activations may move an output from the fp32-activation product: sum over blocks of d / 2 * sum |w| in one
    term, d / 256 * sum |w| in two)."""
    xq, d = i8.quantize_activations(x, terms)
    wabs = native_quant.dequantize(q, s).abs().double()
    sizes = i8.dequantize_activations(xq.abs(), d) if terms == 1 else x.double().abs() * 1.01
    terms_abs = sizes @ wabs.T
    if m is not None:
        terms_abs += x.double().abs().reshape(x.shape[0], -1, 32).sum(dim=2) @ m.double().abs().T
    terms_abs += 0 if bias is None else bias.double().abs()
    rounding = (x.shape[1] / 32 + 4) * EPS * terms_abs + 1e-6
    wd = native_quant.dequantize(q, s, m).abs().double()
    blocks = wd.reshape(wd.shape[0], -1, 32).sum(dim=2)  # [N, K/32]: sum |w| a block
    activations = (d.double() / (2 if terms == 1 else 256) * 1.001) @ blocks.T
    return rounding, activations


@needs_cc
@pytest.mark.parametrize("isa", c_build.runnable())
@pytest.mark.parametrize("terms", [1, 2])
def test_activations_are_quantised_in_c_exactly_as_the_reference_does(isa, terms):
    torch.manual_seed(0)
    x = torch.randn(7, 96) * torch.logspace(-3, 3, 7).unsqueeze(1)
    x[2] = 0  # an all-zero block: d = 0, xq = 0
    x[3, 5] = 1e-30  # d far below 1: 1 / d still finite
    x[4, :32] = torch.arange(32) - 15.5  # halves: rounded to nearest even, as rintf
    xq, d = i8.quantize_in_c(x, isa, terms)
    want_q, want_d = i8.quantize_activations(x, terms)
    assert xq.shape == (7, 96 * terms) and torch.equal(xq, want_q) and torch.equal(d, want_d)
    assert xq.abs().max() <= 127 and (xq[2] == 0).all() and (d[2] == 0).all()
    if terms == 2:  # the rest, in 1/128 of d: within half of d, so |xr| <= 64
        assert xq[:, 96:].abs().max() <= 64
    err = (i8.dequantize_activations(xq, d) - x.double()).abs()
    assert (err <= d.double().repeat_interleave(32, dim=1) / (2 if terms == 1 else 256) * 1.001).all()


# rows: 1-4 one block of rows, 5-9 blocks of unequal size, 17, 300 many; out: panels of every ISA's width and a
# last partial group of panels; K: one block of 32 and many (odd numbers of blocks)
@needs_cc
@pytest.mark.parametrize("isa", c_build.runnable())
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("rows", ROWS)  # a sample in CI, all with ZSERVE_SLOW=1 (test_native_quant.py)
@pytest.mark.parametrize("threads", THREADS)
def test_the_kernel_computes_the_product_with_int8_activations(isa, form, rows, threads):
    for out, k, terms in [(16, 32, 1), (16, 32, 2), (208, 96, 2), (48, 576, 1), (48, 576, 2)]:
        torch.manual_seed(rows * out + k)
        bias = torch.randn(out)
        q, s, m, bits = _weights(form, out, k)
        assert i8.applies(q, out, k, isa)
        w = i8.pack(q, s, m, isa, bits, terms)
        assert w.fmt == form.split("-")[0] and w.s.dtype == (torch.float16 if FORMS[form][2] else torch.float32)
        assert w.shape == (out, k) and torch.equal(w.dequantized(), native_quant.dequantize(q, s, m))
        x = torch.randn(rows, k)
        strided = torch.randn(rows, 2 * k)[:, ::2]
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            got = i8.linear(x, w, bias)
            got_strided = i8.linear(strided, w, None)
        finally:
            torch.set_num_threads(before)
        rounding, activations = _bounds(x, q, s, m, bias, terms)
        assert ((got.double() - i8.reference(x, q, s, m, bias, terms)).abs() <= rounding).all()
        fp32 = x.double() @ native_quant.dequantize(q, s, m).double().T + bias.double()
        assert ((got.double() - fp32).abs() <= activations + rounding).all()
        rounding, _ = _bounds(strided, q, s, m, None, terms)
        assert ((got_strided.double() - i8.reference(strided, q, s, m, None, terms)).abs() <= rounding).all()


# the int8 layout at fp32 activations from `many` rows on: below native_quant_i8.MANY_ROWS (6 or 8 rows of 4-bit
# weights, 12 of 8-bit) the weights converted in registers, from it a group of panels dequantised once (fp32
# tiles). A sample in CI (~5 s), every row count of the int8 kernel's test and both limits with ZSERVE_SLOW=1.
# Outputs: odd numbers of the ISA's panels (5 and 7), so that every path's groups of 2, 3 or 4 panels end in a
# partial group on every ISA (208 and 48 outputs made even counts of AVX2's and the portable build's panels)
SPLIT_ROWS = sorted({*ROWS, 7, 12, 33}) if SLOW else [1, 7, 12, 33]


@needs_cc
@pytest.mark.parametrize("isa", c_build.runnable())
@pytest.mark.parametrize("form", FORMS)
def test_from_its_split_the_int8_layout_runs_fp32_activations(isa, form):
    vw = c_build.ISAS[isa].width
    for out, k in [(16, 32), (7 * vw, 96), (5 * vw, 576)] if SLOW else [(7 * vw, 96), (5 * vw, 576)]:
        torch.manual_seed(out + k)
        bias = torch.randn(out)
        q, s, m, bits = _weights(form, out, k)
        fp32_weight = native_quant.dequantize(q, s, m).double()
        packs = {many: i8.pack(q, s, m, isa, bits, many=many) for many in (1, 9)}
        for rows in SPLIT_ROWS:
            x = torch.randn(rows, k)
            rounding, _ = _bounds(x, q, s, m, bias)  # fp32 rounding of sums over |x| |w|
            fp32 = x.double() @ fp32_weight.T + bias.double()  # the dequantised weights times x itself
            int8 = i8.reference(x, q, s, m, bias) if rows < 9 else None
            for (many, w), threads in itertools.product(packs.items(), THREADS):
                before = torch.get_num_threads()
                torch.set_num_threads(threads)
                try:
                    got = i8.linear(x, w, bias).double()
                finally:
                    torch.set_num_threads(before)
                assert ((got - (fp32 if rows >= many else int8)).abs() <= rounding).all()


@needs_cc
def test_a_split_past_a_c_int_is_clamped_to_never():
    torch.manual_seed(3)
    q, s, m, bits = _weights("u4m-f16", 48, 96)
    x = torch.randn(9, 96)
    never = i8.linear(x, i8.pack(q, s, m, bits=bits), None)
    for many in (2**31, 2**32 + 1):  # wrapped in C: 2**31 to -2**31, every call at fp32 activations
        w = i8.pack(q, s, m, bits=bits, many=many)
        assert w.many == i8.NEVER and torch.equal(i8.linear(x, w, None), never)
    assert i8.pack(q, s, m, bits=bits, many=-(2**40)).many == 1


@pytest.mark.parametrize("form", FORMS)
def test_packed_weights_take_the_fp32_kernels_bytes_and_give_back_their_rows(form):
    torch.manual_seed(3)
    q, s, m, bits = _weights(form, 64, 96)
    w, plain = i8.pack(q, s, m, bits=bits), native_quant.pack(q, s, m, bits=bits)
    assert w.nbytes() == plain.nbytes()
    assert torch.equal(w.values(), plain.values())
    ids = torch.tensor([0, 63, 17, 17, 5])
    assert torch.equal(w.rows(ids), native_quant.dequantize(q, s, m)[ids])


def test_an_8_bit_weight_of_minus_128_stays_on_the_fp32_kernel():
    q = torch.zeros(16, 32, dtype=torch.int8)
    isa = c_build.isa().name
    assert i8.applies(q, 16, 32, isa) == native_quant.applies(16, 32, isa)
    q[3, 7] = -128  # AVX2's sign trick cannot negate it
    assert not i8.applies(q, 16, 32, isa)


@needs_cc
@pytest.mark.parametrize("isa", c_build.runnable())
@pytest.mark.parametrize("type_name", gguf_quant.SUPPORTED)
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_the_kernel_computes_with_every_gguf_types_blocks(isa, type_name, rows):
    rng = np.random.default_rng(rows)
    raw = _gguf_bytes(type_name, rng.standard_normal((64, 512)).astype(np.float32))
    b = gguf_quant.blocks(raw, type_name, 64, 512)
    w = i8.pack(b.q, b.s, b.m, isa, b.bits)
    assert np.array_equal(w.dequantized().numpy(), quants.dequantize(raw, GGMLQuantizationType[type_name]))
    x = torch.randn(rows, 512)
    got = i8.linear(x, w, None)
    rounding, activations = _bounds(x, b.q, b.s, b.m, None)
    assert ((got.double() - i8.reference(x, b.q, b.s, b.m)).abs() <= rounding).all()
    wd = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType[type_name]))
    assert ((got.double() - x.double() @ wd.double().T).abs() <= activations + rounding).all()


@needs_cc
@pytest.mark.parametrize("forced", [kernel_choice.FP32, kernel_choice.INT8, kernel_choice.INT8_ONE])
@pytest.mark.parametrize("bits", [8, 4])
def test_a_quant_linear_runs_the_kernel_forced_on_it(monkeypatch, forced, bits):
    monkeypatch.setenv(kernel_tune.QUANT_ACTIVATIONS_ENV, forced)
    torch.manual_seed(bits)
    q, s, m, _ = _weights("u4m-f16" if bits == 4 else "i8", 208, 96)
    bias = torch.randn(208)
    layer = quant_linear.QuantLinear.from_blocks(q, s, m, bias, bits)
    assert layer.activations == forced and f"{forced} activations" in repr(layer)
    assert isinstance(layer.packed, i8.PackedI8) == (forced != kernel_choice.FP32)
    terms = 1 if forced == kernel_choice.INT8_ONE else 2
    assert not isinstance(layer.packed, i8.PackedI8) or layer.packed.terms == terms
    x = torch.randn(2, 5, 96)
    with torch.inference_mode():
        got = layer(x).reshape(10, 208).double()
    rows = x.reshape(10, 96)
    rounding, _ = _bounds(rows, q, s, m, bias, terms)
    if forced != kernel_choice.FP32:
        want = i8.reference(rows, q, s, m, bias, terms)
    else:
        want = rows.double() @ native_quant.dequantize(q, s, m).double().T + bias.double()
    assert ((got - want).abs() <= rounding).all()


@needs_cc
def test_unforced_the_kernel_is_chosen_by_measurement(monkeypatch, caplog):
    monkeypatch.delenv(kernel_tune.QUANT_ACTIVATIONS_ENV, raising=False)
    kernel_tune._measured_quant.cache_clear()
    isa = c_build.isa().name
    with caplog.at_level("INFO", logger="zserve.engine"):
        chosen = kernel_tune.quant_path(64, 96, 4, True, True, isa)
    assert chosen in (kernel_choice.FP32, kernel_choice.INT8)
    assert any("96x64 4-bit with minimums products" in r.getMessage() and f"{chosen} activations" in r.getMessage()
               for r in caplog.records)  # fmt: skip
    layer = quant_linear.QuantLinear(torch.randint(0, 16, (64, 96), dtype=torch.int8), torch.rand(64, 3).half().float(),
                                     None, torch.zeros(64, 3), bits=4)  # fmt: skip
    # the same shape and form: measured once a process, the row count of its split with it
    assert (layer.activations, layer.many_rows) == kernel_tune.quant_choice(64, 96, 4, True, True, isa)
    assert layer.many_rows == kernel_choice.NEVER or (chosen == kernel_choice.INT8 and layer.packed.many >= 1)
    # 4-bit: 8 rows are timed on the path of i8.MANY_ROWS rows and more, so no split between 1 and it
    assert layer.many_rows == 1 or layer.many_rows >= i8.MANY_ROWS[isa][1]
    assert not isinstance(layer.packed, i8.PackedI8) or layer.packed.many == layer.many_rows
    if layer.many_rows != kernel_choice.NEVER:
        assert f"fp32 from {layer.many_rows} rows" in repr(layer)
    x = torch.randn(40, 96)
    want = x.double() @ layer.dequantized().double().T
    with torch.inference_mode():
        assert (layer(x).double() - want).abs().max() < 1e-2  # int8 or fp32 activations: near either way
    # a weight the int8 kernel cannot take is never measured for it
    q = torch.zeros(64, 96, dtype=torch.int8)
    q[0, 0] = -128
    assert quant_linear.QuantLinear(q, torch.ones(64, 3), None).activations == kernel_choice.FP32


def test_an_unknown_forced_kernel_measures_instead(monkeypatch, caplog):
    monkeypatch.setenv(kernel_tune.QUANT_ACTIVATIONS_ENV, "int4")
    monkeypatch.setattr(kernel_tune, "_measured_quant", lambda *a: (kernel_choice.INT8, kernel_choice.NEVER))
    with caplog.at_level("WARNING", logger="zserve.engine"):
        assert kernel_tune.quant_path(64, 96, 8, False, True, "portable") == kernel_choice.INT8
    assert "ZSERVE_QUANT_ACTIVATIONS=int4" in caplog.text


def test_an_nn_linear_quantised_per_channel_runs_int8_activations(monkeypatch):
    monkeypatch.setenv(kernel_tune.QUANT_ACTIVATIONS_ENV, kernel_choice.INT8)
    torch.manual_seed(5)
    linear = nn.Linear(96, 208)
    layer = quant_linear.QuantLinear.from_linear(linear)
    if not layer.native:
        pytest.skip("no C compiler here")
    x = torch.randn(3, 96)
    q, s = native_quant.quantize_rows(linear.weight)
    with torch.inference_mode():
        got = layer(x).double()
    rounding, _ = _bounds(x, q, s, None, linear.bias.detach())
    assert ((got - i8.reference(x, q, s, None, linear.bias.detach())).abs() <= rounding).all()


@needs_cc
@pytest.mark.parametrize("isa", c_build.runnable())
def test_a_nan_in_the_activations_comes_out_nan_and_a_vanishing_block_as_zeros(isa):
    """A NaN in a row (a blow-up upstream) makes that row's outputs NaN, as the fp32 kernel's, rather than finite
    garbage (its float->int conversion would be undefined in C); a block of values below 1e-28 quantises to zeros
    (1 / d would overflow)."""
    torch.manual_seed(1)
    x = torch.randn(3, 64)
    x[0, 7] = float("nan")
    x[2, :32] = 1e-35
    xq, d = i8.quantize_in_c(x, isa, 2)
    want_q, want_d = i8.quantize_activations(x, 2)
    assert torch.equal(xq, want_q) and torch.equal(d.isnan(), want_d.isnan())
    assert d[0, 0].isnan() and (xq[0, :32] == 0).all() and (xq[2, :32] == 0).all() and (xq[2, 64:96] == 0).all()
    q, s, m, bits = _weights("i8", 16, 64)
    w = i8.pack(q, s, m, isa, bits)
    y = i8.linear(x, w, None)
    assert y[0].isnan().all() and y[1:].isfinite().all()
    with pytest.raises(ValueError, match="64"):
        i8.linear(x[:, :32], w, None)
