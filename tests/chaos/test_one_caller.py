"""One caller must never hurt the others (issue 40), through ``zserve up`` with normal traffic running: echo
requests and one-input embeddings from closed-loop clients, whose latencies are recorded. The attacks:

- a /v1/completions with 300 prompts: 400 naming ``prompt`` ([limits] max_inputs), at no cost to the others;
  a multi-prompt request within the limit that the broker refuses (503, its queue is full) cancels all its
  pieces, and so does a caller that hangs up: the engine stops (its queue and running sequences back to 0, far
  fewer steps than the work asked);
- a /v1/embeddings with 100k inputs: 400 naming ``input``, while no worker is lost (the broker's log),
  ``/readyz`` stays 200, and the others' p99 stays within 2x its value without the attacker (both measured
  here, side by side; the bound has a floor for a noisy 2-core machine);
- the broker itself under a 100k-request burst from a direct client (no frontend limit in the way): its
  heartbeats keep flowing, no worker is lost or reset (``bench.faults.broker_burst``).

Short in CI; ZSERVE_SLOW=1 measures each phase for longer.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import re
import socket
import threading
import time
from argparse import Namespace

import numpy as np
import pytest
from cluster import Cluster
from deployment import Deployment, free_port, write_config
from st_stacks import build_bert_encoder, build_stack
from tinylm import build_tiny_lm

from bench.faults.broker_burst import measure as broker_burst
from zserve import AsyncClient, Client
from zserve.errors import Overloaded

PHASE_S = 8.0 if os.environ.get("ZSERVE_SLOW") == "1" else 3.0
CLIENTS = 4
MAX_INPUTS = 64
QUEUE = 32  # tiny's max_queue: a request of MAX_INPUTS prompts is within the limit, and refused by the queue
# The others' p99 under attack may be 2x its value without the attacker, or this much over it, whichever is more:
# on 2 shared cores a p99 of a few ms doubles from scheduling noise alone. The failures this test exists for cost
# seconds (the broker dropping its workers, work running on for nobody).
NOISE_FLOOR_S = 0.05
# The attacker repeats its request this often. Refused at once, a 500 KB body still costs the frontend ~20 ms of JSON
# decoding: sent back to back, it is a flood of the kind a rate limit (quotas), not a per-request limit, answers.
ATTACK_EVERY_S = 0.5

CONFIG = """
[frontends]
workers = 1
port = {port}

[limits]
max_inputs = {max_inputs}

[[models]]
name = "echo"
handler = "testmodels:SlowEcho"
max_batch_size = 8
max_wait_ms = 1
[models.options]
delay_s = 0.001

[[models]]
name = "emb"
handler = "zserve.models.embedding:SentenceEmbedding"
max_batch_size = 16
credits = 1
preprocess_workers = 1
[models.options]
path = "{emb}"

