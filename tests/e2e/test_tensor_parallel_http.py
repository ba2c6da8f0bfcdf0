"""Tensor parallel generation through ``zserve up``: a model with ``tensor_parallel = 2`` (an engine group of
two processes over gloo) answers /v1/completions exactly as the same model in one process; a follower rank
SIGKILLed mid-generation takes its group down, the supervisor restarts it, and every request is answered
200 with the same text."""

from __future__ import annotations

import json
import threading
import time

import psutil
import pytest
from deployment import Deployment, free_port, write_config
from tinylm import build_tiny_lm

MODEL = """
[[models]]
name = "{name}"
handler = "zserve.models.causal_lm:CausalLM"
timeout_ms = 120000
[models.options]
path = "{lm}"
block_size = 8
num_blocks = 256
max_running = 4
tensor_parallel = {tp}
"""
PROMPTS = ["DeepSpeed is", "Seattle is", "zserve batches small requests", "a"]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp-http")
    lm = build_tiny_lm(tmp / "tinylm")
    config = f"[frontends]\nworkers = 1\nport = {free_port()}\n" + "".join(
        MODEL.format(name=name, lm=lm, tp=tp) for name, tp in (("one", 1), ("two", 2))
    )
    d = Deployment(write_config(tmp, config)).wait_ready()
    yield d
    assert d.stop() == 0, d.output[-3000:]


def complete(d: Deployment, model: str, prompt: str, tokens: int) -> tuple[int, str]:
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    status, _, out = d.request("POST", "/v1/completions", json.dumps(body))
    return status, out["choices"][0]["text"] if status == 200 else json.dumps(out)


def concurrently(d: Deployment, model: str, tokens: int) -> list[tuple[int, str]]:
    results: list = [None] * len(PROMPTS)

    def one(i: int) -> None:
        results[i] = complete(d, model, PROMPTS[i], tokens)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return results


def followers(d: Deployment) -> list[psutil.Process]:
    return [p for p in d.descendants() if "zserve.generator.tensor_parallel" in " ".join(p.cmdline())]


def test_two_ranks_answer_as_one_process(deployment):
    assert len(followers(deployment)) == 1  # the engine of "two" is rank 0; its follower is rank 1
    one, two = concurrently(deployment, "one", 16), concurrently(deployment, "two", 16)
    assert all(status == 200 for status, _ in one) and two == one


def test_a_follower_killed_mid_generation_restarts_the_group_and_loses_nothing(deployment):
    expected = concurrently(deployment, "one", 200)
    [follower] = followers(deployment)
    mark = len(deployment.lines)
    results: list = []
    load = threading.Thread(target=lambda: results.extend(concurrently(deployment, "two", 200)))
    load.start()
    time.sleep(0.3)  # the four sequences are running in the group
    follower.kill()
    load.join(timeout=180)
    deployment.wait_for_line("the group is broken, exiting", after=mark)
    deployment.wait_for_line("disconnected, held 4 batches", after=mark)  # all four were mid-generation
    assert results == expected  # re-dispatched to the restarted group, computed again, same text
    [again] = followers(deployment)
    assert again.pid != follower.pid
    assert complete(deployment, "two", PROMPTS[0], 16) == complete(deployment, "one", PROMPTS[0], 16)
