"""Cache-aware routing through the whole deployment (``zserve up``, 2 engines of the tiny Llama of
tests/support/tinylm.py, nothing downloaded): requests that share a long prefix land on the engine whose prefix
cache holds it, read from /metrics (the broker's routing counters and the engines' own cache hits)."""

from __future__ import annotations

import re
import time

import pytest
from deployment import Deployment, free_port, write_config
from tinylm import build_tiny_lm

CONFIG = """
[frontends]
workers = 1
port = {port}

[[models]]
name = "tiny"
handler = "zserve.models.causal_lm:CausalLM"
engines = 2
timeout_ms = 120000
[models.options]
path = "{lm}"
block_size = 4
num_blocks = 256
max_running = 8
max_new_tokens = 4
"""

PREFIX = " ".join(["Seattle is a city in the state of Washington."] * 6)  # ~70 tokens: many blocks of 4
FOLLOWERS = 5


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("routing")
    lm = build_tiny_lm(tmp / "tinylm")
    d = Deployment(write_config(tmp, CONFIG.format(port=free_port(), lm=lm))).wait_ready()
    yield d
    assert d.stop() == 0, d.output[-3000:]


def metrics(d: Deployment) -> dict[tuple[str, ...], float]:
    """The samples of the routing and cache counters, keyed by (name, model, engine, reason) (absent labels: "")."""
    status, _, text = d.request("GET", "/metrics")
    assert status == 200
    out = {}
    for line in text.splitlines():
        m = re.match(r"^(zserve_(?:route_\w+|prefix_cache_hit_tokens_total))\{([^}]*)\} (\S+)$", line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
            key = (m.group(1), labels.get("model", ""), labels.get("engine", ""), labels.get("reason", ""))
            out[key] = float(m.group(3))
    return out


def complete(d: Deployment, prompt: str) -> None:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    status, _, data = d.request("POST", "/v1/completions", body)
    assert status == 200, data


def test_a_repeated_prefix_lands_on_the_engine_that_holds_it(deployment):
    deployment.wait_for_line("routing: tokenizer loaded")  # until then requests are routed by load alone
    complete(deployment, PREFIX + " first")
    for i in range(FOLLOWERS):  # one at a time: both engines idle, so load alone would alternate them
        complete(deployment, PREFIX + f" question {i}")
    deadline = time.monotonic() + 30
    while True:  # the frontend reads the broker's health report periodically
        samples = metrics(deployment)
        decisions = {k[2:]: v for k, v in samples.items() if k[0] == "zserve_route_decisions_total" and v}
        if sum(decisions.values()) >= FOLLOWERS + 1 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    # the first went by load (its prefix was held nowhere), every follower to the engine that computed it
    [holder] = [engine for engine, reason in decisions if reason == "least_loaded"]
    assert decisions == {(holder, "least_loaded"): 1, (holder, "match"): FOLLOWERS}, samples
    assert re.fullmatch(r"engine-tiny-\d", holder)  # its name, stable over restarts (no pid)
    requested = samples[("zserve_route_prompt_blocks_total", "tiny", holder, "")]
    cached = samples[("zserve_route_cached_blocks_total", "tiny", holder, "")]
    assert requested >= FOLLOWERS * 10 and cached >= 0.8 * requested * FOLLOWERS / (FOLLOWERS + 1), samples
    # and the engines' own counters agree: the followers' prefixes were found in the cache, not computed
    hit_tokens = samples[("zserve_prefix_cache_hit_tokens_total", "tiny", "", "")]
    assert hit_tokens >= 4 * cached - 4 * FOLLOWERS, samples
