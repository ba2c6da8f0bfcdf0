"""An open-loop flood against a model's ``max_queue``, on the pure broker core with a fake clock (no processes, no
HTTP): each tenant offers a fixed rate whatever is answered, one engine serves ``batch`` items every ``step_s``, and
the run counts each tenant's served, refused and pushed-out requests and checks that every request got exactly one
answer. ``python -m bench.faults qos --phases flood`` runs it (issue 37: the light tenant's share with a full queue).
"""

from __future__ import annotations

import random
import time
from collections import Counter
from typing import Any

from zserve.broker.core import BrokerCore
from zserve.config import parse_config
from zserve.protocol import Batch, BatchResult, Hello, Replies, Status, Submit, Submits

CONFIG = """
[broker]
heartbeat_interval_ms = 100000  # no heartbeats to simulate: the engine is never found silent

[[models]]
name = "m"
handler = "x:Y"
max_batch_size = {batch}
max_wait_ms = 1
max_queue = {max_queue}
timeout_ms = 600000
{tenants}
"""


def flood(
    rates_per_s: dict[str, int],
    *,
    seconds: float = 20.0,
    step_s: float = 0.01,
    batch: int = 2,
    max_queue: int = 100,
    weights: dict[str, float] | None = None,
    max_concurrent: int = 0,
    make_room: bool = True,
    seed: int = 0,
) -> dict[str, Any]:
    """Tenants send ``rates_per_s`` (arrivals shuffled within each step); the engine (credits 1) returns each batch
    ``step_s`` after it left. Per tenant: offered, served (ok), refused on arrival (overloaded, 503), pushed out of
    the queue for another tenant's arrival (pushed_out, 503), rate_limited (429), and its share of what was served.
    ``""`` is a request without a tenant. ``make_room=False``: the full queue refuses every arrival, as before issue
    37's fix (the before figure, same run)."""
    weights = weights or {}
    tenants = "".join(
        f'[[tenants]]\nname = "{t}"\nweight = {weights.get(t, 1.0)}\nmax_concurrent = {max_concurrent}\n'
        for t in rates_per_s
        if t
    )
    core = BrokerCore(parse_config(CONFIG.format(batch=batch, max_queue=max_queue, tenants=tenants)), epoch=1)
    if not make_room:
        core._make_room = lambda request, tenant: False  # the rule off: the arrival is always the one refused
    core.on_work(b"w", Hello("w", 1, "engine", ["m"], 1), 0.0)
    rng = random.Random(seed)
    sent: dict[tuple[bytes, int], str] = {}  # (client, req_id) -> tenant
    answers: Counter[tuple[bytes, int]] = Counter()
    outcome: dict[str, Counter[str]] = {t: Counter() for t in rates_per_s}
    running: tuple[float, Batch] | None = None  # the batch the engine computes, and when it is done
    per_step = {t: rate * step_s for t, rate in rates_per_s.items()}
    owed = dict.fromkeys(rates_per_s, 0.0)
    next_req = 0
    for step in range(round(seconds / step_s)):
        now = step * step_s
        if running is not None and running[0] <= now + 1e-9:
            b = running[1]
            n = len(b.item_ids)
            msg = BatchResult(b.batch_id, "w", [Status.OK] * n, [""] * n, [""] * n, [1] * n, step_s * 1000.0)
            core.on_out(msg, [b"out"] * n, now)
            running = None
        arrivals: list[str] = []
        for t in rates_per_s:
            owed[t] += per_step[t]
            whole = int(owed[t] + 1e-9)
            owed[t] -= whole
            arrivals += [t] * whole
        rng.shuffle(arrivals)
        for t in arrivals:
            next_req += 1
            client = f"c-{t}".encode()
            sent[(client, next_req)] = t
            outcome[t]["offered"] += 1
            core.on_client(client, Submits([Submit(next_req, "m", tenant=t)], [1]), [b"p"], now)
        core.tick(now)
        clients, work = core.flush()
        for send in clients:
            if isinstance(send.header, Replies):
                for reply in send.header.items:
                    key = (send.identity, reply.req_id)
                    answers[key] += 1
                    what = Status(reply.status).name.lower()
                    if reply.status == Status.OVERLOADED and "made room" in reply.message:
                        what = "pushed_out"
                    outcome[sent[key]][what] += 1
        for w in work:
            if isinstance(w.header, Batch):
                assert running is None, "credits 1: one batch at a time"
                running = (now + step_s, w.header)
    served = {t: c["ok"] for t, c in outcome.items()}
    total = sum(served.values()) or 1
    pending = len(core.requests)
    twice = sum(1 for n in answers.values() if n > 1)
    assert twice == 0, f"{twice} requests answered more than once"
    assert len(answers) + pending == len(sent), "a request was neither answered nor pending"
    return {
        "tenants": {t: {**dict(c), "share": round(served[t] / total, 3)} for t, c in outcome.items()},
        "pending_at_end": pending,
        "answered_twice": twice,
        "engine_capacity_per_s": batch / step_s,
        "max_queue": max_queue,
        "seconds": seconds,
    }


def admission_cost_us(max_queue: int = 1024, n: int = 512, repeats: int = 7) -> dict[str, float]:
    """Microseconds the broker core spends on one arrival at a full queue (held by tenant a), best of ``repeats``
    runs of ``n``: a's arrival refused, with the full-queue rule and without it; b's arrival refused without the rule,
    and pushing one of a's out with it (answering that one and admitting b's)."""
    config = parse_config(CONFIG.format(batch=2, max_queue=max_queue, tenants='[[tenants]]\nname = "a"\n'
                                        '[[tenants]]\nname = "b"\n'))  # fmt: skip

    def once(tenant: str, make_room: bool) -> float:
        core = BrokerCore(config, epoch=1)  # no engine: what arrives stays queued
        if not make_room:
            core._make_room = lambda request, tenant: False
        for i in range(max_queue):
            core.on_client(b"a", Submits([Submit(i, "m", tenant="a")], [1]), [b"p"], 0.0)
        core.flush()
        msgs = [Submits([Submit(max_queue + i, "m", tenant=tenant)], [1]) for i in range(n)]
        client = tenant.encode()
        started = time.perf_counter()
        for msg in msgs:
            core.on_client(client, msg, [b"p"], 0.0)
        core.flush()
        return (time.perf_counter() - started) / n * 1e6

    cases = {"a_refused_rule_off": ("a", False), "a_refused_rule_on": ("a", True), "b_refused_rule_off": ("b", False),
             "b_pushes_one_out_rule_on": ("b", True)}  # fmt: skip
    return {key: round(min(once(*case) for _ in range(repeats)), 2) for key, case in cases.items()}
