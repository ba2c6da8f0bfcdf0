"""Packed linear layers (the engine's default on a CPU), through our C kernel (fp32) or oneDNN: the same
products as ``nn.Linear``, every linear layer replaced, a tied ``lm_head`` leaving the embedding it shares
intact."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from zserve.generator import c_build, cpu_linear, kernel_choice, native_linear


# rows: 1-8 take one tile of rows, 17 three of 6/6/5, 300 many; out: 208 = 13 panels of 16 (some in tiles of
# one panel), 200 is no whole number of panels (oneDNN takes it)
@pytest.mark.parametrize("rows", [1, 3, 8, 17, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("dtype", "out"), [(torch.float32, 208), (torch.float32, 200), (torch.bfloat16, 208)])
@pytest.mark.parametrize("native", [True, False], ids=["native", "onednn"])
def test_a_packed_linear_computes_what_nn_linear_does(rows, bias, dtype, out, native):
    if not cpu_linear.packs(dtype):
        pytest.skip(f"oneDNN does not pack {dtype} on this CPU (bf16 needs AVX-512 bw/vl/dq or AVX-NE-CONVERT)")
    torch.manual_seed(rows)
    linear = nn.Linear(96, out, bias=bias).to(dtype)
    x = torch.randn(1, rows, 96, dtype=dtype)
    every_other = torch.randn(1, rows, 192, dtype=dtype)[..., ::2]  # not contiguous
    packed = cpu_linear.PackedLinear(linear, native)
    if native and dtype == torch.float32 and out % 16 == 0 and c_build.has_compiler():
        assert packed.native  # our kernel takes it; elsewhere oneDNN does
    else:
        assert not packed.native
    with torch.inference_mode():
        want = linear(x)
        got = packed(x)
        strided = packed(every_other)
        want_strided = linear(every_other)
    assert got.shape == want.shape == strided.shape
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    torch.testing.assert_close(strided, want_strided, rtol=tol, atol=tol)


@pytest.mark.parametrize("threads", [2, 3])
def test_the_native_kernel_splits_the_panels_over_torchs_threads(threads):
    if not c_build.has_compiler():
        pytest.skip("no C compiler here: the products run on oneDNN")
    torch.manual_seed(threads)
    linear = nn.Linear(64, 16 * 23, bias=True)  # 23 panels: groups of 3, 4, 6 and 8 leave a remainder
    packed = cpu_linear.PackedLinear(linear)
    saved = torch.get_num_threads()
    try:
        for rows in (1, 2, 5, 9, 40):
            x = torch.randn(rows, 64)
            torch.set_num_threads(1)
            alone = packed(x)
            torch.set_num_threads(threads)
            with torch.inference_mode():
                torch.testing.assert_close(packed(x), linear(x), rtol=1e-4, atol=1e-4)
            assert torch.equal(packed(x), alone)  # each output is summed by one thread, in the same order
    finally:
        torch.set_num_threads(saved)


def test_prepack_replaces_every_linear_and_keeps_tied_embeddings():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(0, 128, (1, 12))
    with torch.inference_mode():
        want = model(ids).logits
        assert cpu_linear.available(model)
        assert cpu_linear.prepack(model) == 2 * 7 + 1
        assert not any(type(m) is nn.Linear for m in model.modules())
        got = model(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert model.model.embed_tokens.weight.shape == (128, 32)  # the embedding the lm_head shared is kept


def test_a_model_in_a_dtype_this_cpu_cannot_pack_keeps_nn_linear():
    """What ``available`` answers is what the reorder does: a model it accepts packs, one it refuses is left
    alone by the engine (bf16 on a CPU without AVX-512, fp16 everywhere)."""
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        model = nn.Sequential(nn.Linear(16, 16)).to(dtype)
        try:
            torch.ops.mkldnn._reorder_linear_weight(model[0].weight.detach(), 8)
            reorders = dtype != torch.float16  # oneDNN may accept fp16 weights; the engine only packs fp32/bf16
        except RuntimeError:
            reorders = False
        assert cpu_linear.available(model) == reorders, dtype


# every schedule of the kernel on every ISA this CPU runs (AVX2 through -march=haswell on an AVX-512 machine;
# portable through plain x86-64 / the host's own flags elsewhere)
_VARIANTS = [(isa, v) for isa in c_build.runnable() for v in native_linear.variants(isa)]


@pytest.mark.skipif(not c_build.has_compiler(), reason="no C compiler here: the products run on oneDNN")
@pytest.mark.parametrize(("isa", "variant"), _VARIANTS, ids=[f"{isa}-{v.name}" for isa, v in _VARIANTS])
def test_every_variant_on_every_isa_computes_what_nn_linear_does(isa, variant):
    """Rows 1-300 (one block, blocks of even size, many blocks, every block size up to the variant's cap);
    bias and none; a strided input; outputs in whole groups of panels and with a partial last group."""
    width = c_build.ISAS[isa].width
    saved = torch.get_num_threads()
    try:
        for out in (width * 13, width * 2):
            for bias in (False, True):
                torch.manual_seed(out + bias)
                linear = nn.Linear(40, out, bias=bias)
                packed = native_linear.pack(linear.weight, variant)
                b = None if linear.bias is None else linear.bias.detach()
                for rows in (*range(1, variant.cap + 2), 17, 64, 300):
                    x = torch.randn(rows, 80)[:, ::2]  # not contiguous
                    for threads in (1, 2):
                        torch.set_num_threads(threads)
                        with torch.inference_mode():
                            got = native_linear.linear(x, packed, b, variant)
                            torch.testing.assert_close(got, linear(x), rtol=1e-4, atol=1e-4, msg=f"{rows} rows")
    finally:
        torch.set_num_threads(saved)


@pytest.mark.skipif(not c_build.has_compiler(), reason="no C compiler here: the products run on oneDNN")
def test_a_route_runs_each_row_bucket_on_its_candidate_and_keeps_only_the_forms_it_needs():
    isa = c_build.isa().name
    variant = native_linear.variants(isa)[-1]
    route = kernel_choice.Route((1, 8, 64), (kernel_choice.native(isa, variant.name), kernel_choice.TORCH,
                                             kernel_choice.ONEDNN))  # fmt: skip
    torch.manual_seed(0)
    linear = nn.Linear(48, 96, bias=True)
    packed = cpu_linear.PackedLinear(linear, route=route)
    assert set(packed.forms) == {f"native:{isa}", "torch", "onednn"}
    assert packed.native
    for rows, kind in (
        (1, route.kinds[0]),
        (2, route.kinds[0]),
        (3, "torch"),
        (22, "torch"),
        (23, "onednn"),
        (500, "onednn"),
    ):  # the limits are the geometric means: sqrt(8) ~ 2.8, sqrt(512) ~ 22.6
        assert route.kind(rows) == kind, rows
        x = torch.randn(rows, 48)
        with torch.inference_mode():
            torch.testing.assert_close(packed(x), linear(x), rtol=1e-4, atol=1e-4)
    onednn_only = cpu_linear.PackedLinear(linear, route=kernel_choice.Route((1,), (kernel_choice.ONEDNN,)))
    assert set(onednn_only.forms) == {"onednn"} and not onednn_only.native
