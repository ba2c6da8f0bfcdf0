"""Tensor parallel generation on a CPU (gloo): a group of 2 processes (this one as rank 0 and a follower it
starts) computes, token for token, what one process computes and what Hugging Face ``generate`` does, with
staggered arrivals, chunked prefill and a KV pool small enough to preempt."""

from __future__ import annotations

import os
import random

import pytest
import torch
from msgspec.structs import replace
from tinylm import build_tiny_lm
from transformers import AutoModelForCausalLM

from zserve.generator.generator import Generator, GeneratorOptions
from zserve.generator.llama import LlamaFamily
from zserve.generator.sequence import SamplingParams

OPTIONS = GeneratorOptions(num_blocks=24, block_size=8, max_batched_tokens=48, max_running=8, tensor_parallel=2)
NEW = 10


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return build_tiny_lm(tmp_path_factory.mktemp("tp") / "tinylm")  # 4 heads, 2 key/value heads


def prompts(k: int = 10, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 400) for _ in range(rng.randrange(3, 60))] for _ in range(k)]


def run_staggered(engine: Generator, batch: list[list[int]]) -> list[list[int]]:
    core, produced, pending, steps = engine.core, {}, list(enumerate(batch)), 0
    while pending or core.has_work():
        if pending and steps % 2 == 0:  # a new request every other step: it joins a running batch
            i, prompt = pending.pop(0)
            core.add(i, prompt, SamplingParams(max_new_tokens=NEW, ignore_eos=True))
        for out in core.step():
            produced.setdefault(out.seq_id, []).append(out.token_id)
        steps += 1
    assert core.free_blocks == core.num_blocks
    return [produced[i] for i in range(len(batch))]


@pytest.mark.parametrize("impl", ["zserve", "transformers"])  # our layers sharded; HF's modules on HF's plan
def test_greedy_with_tensor_parallel_2_equals_one_process_and_generate(tiny_path, impl):
    batch = prompts()
    engine = Generator.load(str(tiny_path), options=replace(OPTIONS, model_impl=impl))
    try:
        assert isinstance(engine.core.model, LlamaFamily) == (impl == "zserve")
        assert engine.core.cache.k[0].shape[1] == 1  # this rank holds one of the two key/value heads
        parallel = run_staggered(engine, batch)
        preempted = engine.core.scheduler.preemptions
    finally:
        engine.close()
    assert "WORLD_SIZE" not in os.environ  # the process is alone again
    single = run_staggered(Generator.load(str(tiny_path), options=replace(OPTIONS, tensor_parallel=1)), batch)
    model = AutoModelForCausalLM.from_pretrained(tiny_path).eval()
    with torch.inference_mode():
        reference = [
            model.generate(torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)[
                0, len(p) :
            ].tolist()
            for p in batch
        ]
    assert preempted > 0  # the small pool made the group preempt and recompute
    assert parallel == single == reference


def test_a_model_whose_heads_do_not_divide_is_refused_clearly(tiny_path):
    with pytest.raises(ValueError, match="tensor_parallel 3 must divide the model's 4 attention heads and 2"):
        Generator.load(str(tiny_path), options=replace(OPTIONS, tensor_parallel=3))


def test_a_group_on_cuda_needs_as_many_visible_devices(tiny_path):
    if torch.cuda.device_count() >= 2:
        pytest.skip("this host has the devices")
    with pytest.raises(ValueError, match=r'tensor_parallel 2 needs as many CUDA devices.*devices = \["cuda:0,1'):
        Generator.load(str(tiny_path), device="cuda:0", options=OPTIONS)


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True])
def test_tensor_parallel_must_be_a_positive_integer(bad):
    from zserve.models.causal_lm import CausalLM

    with pytest.raises(ValueError, match="tensor_parallel must be an integer of 1 or more"):
        CausalLM(path="unused", tensor_parallel=bad)