[[models]]
name = "tiny"
handler = "zserve.models.causal_lm:CausalLM"
max_queue = {queue}
timeout_ms = 120000
[models.options]
path = "{lm}"
block_size = 8
num_blocks = 256
max_running = 2
"""


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("one-caller")
    lm = build_tiny_lm(tmp / "tinylm")
    emb = build_stack(build_bert_encoder(tmp / "bert"), tmp / "emb", "mean")
    config = CONFIG.format(port=free_port(), max_inputs=MAX_INPUTS, queue=QUEUE, emb=emb, lm=lm)
    d = Deployment(write_config(tmp, config)).wait_ready()
    yield d
    assert d.stop() == 0, d.output[-3000:]


def post(d: Deployment, path: str, body: dict, timeout_s: float = 60.0) -> tuple[int, dict]:
    host, port = d.url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def metric(d: Deployment, name: str, model: str) -> float:
    status, _, text = d.request("GET", "/metrics")
    assert status == 200
    found = re.search(rf'^{name}{{model="{model}"}} (\S+)$', text, re.M)
    assert found, f"no {name} for {model} in /metrics"
    return float(found.group(1))


class Traffic:
    """The normal callers: CLIENTS closed-loop threads, alternately an echo predict and a one-input embedding, each
    latency recorded with the time it ended; any answer but 200 is counted as a failure."""

    def __init__(self, d: Deployment) -> None:
        self.d = d
        self.done: list[tuple[float, float]] = []  # (ended at, latency s)
        self.failures: list[tuple[int, dict]] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(k,), daemon=True) for k in range(CLIENTS)]

    def _run(self, k: int) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            if n % 2:
                path, body = "/v1/models/echo/predict", {"i": f"{k}-{n}"}
            else:
                path, body = "/v1/embeddings", {"model": "emb", "input": f"caller {k} sentence {n}"}
            started = time.monotonic()
            status, answer = post(self.d, path, body)
            ended = time.monotonic()
            self.done.append((ended, ended - started))
            if status != 200:
                self.failures.append((status, answer))

    def __enter__(self) -> Traffic:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=90)

    def p99_between(self, start: float, end: float) -> tuple[float, int]:
        latencies = [lat for ended, lat in list(self.done) if start <= ended < end]
        assert len(latencies) >= 20, f"only {len(latencies)} requests in the window"
        return float(np.percentile(latencies, 99)), len(latencies)


class ReadyWatch:
    """Polls /readyz every 50 ms; ``bad`` collects every answer but 200."""

    def __init__(self, d: Deployment) -> None:
        self.d, self.bad, self.polls = d, [], 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(0.05):
            status, _, body = self.d.request("GET", "/readyz")
            self.polls += 1
            if status != 200:
                self.bad.append((status, body))

    def __enter__(self) -> ReadyWatch:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=30)


def attack_phase(d: Deployment, traffic: Traffic, attack, watch: ReadyWatch | None = None) -> dict:
    """The others' p99 for PHASE_S without the attacker, then for PHASE_S with ``attack`` repeated every
    ATTACK_EVERY_S; what the attacker got each time."""
    time.sleep(0.5)  # the traffic is flowing (connections, batches) before the baseline window opens
    start = time.monotonic()
    time.sleep(PHASE_S)
    calm_end = time.monotonic()
    answers = []
    while time.monotonic() < calm_end + PHASE_S:
        answers.append(attack())
        time.sleep(ATTACK_EVERY_S)
    attack_end = time.monotonic()
    calm, calm_n = traffic.p99_between(start, calm_end)
    hit, hit_n = traffic.p99_between(calm_end, attack_end)
    figures = {"calm_p99_ms": round(calm * 1000, 1), "calm_n": calm_n, "attack_p99_ms": round(hit * 1000, 1),
               "attack_n": hit_n, "attacks": len(answers)}  # fmt: skip
    print(figures)
    assert hit <= max(2 * calm, calm + NOISE_FLOOR_S), figures
    return {"figures": figures, "answers": answers}


def no_worker_lost(d: Deployment) -> None:
    lost = [line for line in d.lines if " lost: no heartbeat" in line or "is hung" in line]
    assert not lost, lost


def test_too_many_prompts_is_a_400_naming_prompt_at_no_cost_to_the_others(deployment):
    d = deployment
    prompts = [f"prompt {i}" for i in range(300)]

    def attack() -> tuple[int, str]:
        status, body = post(d, "/v1/completions", {"model": "tiny", "prompt": prompts, "max_tokens": 16})
        return status, body["error"]["param"]

    with Traffic(d) as traffic:
        phase = attack_phase(d, traffic, attack)
    assert set(phase["answers"]) == {(400, "prompt")}
    assert not traffic.failures, traffic.failures[:3]
    assert metric(d, "zserve_queue_depth", "tiny") == 0  # nothing of it reached the broker
    no_worker_lost(d)


def test_a_refused_multi_prompt_request_cancels_every_piece(deployment):
    """64 prompts (within max_inputs) against a queue of 32 behind 2 running slots: the broker takes 32 and refuses
    the rest, the caller gets 503 at once, and the 32 it took are cancelled: the engine is idle within a second or
    two, long before the ~6400 steps the 32 generations of 400 tokens would take, and runs a small part of them."""
    d = deployment
    tokens, prompts = 400, [f"prompt number {i}" for i in range(MAX_INPUTS)]
    sent = time.monotonic()
    status, body = post(d, "/v1/completions", {"model": "tiny", "prompt": prompts, "max_tokens": tokens,
                                                "temperature": 0, "ignore_eos": True})  # fmt: skip
    refused_at = time.monotonic()
    assert status == 503 and body["error"]["code"] == "overloaded", body
    steps_at_503 = metric(d, "zserve_engine_steps_total", "tiny")  # up to the health cache's age (0.5 s) earlier
    deadline = refused_at + 30
    while metric(d, "zserve_queue_depth", "tiny") or metric(d, "zserve_running_sequences", "tiny"):
        assert time.monotonic() < deadline, "the refused request's pieces are still queued or running"
        time.sleep(0.05)
    idle_s = time.monotonic() - refused_at
    time.sleep(0.6)  # the health cache's age: the last steps are counted
    steps = metric(d, "zserve_engine_steps_total", "tiny") - steps_at_503
    print(f"503 after {refused_at - sent:.2f}s; engine idle {idle_s:.2f}s later, {steps:.0f} steps since")
    assert steps < QUEUE * tokens / 2 / 3, f"{steps} engine steps ran for a request answered 503"
    # the engine serves the next caller as usual
    status, body = post(d, "/v1/completions", {"model": "tiny", "prompt": "after", "max_tokens": 4})
    assert status == 200, body


def test_a_caller_that_hangs_up_cancels_every_piece(deployment):
    """QUEUE prompts of 400 tokens each (~6400 steps at 2 running), and the caller closes its connection once they
    run: every piece leaves the engine at once, a small part of the work done."""
    d = deployment
    tokens, prompts = 400, [f"hang up {i}" for i in range(QUEUE)]
    host, port = d.url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"model": "tiny", "prompt": prompts, "max_tokens": tokens,
                 "temperature": 0, "ignore_eos": True}), {"Content-Type": "application/json"})  # fmt: skip
    deadline = time.monotonic() + 30
    while not metric(d, "zserve_running_sequences", "tiny"):
        assert time.monotonic() < deadline, "the completion never started"
        time.sleep(0.01)
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    hung_up = time.monotonic()
    steps_at_hang_up = metric(d, "zserve_engine_steps_total", "tiny")  # up to the health cache's age earlier
    while metric(d, "zserve_running_sequences", "tiny") or metric(d, "zserve_queue_depth", "tiny"):
        assert time.monotonic() < hung_up + 30, "the pieces of a request whose caller hung up are still running"
        time.sleep(0.02)
    idle_s = time.monotonic() - hung_up
    time.sleep(0.6)  # the health cache's age: the last steps are counted
    steps = metric(d, "zserve_engine_steps_total", "tiny") - steps_at_hang_up
    print(f"engine idle {idle_s:.2f}s after the hang-up, {steps:.0f} steps since")
    assert idle_s < 2.0 and steps < QUEUE * tokens / 2 / 3, (idle_s, steps)


def test_a_huge_embeddings_request_is_a_400_naming_input_and_loses_no_worker(deployment):
    d = deployment
    payload = {"model": "emb", "input": ["a"] * 100_000}
    workers_before = [metric(d, "zserve_ready_engines", m) for m in ("echo", "emb", "tiny")]

    def attack() -> tuple[int, str]:
        status, body = post(d, "/v1/embeddings", payload)
        return status, body["error"]["param"]

    with Traffic(d) as traffic, ReadyWatch(d) as watch:
        phase = attack_phase(d, traffic, attack)
    assert set(phase["answers"]) == {(400, "input")}
    assert not traffic.failures, traffic.failures[:3]
    assert watch.polls > 10 and not watch.bad, watch.bad[:3]
    assert [metric(d, "zserve_ready_engines", m) for m in ("echo", "emb", "tiny")] == workers_before
    no_worker_lost(d)


def test_the_broker_under_a_100k_request_burst_keeps_its_workers():
    """A direct client (no frontend, no limit) sends 100k requests at once: the broker admits its queue's worth and
    refuses the rest over many short loop turns, its heartbeats never stop for a liveness period, and neither
    of its two workers is declared lost or reset (the broker of issue 40 lost both, with gaps of 1.2-1.4 s)."""
    out = broker_burst(Namespace(items=100_000, interval_ms=250, liveness=4, broker_file=None))
    print(out)
    assert out["workers_lost"] == 0 and out["worker_resets"] == 0, out
    assert out["longest_heartbeat_gap_s"] < out["liveness_s"], out


CLUSTER = """
[[models]]
name = "tiny"
handler = "zserve.models.causal_lm:CausalLM"
max_queue = 8
timeout_ms = 120000
[models.options]
path = "{lm}"
block_size = 8
num_blocks = 256
max_running = 2
"""


def test_the_clients_generate_cancels_its_other_prompts_when_one_is_refused(tmp_path):
    """zserve.Client.generate and AsyncClient.generate: 40 prompts against a queue of 8 raise Overloaded at once,
    and the 8 the broker took are cancelled (broker queue and engine back to idle, few steps), for both clients."""
    cluster = Cluster(CLUSTER.format(lm=build_tiny_lm(tmp_path / "tinylm")), tmp_path)
    try:
        cluster.start_broker()
        cluster.start_engine("tiny")
        cluster.wait_ready({"tiny": 1}, timeout_s=120)
        client = cluster.client()
        prompts = [f"prompt {i}" for i in range(40)]
        sampling = {"max_new_tokens": 400, "temperature": 0.0, "ignore_eos": True}

        def idle_after_refusal(generate) -> tuple[float, int]:
            steps_before = tiny_health(client).engine_steps
            with pytest.raises(Overloaded):
                generate()
            refused_at = time.monotonic()
            while (h := tiny_health(client)).queue_depth or h.in_flight:
                assert time.monotonic() < refused_at + 30, "the other prompts are still queued or running"
                time.sleep(0.02)
            return time.monotonic() - refused_at, tiny_health(client).engine_steps - steps_before

        async def async_generate() -> None:
            async with AsyncClient(cluster.plan.endpoints.client) as aclient:
                await aclient.generate(prompts, model="tiny", **sampling)

        for name, generate in (("Client", lambda: client.generate(prompts, model="tiny", **sampling)),
                               ("AsyncClient", lambda: asyncio.run(async_generate()))):  # fmt: skip
            idle_s, steps = idle_after_refusal(generate)
            print(f"{name}.generate: engine idle {idle_s:.2f}s after Overloaded, {steps} steps")
            assert steps < 8 * 400 / 2 / 3, (name, steps)  # the 8 admitted would take ~1600
    finally:
        cluster.stop()


def tiny_health(client: Client):
    return next(m for m in client.health().models if m.name == "tiny")
