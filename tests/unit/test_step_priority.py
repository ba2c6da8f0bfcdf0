"""Priorities in the real engine core (a tiny Llama): with the KV pool too small for everything, an urgent
sequence that arrives while less urgent ones run takes their blocks and finishes first, and every output
still equals Hugging Face's greedy ``generate`` (preempted sequences are recomputed exactly)."""

from __future__ import annotations

import copy

import pytest
from test_step_core import expected, prompts, tiny_llama

from zserve.generator.sequence import SamplingParams
from zserve.generator.step_core import StepCore


@pytest.fixture(scope="module")
def reference():
    return tiny_llama()


def run(reference, urgent_priority: int) -> tuple[list[int], dict[int, list[int]], StepCore]:
    # 12 blocks of 8 slots; each background sequence grows to 5 blocks, so at most two fit at once
    core = StepCore(copy.deepcopy(reference), num_blocks=12, block_size=8, max_batched_tokens=64)
    background = [p[:20] for p in prompts(8, seed=4) if len(p) >= 20][:4]
    for i, prompt in enumerate(background):
        core.add(i, prompt, SamplingParams(max_new_tokens=20), priority=5, now=0.01 * i)
    finished: list[int] = []
    produced: dict[int, list[int]] = {}

    def step() -> None:
        for out in core.step():
            produced.setdefault(out.seq_id, []).append(out.token_id)
            if out.finish_reason:
                finished.append(out.seq_id)

    for _ in range(3):
        step()
    assert core.free_blocks <= 2 and not finished  # the pool is full of background work
    core.add(9, prompts(1, seed=7)[0][:12], SamplingParams(max_new_tokens=8), priority=urgent_priority, now=0.1)
    while core.has_work():
        step()
    assert core.free_blocks == 12
    return finished, produced, core


def test_an_urgent_sequence_finishes_first_when_kv_blocks_are_short(reference):
    finished, produced, core = run(reference, urgent_priority=0)
    assert finished[0] == 9 and sorted(finished) == [0, 1, 2, 3, 9]
    assert core.scheduler.preemptions > 0
    assert produced[9] == expected(reference, prompts(1, seed=7)[0][:12], 8)
    background = [p[:20] for p in prompts(8, seed=4) if len(p) >= 20][:4]
    for i, prompt in enumerate(background):
        assert produced[i] == expected(reference, prompt, 20), f"sequence {i}"
    # the same arrival at the background's priority waits its turn (first come, first served)
    finished, _, _ = run(reference, urgent_priority=5)
    assert finished[0] != 9
