"""One measurement (a row of the table) and the statistics behind it."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

# Scenario names, in table order.
HTTP = "zserve-http"
DIRECT = "zserve-direct"
NAIVE = "naive-http"
MOSEC = "mosec-http"
STREAMER = "streamer-http"
# No-op engines, direct clients with many requests in flight (bench/capacity/client_submit.py)
BROKER = "broker-capacity"
# The broker process alone: no-op workers and raw clients replaying coalesced Submits (bench/capacity/broker_alone.py)
BROKER_ALONE = "broker-alone"
INPROCESS = "in-process"
SCENARIOS = (HTTP, DIRECT, NAIVE, MOSEC, STREAMER, BROKER, BROKER_ALONE, INPROCESS)
PEERS = (NAIVE, MOSEC, STREAMER)  # the other servers a zserve number is compared with


@dataclass
class Measurement:
    scenario: str
    model: str
    concurrency: int | None  # None for the in-process limit (see batch)
    qps: float  # answered requests (items, in-process) per second
    p50_ms: float
    p99_ms: float
    requests: int
    errors: int
    duration_s: float
    batch: int | None = None  # in-process: items per predict call
    vs_naive: float | None = None
    vs_mosec: float | None = None
    vs_limit: float | None = None
    detail: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def percentile(sorted_values: list[float], pct: float) -> float:
    """Nearest-rank percentile of an ascending list (0.0 when empty)."""
    if not sorted_values:
        return 0.0
    rank = max(1, math.ceil(pct / 100.0 * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


def find(results: list[Measurement], scenario: str, model: str, concurrency: int | None = None) -> Measurement | None:
    for m in results:
        if m.scenario == scenario and m.model == model and (scenario == INPROCESS or m.concurrency == concurrency):
            return m
    return None


def add_ratios(results: list[Measurement]) -> None:
    """vs_naive, vs_mosec: QPS over the naive baseline's (mosec's) at the same model and concurrency; vs_limit:
    over the in-process limit of the same model."""
    for m in results:
        naive = find(results, NAIVE, m.model, m.concurrency) if m.scenario != INPROCESS else None
        mosec = find(results, MOSEC, m.model, m.concurrency) if m.scenario != INPROCESS else None
        limit = find(results, INPROCESS, m.model)
        m.vs_naive = m.qps / naive.qps if naive and naive.qps > 0 else None
        m.vs_mosec = m.qps / mosec.qps if mosec and mosec.qps > 0 else None
        m.vs_limit = m.qps / limit.qps if limit and limit.qps > 0 else None
