"""Our Llama-family model code (zserve/generator/llama.py): greedy output equals Hugging Face ``generate``
token for token for tiny models of each architecture (GQA and not, tied and untied embeddings, biases, Qwen3's
q/k norms), with staggered arrivals, chunked prefill, preemption and prefix caching; ``model_impl`` picks."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from test_step_core import expected, prompts

from zserve.generator import cpu_linear
from zserve.generator.generator import GeneratorOptions, warm_step
from zserve.generator.llama import LlamaFamily, own_model, rms_norm, unsupported
from zserve.generator.sequence import SamplingParams
from zserve.generator.step_core import StepCore

_SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, max_position_embeddings=512)

# (architecture, config overrides): GQA and not, tied and untied, biases, Qwen3's q/k norm and wide heads
FAMILIES = {
    "llama-gqa-untied": ("llama", dict(num_attention_heads=4, num_key_value_heads=2)),
    "llama-mha-tied-bias": ("llama", dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True,
                                          attention_bias=True, mlp_bias=True)),
    "llama3-rope": ("llama", dict(num_attention_heads=4, num_key_value_heads=1, rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "mistral": ("mistral", dict(num_attention_heads=4, num_key_value_heads=1)),
    "qwen2-tied": ("qwen2", dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen2-mha": ("qwen2", dict(num_attention_heads=4, num_key_value_heads=4)),
    "qwen3-gqa": ("qwen3", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32)),
    "qwen3-mha-tied": ("qwen3", dict(num_attention_heads=2, num_key_value_heads=2, head_dim=16,
                                     tie_word_embeddings=True)),
}  # fmt: skip


def tiny(name: str):
    import transformers

    arch, extra = FAMILIES[name]
    prefix = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}[arch]
    # initializer_range 0.1 (not 0.02): with tied embeddings, small layers leave argmax on the input token
    config = getattr(transformers, f"{prefix}Config")(
        **_SHAPE, **extra, eos_token_id=None, bos_token_id=None, pad_token_id=0, initializer_range=0.1
    )
    torch.manual_seed(0)
    model = getattr(transformers, f"{prefix}ForCausalLM")(config).eval()
    with torch.no_grad():  # random biases and norm weights, so that getting them wrong shows
        for name_, p in model.named_parameters():
            if name_.endswith(("bias", "norm.weight")):
                p.normal_(1.0, 0.2) if name_.endswith("norm.weight") else p.normal_(0.0, 0.02)
    return model


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    return request.param, tiny(request.param)


def run(engine: StepCore, batch: list[list[int]], n_new: int, every: int = 2) -> dict[int, list[int]]:
    """Add a prompt every ``every`` steps (0: all at once) and step until done."""
    produced: dict[int, list[int]] = {}
    pending, steps = list(enumerate(batch)), 0
    while pending or engine.has_work():
        while pending and (every == 0 or steps % every == 0):
            i, prompt = pending.pop(0)
            engine.add(i, prompt, SamplingParams(max_new_tokens=n_new))
            if every:
                break
        for out in engine.step():
            produced.setdefault(out.seq_id, []).append(out.token_id)
        steps += 1
    return produced


def test_ours_is_picked_and_drops_hf_layers(family):
    _, reference = family
    hf = copy.deepcopy(reference)
    ours = own_model(hf, "auto")
    assert isinstance(ours, LlamaFamily) and all(isinstance(layer, torch.nn.Identity) for layer in hf.model.layers)
    assert own_model(copy.deepcopy(reference), "transformers").__class__ is type(reference)
    tied = reference.config.tie_word_embeddings
    assert (ours.lm_head.weight is ours.embed.weight) == tied


@pytest.mark.parametrize(
    ("num_blocks", "budget", "chunked", "packed", "native"),
    [(256, 64, True, False, True), (24, 48, True, True, True), (256, 512, False, False, False)],
    ids=["chunked-staggered", "preempting-onednn", "whole-prompts-torch-decode"],
)
def test_greedy_equals_generate(family, num_blocks, budget, chunked, packed, native):
    name, reference = family
    model = own_model(copy.deepcopy(reference), "zserve")
    if packed:
        assert cpu_linear.prepack(model) == 2 * 4 + 1  # qkv o gate_up down per layer, the lm_head
    engine = StepCore(
        model, num_blocks=num_blocks, block_size=8, max_batched_tokens=budget, chunked_prefill=chunked,
        native_decode=native,
    )  # fmt: skip
    batch = prompts(10, seed=4)
    produced = run(engine, batch, 10)
    for i, prompt in enumerate(batch):
        assert produced[i] == expected(reference, prompt, 10), f"{name}: sequence {i}"
    assert engine.blocks.num_free == num_blocks
    if num_blocks == 24:
        assert engine.scheduler.preemptions > 0


def test_shared_prefixes_under_preemption_equal_generate(family):
    name, reference = family
    rng = random.Random(5)
    prefix = [rng.randrange(1, 256) for _ in range(40)]
    batch = [prefix + p for p in prompts(8, seed=8)]
    engine = StepCore(own_model(copy.deepcopy(reference), "zserve"), num_blocks=24, block_size=8,
                        max_batched_tokens=48)  # fmt: skip
    produced = run(engine, batch, 8)
    assert engine.scheduler.preemptions > 0 and engine.stats.cached_tokens > 0
    for i, prompt in enumerate(batch):
        assert produced[i] == expected(reference, prompt, 8), f"{name}: sequence {i}"


def test_a_bf16_model_on_a_cpu_keeps_fp32_kv_for_the_c_kernel_and_decodes_the_model():
    """bf16 weights, an fp32 cache (cache_dtype) read by the C decode kernel: each greedy token is the fp32
    model's most likely one, up to bf16's rounding (teacher-forced through the fp32 reference)."""
    reference = tiny("llama-gqa-untied")
    model = own_model(copy.deepcopy(reference).to(torch.bfloat16), "zserve")
    engine = StepCore(model, num_blocks=256, block_size=8, max_batched_tokens=64, chunked_prefill=True)
    assert engine.cache.k[0].dtype == torch.float32 and engine.cache.native is not None
    batch = prompts(6, seed=9)
    produced = run(engine, batch, 12)
    with torch.inference_mode():
        for i, prompt in enumerate(batch):
            ids = prompt + produced[i]
            logprobs = torch.log_softmax(reference(torch.tensor([ids])).logits[0, len(prompt) - 1 : -1], -1)
            chosen = logprobs.gather(1, torch.tensor(produced[i]).unsqueeze(1))[:, 0]
            assert (logprobs.max(-1).values - chosen).max() < 0.05, f"sequence {i}"


@pytest.mark.parametrize("impl", ["zserve", "transformers"])
def test_the_warm_up_step_that_sizes_a_gpu_pool_leaves_the_model_to_the_real_core(impl):
    reference = tiny("qwen3-gqa")
    model = own_model(copy.deepcopy(reference), impl)
    warm_step(model, GeneratorOptions(block_size=8, max_batched_tokens=96))  # Generator's, before its pool
    engine = StepCore(model, num_blocks=64, block_size=8, max_batched_tokens=64)
    batch = prompts(4, seed=2)
    produced = run(engine, batch, 6, every=0)
    assert [produced[i] for i in range(4)] == [expected(reference, p, 6) for p in batch]


def test_the_fused_rms_norm_is_hugging_faces_bit_for_bit_in_fp32():
    torch.manual_seed(0)
    for dim in (16, 64, 128, 576, 960, 4096):
        for rows in (1, 17, 64):
            for scale in (1e-3, 1.0, 30.0):
                x, w = torch.randn(rows, 5, dim) * scale, torch.randn(dim)
                h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)  # HF's LlamaRMSNorm in fp32
                assert torch.equal(rms_norm(x, w, 1e-6), w * h)
                assert torch.equal(rms_norm(x, w.expand(5, dim), 1e-6), w * h)  # Qwen3's merged q/k norms


def test_other_architectures_fall_back_and_zserve_refuses_them():
    from transformers import GPT2Config, GPT2LMHeadModel, MistralConfig

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=64))
    assert own_model(gpt2, "auto") is gpt2
    with pytest.raises(ValueError, match="model type 'gpt2' is not one we have code for"):
        own_model(gpt2, "zserve")
    windowed = MistralConfig(**_SHAPE, num_attention_heads=4, num_key_value_heads=2, sliding_window=128)
    assert unsupported(windowed) == "a sliding window of 128 tokens"
    dynamic = MistralConfig(**_SHAPE, num_attention_heads=4, sliding_window=None,
                            rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0})  # fmt: skip
    assert "rope type 'dynamic'" in unsupported(dynamic)
