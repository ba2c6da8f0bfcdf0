"""Sampling options through the engine core, against Hugging Face: logprobs equal ``log_softmax`` of HF's
logits for the same tokens (fp32, within 1e-4) with the same top-k sets; greedy under a repetition penalty
equals ``generate(repetition_penalty=...)``; rows without options keep equalling plain greedy generate beside
rows with them."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from test_step_core import tiny_llama

from zserve.generator.llama import own_model
from zserve.generator.sequence import SamplingParams
from zserve.generator.step_core import StepCore


@pytest.fixture(scope="module")
def reference():
    return tiny_llama()


def run(core: StepCore, requests: list[tuple[list[int], SamplingParams]]) -> dict[int, list]:
    for i, (prompt, params) in enumerate(requests):
        core.add(i, prompt, params)
    outputs: dict[int, list] = {i: [] for i in range(len(requests))}
    while core.has_work():
        for out in core.step():
            outputs[out.seq_id].append(out)
    return outputs


def generate(model, prompt: list[int], n: int, **options) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0, **options,
        )  # fmt: skip
    return out[0, len(prompt) :].tolist()


def prompts(k: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 256) for _ in range(rng.randrange(3, 40))] for _ in range(k)]


def test_logprobs_equal_hf_log_softmax_for_the_same_tokens(reference):
    core = StepCore(copy.deepcopy(reference), num_blocks=64, block_size=8, max_batched_tokens=48)
    options = zip(prompts(4, 1), [0, 3, 20, 5], [0.0, 1.0, 0.7, 0.0], strict=True)
    cases = [(p, SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=k, temperature=t, seed=i))
             for i, (p, k, t) in enumerate(options)]  # fmt: skip
    outputs = run(core, cases)
    for i, (prompt, params) in enumerate(cases):
        tokens = [o.token_id for o in outputs[i]]
        with torch.inference_mode():
            logits = reference(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
        expected = torch.log_softmax(logits.float(), -1)
        for j, out in enumerate(outputs[i]):
            assert abs(out.logprobs.logprob - float(expected[j, out.token_id])) < 1e-4
            _, ids = torch.topk(expected[j], params.logprobs)
            assert {t for t, _ in out.logprobs.top} == set(ids.tolist())
            assert max(abs(v - float(expected[j, t])) for t, v in out.logprobs.top or [(0, expected[j, 0])]) < 1e-4


@pytest.mark.parametrize("impl", ["transformers", "zserve"])
def test_prompt_logprobs_equal_hf_log_softmax_over_chunks_shared_prefixes_and_preemption(reference, impl):
    """Prompt logprobs (completions' echo with logprobs) equal log_softmax of HF's logits over the prompt:
    prompts split over several steps' chunks, one whose prefix another sequence has cached (it is computed
    whole anyway: the cache has no logits), a pool so small that sequences are preempted and recomputed
    (nothing is collected twice); rows beside them without the option still equal greedy generate."""
    core = StepCore(own_model(copy.deepcopy(reference), impl), num_blocks=12, block_size=8, max_batched_tokens=24)
    shared = prompts(1, 7)[0] + prompts(1, 8)[0]
    ps = [shared, [*shared, 5, 6, 7], *prompts(3, 9)]
    cases = [(p, SamplingParams(max_new_tokens=10, ignore_eos=True, prompt_logprobs=-1 if i % 2 == 0 else 3 * i))
             for i, p in enumerate(ps)]  # fmt: skip
    outputs = run(core, cases)
    assert core.scheduler.preemptions > 0
    for i, (prompt, params) in enumerate(cases):
        first, *rest = outputs[i]
        assert all(o.prompt_logprobs is None for o in rest)
        if params.prompt_logprobs < 0:
            assert first.prompt_logprobs is None
            assert [o.token_id for o in outputs[i]] == generate(reference, prompt, 10)
            continue
        with torch.inference_mode():
            expected = torch.log_softmax(reference(torch.tensor([prompt])).logits[0, :-1].float(), -1)
        assert len(first.prompt_logprobs) == len(prompt) - 1
        for p, got in enumerate(first.prompt_logprobs):
            assert abs(got.logprob - float(expected[p, prompt[p + 1]])) < 1e-4
            _, ids = torch.topk(expected[p], params.prompt_logprobs)
            assert {t for t, _ in got.top} == set(ids.tolist())


def test_greedy_with_a_repetition_penalty_equals_generate_and_plain_rows_are_unchanged(reference):
    core = StepCore(copy.deepcopy(reference), num_blocks=64, block_size=8, max_batched_tokens=48)
    ps = prompts(6, 2)
    cases = [(p, SamplingParams(max_new_tokens=16, ignore_eos=True, repetition_penalty=1.5 if i % 2 else 1.0))
             for i, p in enumerate(ps)]  # fmt: skip
    outputs = run(core, cases)
    for i, (prompt, params) in enumerate(cases):
        got = [o.token_id for o in outputs[i]]
        options = {"repetition_penalty": 1.5} if params.repetition_penalty != 1.0 else {}
        assert got == generate(reference, prompt, 16, **options), i
    assert any(generate(reference, ps[i], 16) != [o.token_id for o in outputs[i]] for i in (1, 3, 5))
