"""The generative engine core: greedy output equals Hugging Face ``generate`` token for token, with
sequences joining a running batch, chunked prefill on and off, and a KV pool small enough to preempt."""

from __future__ import annotations

import copy
import random
import weakref

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from zserve.generator import c_build, cpu_linear
from zserve.generator.sequence import SamplingParams
from zserve.generator.step_core import StepCore


def tiny_llama():
    """A 2-layer GQA Llama of random weights (seed 0)."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, eos_token_id=None, bos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def reference():
    return tiny_llama()


# Hugging Face's answers, per reference model: a module's parametrizations ask the same model for the same prompts
# (about 60% of such a test's time on 2 cores). A reference model is never changed once built: engines take copies.
_GENERATED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def expected(model, prompt, n):
    """Greedy ``generate``'s ``n`` new tokens after ``prompt``, the oracle."""
    memo = _GENERATED.setdefault(model, {})
    key = (tuple(prompt), n)
    if key not in memo:
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
            )  # fmt: skip
        memo[key] = out[0, len(prompt) :].tolist()
    return list(memo[key])


def prompts(k=16, seed=1):
    rng = random.Random(seed)
    return [[rng.randrange(1, 256) for _ in range(rng.randrange(3, 90))] for _ in range(k)]


@pytest.mark.parametrize(
    ("chunked", "num_blocks", "budget", "batched", "packed", "native"),
    # the third forces preemption; the fourth runs decodes as one padded batch, the path GPUs take; the fifth
    # and sixth have their linear layers on packed weights, through our C kernel (Generator.load's default
    # on a CPU) and through oneDNN; the last attends with torch's SDPA per sequence instead of the C decode
    # kernel
    [(True, 256, 64, False, None, True), (False, 256, 512, False, None, True), (True, 24, 48, False, None, True),
     (True, 256, 64, True, None, True), (True, 24, 48, False, "native", True), (True, 24, 48, False, "onednn", True),
     (True, 24, 48, False, None, False)],
    ids=["chunked", "whole-prompts", "preempting", "batched-decode", "native-linear", "onednn-linear", "torch-decode"],
)  # fmt: skip
def test_greedy_matches_generate_with_staggered_arrivals(
    reference, chunked, num_blocks, budget, batched, packed, native
):
    model = copy.deepcopy(reference)
    if packed:
        assert cpu_linear.available(model)
        assert cpu_linear.prepack(model, native=packed == "native") == 2 * 7 + 1  # q k v o gate up down, lm_head
        kernels = {m.native for m in model.modules() if isinstance(m, cpu_linear.PackedLinear)}
        if packed == "native" and not c_build.has_compiler():
            pytest.skip("no C compiler here: the products run on oneDNN (the onednn case covers this)")
        assert kernels == {packed == "native"}
    engine = StepCore(
        model,
        num_blocks=num_blocks,
        block_size=8,
        max_batched_tokens=budget,
        chunked_prefill=chunked,
        batched_decode=batched,
        native_decode=native,
    )
    if native and engine.cache.native is None:
        pytest.skip("no C compiler here: the native decode kernel cannot be built (the torch case covers this)")
    assert (engine.cache.native is not None) == native
    batch = prompts()
    n_new = 12
    produced: dict[int, list[int]] = {}
    ids: list[int] = []
    pending = list(batch)
    steps = 0
    while pending or engine.has_work():
        if pending and steps % 2 == 0:  # a new request every other step: they join a running batch
            ids.append(100 + len(ids))  # the caller's ids
            engine.add(ids[-1], pending.pop(0), SamplingParams(max_new_tokens=n_new))
        for out in engine.step():
            produced.setdefault(out.seq_id, []).append(out.token_id)
        steps += 1
    for prompt, seq_id in zip(batch, ids, strict=True):
        assert produced[seq_id] == expected(reference, prompt, n_new), f"sequence {seq_id}"
    assert engine.blocks.num_free == num_blocks  # every block came back
    if num_blocks == 24:
        assert engine.scheduler.preemptions > 0


def test_abort_frees_blocks_and_stop_tokens_end_a_sequence(reference):
    engine = StepCore(copy.deepcopy(reference), num_blocks=64, block_size=8)
    [p1, p2] = prompts(2, seed=5)
    greedy = expected(reference, p2, 6)
    a, b = 7, 3
    engine.add(a, p1, SamplingParams(max_new_tokens=50))
    engine.add(b, p2, SamplingParams(max_new_tokens=50, stop_token_ids=(greedy[3],)))
    with pytest.raises(ValueError, match="already in the engine"):
        engine.add(a, p2)
    finished = {}
    for _ in range(3):
        engine.step()
    engine.abort(a)
    assert engine.blocks.num_free == 64 - len(engine.sequences[b].kv.block_table)
    while engine.has_work():
        for out in engine.step():
            if out.finish_reason:
                finished[out.seq_id] = out.finish_reason
    assert finished == {b: "stop"}
    assert engine.blocks.num_free == 64


def test_seeded_sampling_is_reproducible(reference):
    params = SamplingParams(max_new_tokens=10, temperature=0.8, top_k=50, top_p=0.9, seed=123)
    runs = []
    for _ in range(2):
        engine = StepCore(copy.deepcopy(reference), num_blocks=64, block_size=8)
        seq_id = 0
        engine.add(seq_id, prompts(1)[0], params)
        tokens = []
        while engine.has_work():
            tokens += [o.token_id for o in engine.step() if o.seq_id == seq_id]
        runs.append(tokens)
    assert runs[0] == runs[1] and len(runs[0]) == 10


