"""oneDNN-prepacked linear layers (the engine's default on a CPU): the same products as ``nn.Linear``, every
linear layer replaced, a tied ``lm_head`` leaving the embedding it shares intact."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from zserve.generator import cpu_linear


@pytest.mark.parametrize("rows", [1, 3, 8, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_packed_linear_computes_what_nn_linear_does(rows, bias, dtype):
    if not cpu_linear.packs(dtype):
        pytest.skip(f"oneDNN does not pack {dtype} on this CPU (bf16 needs AVX-512 bw/vl/dq or AVX-NE-CONVERT)")
    torch.manual_seed(rows)
    linear = nn.Linear(96, 200, bias=bias).to(dtype)
    x = torch.randn(1, rows, 96, dtype=dtype)
    every_other = torch.randn(1, rows, 192, dtype=dtype)[..., ::2]  # not contiguous
    with torch.inference_mode():
        want = linear(x)
        got = cpu_linear.PackedLinear(linear)(x)
        strided = cpu_linear.PackedLinear(linear)(every_other)
        want_strided = linear(every_other)
    assert got.shape == want.shape == strided.shape
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    torch.testing.assert_close(strided, want_strided, rtol=tol, atol=tol)


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
