"""Faults in a generative deployment (``zserve up``, the tiny Llama of tests/support/tinylm.py, 2 engines):
several SSE streams (/v1/completions, stream=true) and non-streamed completions in flight, then an engine
SIGKILLed mid-generation, or an engine whose step stops advancing (its heartbeat alive). Every request
gets exactly one answer: non-streamed ones 200 (re-dispatched), streams that had text end with an
``engine_lost`` error event then ``[DONE]``, streams without text complete. With a long prompt they all share,
cache-aware routing (the default with 2 engines) gathers them on the engine holding the prefix: killing that
one loses nothing either, and its cache entries leave the broker's index with it."""

from __future__ import annotations

import http.client
import json
import re
import signal
import threading
import time

import psutil
import pytest
from deployment import Deployment, free_port, write_config
from test_chaos import processes, until_ready
from tinylm import build_tiny_lm

BATCH_TIMEOUT_S = 3.0
STREAMS, PLAIN = 4, 4
TOKENS = 400

CONFIG = """
[broker]
heartbeat_interval_ms = 100

[frontends]
workers = 1
port = {port}

[[models]]
name = "tiny"
handler = "testmodels:HangingLM"
engines = 2
timeout_ms = 120000
batch_timeout_s = {batch_timeout_s}
[models.options]
path = "{lm}"
hang_file = "{hang}"
step_s = 0.005
block_size = 8
num_blocks = 256
max_running = 8
max_new_tokens = 16
"""


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("genchaos")
    lm = build_tiny_lm(tmp / "tinylm")
    config = CONFIG.format(port=free_port(), lm=lm, hang=tmp / "hang", batch_timeout_s=BATCH_TIMEOUT_S)
    d = Deployment(write_config(tmp, config)).wait_ready()
    d.hang_file = tmp / "hang"
    yield d
    assert d.stop() == 0, d.output[-3000:]