def _tiny(family):
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    torch.manual_seed(0)
    shape = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    if family == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**shape, num_key_value_heads=2, max_position_embeddings=512))
    if family == "mistral":
        return MistralForCausalLM(MistralConfig(**shape, num_key_value_heads=2, max_position_embeddings=512))
    return GPT2LMHeadModel(GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=512, eos_token_id=2))


@pytest.mark.parametrize("family", ["qwen2", "mistral", "gpt2"])
def test_other_architectures_run_unchanged_through_the_paged_attention(family):
    model = _tiny(family).eval()
    engine = StepCore(copy.deepcopy(model), num_blocks=128, block_size=8, max_batched_tokens=48)
    batch = prompts(6, seed=3)
    ids = list(range(len(batch)))
    for i, p in zip(ids, batch, strict=True):
        engine.add(i, p, SamplingParams(max_new_tokens=8, ignore_eos=True))
    produced: dict[int, list[int]] = {}
    while engine.has_work():
        for out in engine.step():
            produced.setdefault(out.seq_id, []).append(out.token_id)
    for prompt, seq_id in zip(batch, ids, strict=True):
        assert produced[seq_id] == expected(model, prompt, 8)


def test_a_tiny_temperature_is_greedy_not_a_crash(reference):
    engine = StepCore(copy.deepcopy(reference), num_blocks=64, block_size=8)
    [prompt] = prompts(1, seed=9)
    seq = 1
    engine.add(seq, prompt, SamplingParams(max_new_tokens=5, temperature=1e-30, seed=1))
    out = []
    while engine.has_work():
        out += [o.token_id for o in engine.step() if o.seq_id == seq]
    assert out == expected(reference, prompt, 5)


def test_a_shared_prefix_is_computed_once_and_output_still_equals_generate(reference):
    """32 requests sharing a 400-token system prompt: the prefix is prefilled once, every greedy output is
    still Hugging Face's, and the hit rate says so."""
    rng = random.Random(11)
    prefix = [rng.randrange(1, 256) for _ in range(400)]
    batch = [prefix + [rng.randrange(1, 256) for _ in range(rng.randrange(1, 12))] for _ in range(32)]
    n_new = 4
    engine = StepCore(copy.deepcopy(reference), num_blocks=160, block_size=16, max_batched_tokens=256)
    for i, prompt in enumerate(batch):
        engine.add(i, prompt, SamplingParams(max_new_tokens=n_new))
    produced: dict[int, list[int]] = {}
    while engine.has_work():
        for out in engine.step():
            produced.setdefault(out.seq_id, []).append(out.token_id)
    own = sum(len(p) - 400 for p in batch) + 32 * n_new  # suffixes and decodes: what sharing cannot save
    stats = engine.stats
    # the prefix once (up to a block's worth of the last prompt token's block per request)
    assert stats.computed_tokens <= 400 + own + 32 * 16, stats
    assert stats.cached_tokens >= 31 * 384 and stats.prefix_hit_rate > 0.9
    for i, prompt in enumerate(batch):
        assert produced[i] == expected(reference, prompt, n_new), f"sequence {i}"
    assert engine.blocks.num_free == 160


def test_prefix_sharers_under_preemption_and_staggered_arrivals_equal_generate(reference):
    rng = random.Random(5)
    prefix = [rng.randrange(1, 256) for _ in range(40)]
    batch = [prefix + p for p in prompts(12, seed=8)]
    engine = StepCore(copy.deepcopy(reference), num_blocks=24, block_size=8, max_batched_tokens=48)
    produced: dict[int, list[int]] = {}
    pending, steps = list(enumerate(batch)), 0
    while pending or engine.has_work():
        if pending and steps % 2 == 0:
            i, prompt = pending.pop(0)
            engine.add(i, prompt, SamplingParams(max_new_tokens=10))
        for out in engine.step():
            produced.setdefault(out.seq_id, []).append(out.token_id)
        steps += 1
    assert engine.scheduler.preemptions > 0 and engine.stats.cached_tokens > 0
    for i, prompt in enumerate(batch):
        assert produced[i] == expected(reference, prompt, 10), f"sequence {i}"
    assert engine.blocks.num_free == 24


def test_a_seeded_sequence_samples_the_same_alone_and_in_a_batch(reference):
    params = SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.9, seed=99)
    [mine, *others] = prompts(6, seed=21)

    def run(with_others: bool) -> list[int]:
        engine = StepCore(copy.deepcopy(reference), num_blocks=128, block_size=8, max_batched_tokens=64)
        engine.add(0, mine, params)
        if with_others:
            for i, p in enumerate(others, 1):
                engine.add(i, p, SamplingParams(max_new_tokens=12, temperature=0.8, top_k=20, seed=i))
        tokens = []
        while engine.has_work():
            tokens += [o.token_id for o in engine.step() if o.seq_id == 0]
        return tokens

    assert run(False) == run(True)


def test_a_bare_core_takes_the_engine_options_defaults(reference):
    """GeneratorOptions is the one definition of the defaults: a core built without options runs as the engine's."""
    from zserve.generator.options import GeneratorOptions

    core, options = StepCore(copy.deepcopy(reference), num_blocks=8), GeneratorOptions()
    assert core.blocks.block_size == options.block_size and core.blocks.prefix_caching == options.prefix_caching
    s = core.scheduler
    assert (s.max_batched_tokens, s.max_running, s.chunked_prefill) == (
        options.max_batched_tokens, options.max_running, options.chunked_prefill,
    )  # fmt: skip
