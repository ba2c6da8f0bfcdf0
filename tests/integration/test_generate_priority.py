"""Priorities reach the generative engine: behind a real broker, with the engine's KV pool too small for the
background sequences it holds, an urgent request that arrives while they run finishes before any of them (its
priority travels in Batch.priorities to the engine's scheduler, which gives it less urgent sequences' blocks).
The broker admits every request to the engine at once (max_running is above their number), so its own queue
order plays no part here. Prefix caching is off so that a preempted sequence is recomputed whole and waits for
blocks (with it, it takes its own cached blocks back at once and nobody waits long). Without the priority
reaching the engine (checked by sending none), the urgent request finishes after two of them. The engine ages
sequences by the broker's `priority_aging_ms` (passed on its command line): at 1 us a level, the background's
priority of 1000 is worth 1 ms of waiting, so the urgent request, seconds younger, no longer goes first."""

from __future__ import annotations

import pytest
from test_generate_engine import health, wait_for
from tinylm import build_tiny_lm

TOML = """
[broker]
heartbeat_interval_ms = 100
heartbeat_liveness = 5
priority_aging_ms = {aging_ms}

[[models]]
name = "lm"
handler = "zserve.models.causal_lm:CausalLM"
timeout_ms = 120000
[models.options]
path = "{path}"
block_size = 8
num_blocks = 48
max_batched_tokens = 64
max_running = 8
prefix_caching = false
"""


@pytest.mark.parametrize(("aging_ms", "overtakes"), [(1000, True), (0.001, False)], ids=["aging-1s", "aging-1us"])
def test_an_urgent_request_overtakes_background_sequences_in_a_full_engine(
    cluster_factory, tmp_path, aging_ms, overtakes
):
    c = cluster_factory(TOML.format(path=build_tiny_lm(tmp_path / "tinylm"), aging_ms=aging_ms))
    c.start_broker()
    c.start_engine("lm", 0)
    c.wait_ready({"lm": 1})
    client = c.client()
    # the same 7-token prompt 4 times, decoding in lockstep, a token a step: after ~90 steps their 4 x 12 blocks
    # fill the pool of 48; they need 4 x 39 by the end, so they preempt one another (recomputed whole: no prefix
    # caching) for 200 steps more before the first finishes. Priority 1000: the engine ages a sequence one level a
    # second, so the urgent one stays more urgent however slow this machine is
    body = {"prompt": "The quick brown fox", "max_new_tokens": 300, "ignore_eos": True}
    start = health(client).engine_steps
    background = [client.submit("lm", body, priority=1000) for _ in range(4)]
    wait_for(lambda: health(client).engine_steps >= start + 90, 120)
    assert not any(f.done() for f in background)
    # first come, first served, it would wait behind the preempted ones for blocks until one finished
    urgent = client.submit("lm", {"prompt": "DeepSpeed is", "max_new_tokens": 8, "ignore_eos": True}, priority=0)
    answer = urgent.result(timeout=120)
    finished_before = sum(f.done() for f in background)
    assert answer["generated_length"] == 8
    if overtakes:
        assert finished_before == 0, f"{finished_before} background sequences finished before the urgent one"
    else:  # their priority is worth 1 ms of waiting: they arrived seconds earlier, so they go first
        assert finished_before >= 1, "the urgent request went first although the broker's aging made it the youngest"
    for f in background:
        assert f.result(timeout=120)["generated_length"] == 300
    wait_for(lambda: health(client).free_kv_blocks == 48)