class Generations:
    """STREAMS SSE streams and PLAIN non-streamed completions, each in its own thread; every outcome is
    recorded: ("done", n_text_events) / ("engine_lost", n_text_events) / (status, error type) /
    ("closed"|"hung", ...) for no proper answer."""

    def __init__(self, d: Deployment, prompt: str = "DeepSpeed is") -> None:
        self.d = d
        self.prompt = prompt
        self.outcomes: list[tuple] = []
        self.texts = threading.Semaphore(0)  # released once per stream at its first text event
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._stream, daemon=True) for _ in range(STREAMS)]
        self.threads += [threading.Thread(target=self._plain, daemon=True) for _ in range(PLAIN)]

    def _conn(self) -> http.client.HTTPConnection:
        host, port = self.d.url.removeprefix("http://").rsplit(":", 1)
        return http.client.HTTPConnection(host, int(port), timeout=90)

    def _body(self, stream: bool) -> str:
        return json.dumps({"model": "tiny", "prompt": self.prompt, "max_tokens": TOKENS, "temperature": 0,
                           "ignore_eos": True, "stream": stream})  # fmt: skip

    def _record(self, outcome: tuple) -> None:
        with self.lock:
            self.outcomes.append(outcome)

    def _stream(self) -> None:
        conn = self._conn()
        try:
            conn.request("POST", "/v1/completions", self._body(True), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            if resp.status != 200:
                self._record((resp.status, json.loads(resp.read())["error"]["type"]))
                return
            texts, error, done = 0, None, False
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    error = event["error"]["type"]
                elif event["choices"] and event["choices"][0]["text"]:
                    texts += 1
                    if texts == 1:
                        self.texts.release()
            if not done:
                self._record(("closed", texts))  # a silent close: the stream never ended properly
            else:
                self._record((error or "done", texts))
        except (OSError, http.client.HTTPException) as exc:
            self._record(("closed", type(exc).__name__))
        finally:
            conn.close()

    def _plain(self) -> None:
        conn = self._conn()
        try:
            conn.request("POST", "/v1/completions", self._body(False), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            data = json.loads(resp.read())
            if resp.status == 200:
                self._record((200, data["usage"]["completion_tokens"]))
            else:
                self._record((resp.status, data["error"]["type"]))
        except (OSError, http.client.HTTPException) as exc:
            self._record(("closed", type(exc).__name__))
        finally:
            conn.close()

    def start_and_wait_for_text(self, plain: bool = True) -> Generations:
        """Start the streams (and, with ``plain``, the non-streamed requests: else ``start_plain`` does) and wait
        until every stream has text out: they are mid-generation."""
        for t in self.threads[: STREAMS + (PLAIN if plain else 0)]:
            t.start()
        for _ in range(STREAMS):
            assert self.texts.acquire(timeout=60), self.outcomes
        return self

    def start_plain(self) -> None:
        for t in self.threads[STREAMS:]:
            t.start()

    def join(self, timeout_s: float = 90.0) -> None:
        deadline = time.monotonic() + timeout_s
        for t in self.threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        hung = sum(t.is_alive() for t in self.threads)
        assert not hung, f"{hung} requests never answered; {self.outcomes}"

    def check(self, name: str, since: float, recovery_s: float, expect_lost: bool = True) -> None:
        assert len(self.outcomes) == STREAMS + PLAIN  # exactly one outcome per request
        plain = [o for o in self.outcomes if o[0] == 200]
        assert plain == [(200, TOKENS)] * PLAIN, self.outcomes  # re-dispatched, complete
        streams = [o for o in self.outcomes if o[0] != 200]
        # Every stream had text before the fault: it either finished on the survivor or ends engine_lost.
        assert all(kind in ("done", "engine_lost") for kind, _ in streams), self.outcomes
        lost = sum(kind == "engine_lost" for kind, _ in streams)
        assert lost >= 1 or not expect_lost, self.outcomes  # the victim held at least one stream
        print(f"\n{name}: {len(self.outcomes)} requests: {PLAIN} non-streamed 200 x {TOKENS} tokens, "
              f"{lost} streams engine_lost, {len(streams) - lost} streams done; answered "
              f"{time.monotonic() - since:.2f} s after the fault; 2 engines again in {recovery_s:.2f} s")  # fmt: skip


def test_engine_sigkill_mid_generation_answers_every_request_once(deployment):
    before = route_decisions(deployment)
    gens = Generations(deployment).start_and_wait_for_text(plain=False)
    # the victim is the engine the broker sent most of the streams to (the router may well have sent them all to
    # one: killing the other would test nothing), counted before the non-streamed requests go out (sent with
    # them, a tie could pick the engine holding only those, and no stream would be lost)
    sent = routed_since(deployment, before, STREAMS)
    holder = max(sent, key=lambda e: sent[e], default="")
    assert sent.get(holder, 0) >= 1, sent
    gens.start_plain()
    routed_since(deployment, before, STREAMS + PLAIN)  # all of them routed, wherever: then the fault
    [victim] = processes(deployment, f"--name {holder} ")
    at = time.monotonic()
    victim.send_signal(signal.SIGKILL)
    gens.join()
    recovery = until_ready(deployment, "tiny", 2, at)
    gens.check("generative engine SIGKILL mid-stream", at, recovery)


def test_a_generative_step_that_stops_advancing_is_found_killed_and_replaced(deployment):
    gens = Generations(deployment).start_and_wait_for_text()
    mark = len(deployment.lines)
    at = time.monotonic()
    deployment.hang_file.write_text("hang")  # the next engine to step takes it and blocks
    while deployment.hang_file.exists():
        assert time.monotonic() - at < 30, "no engine stepped"
        time.sleep(0.01)
    taken = time.monotonic()
    line = deployment.wait_for_line("is hung", after=mark, timeout_s=BATCH_TIMEOUT_S + 10)
    found_s = time.monotonic() - taken
    hung_pid = int(re.search(r"\(pid (\d+)\) is hung", deployment.lines[line - 1]).group(1))
    gens.join()
    recovery = until_ready(deployment, "tiny", 2, at)
    assert not psutil.pid_exists(hung_pid) or psutil.Process(hung_pid).status() == psutil.STATUS_ZOMBIE
    assert found_s < BATCH_TIMEOUT_S + 2.0, found_s
    gens.check(f"generative step hung (found after {found_s:.2f} s, batch_timeout_s {BATCH_TIMEOUT_S})", at, recovery)


def routed_since(d: Deployment, before: dict[tuple[str, str], float], count: int) -> dict[str, float]:
    """Engine -> requests routed to it since ``before``, once they add up to ``count`` (the decision counters lag
    the broker a little) or after 10 s."""
    deadline = time.monotonic() + 10
    while True:
        sent: dict[str, float] = {}
        for (engine, reason), n in route_decisions(d).items():
            sent[engine] = sent.get(engine, 0) + n - before.get((engine, reason), 0)
        if sum(sent.values()) >= count or time.monotonic() > deadline:
            return sent
        time.sleep(0.1)


def route_decisions(d: Deployment) -> dict[tuple[str, str], float]:
    """(engine, reason) -> routing decisions so far, from /metrics."""
    _, _, text = d.request("GET", "/metrics")
    found = re.findall(r"^zserve_route_decisions_total\{([^}]*)\} (\S+)$", text, re.M)
    out = {}
    for labels, value in found:
        fields = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        out[(fields["engine"], fields["reason"])] = float(value)
    return out


def test_the_engine_holding_a_hot_prefix_dies_nothing_is_lost_and_its_entries_go(deployment):
    deployment.wait_for_line("routing: tokenizer loaded")  # requests carry their prompt blocks from here on
    prompt = "The quick brown fox jumps over the lazy dog. " * 4  # blocks of 8 tokens: several shared
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0}
    assert deployment.request("POST", "/v1/completions", body)[0] == 200  # one engine computes the prefix
    before = route_decisions(deployment)
    gens = Generations(deployment, prompt).start_and_wait_for_text()
    deadline = time.monotonic() + 10
    while True:  # the frontend's view of the broker's counters lags a little
        counts = route_decisions(deployment)
        matched = {e: n - before.get((e, r), 0) for (e, r), n in counts.items() if r == "match"}
        if sum(matched.values()) >= 1 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    holder = max(matched, key=lambda e: matched[e], default="")
    assert matched.get(holder, 0) >= 1, counts  # the requests went to the engine holding their prefix
    [victim] = processes(deployment, f"--name {holder} ")
    at = time.monotonic()
    victim.send_signal(signal.SIGKILL)
    gens.join()
    recovery = until_ready(deployment, "tiny", 2, at, timeout_s=180)  # restarted before in this module: backoff
    gens.check("the engine holding the hot prefix SIGKILLed", at, recovery, expect_lost=False)
    # the restarted engine starts with an empty cache and the broker dropped the dead one's entries: the next
    # request for the prefix is not routed to it as a match
    after = route_decisions(deployment)
    assert deployment.request("POST", "/v1/completions", body)[0] == 200
    deadline = time.monotonic() + 10
    while sum(route_decisions(deployment).values()) <= sum(after.values()):
        assert time.monotonic() < deadline, "the decision never showed in /metrics"
        time.sleep(0.1)
    final = route_decisions(deployment)
    [decision] = [k for k, n in final.items() if n > after.get(k, 0)]
    assert decision != (holder, "match"), (after, final)
