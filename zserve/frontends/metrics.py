"""Prometheus metrics of the REST frontends, safe across gunicorn worker processes.

The supervisor sets PROMETHEUS_MULTIPROC_DIR (a folder in the run dir) before gunicorn starts; every
worker writes its samples there and ``/metrics``, served by any worker, aggregates all of them.
"""

from __future__ import annotations

import asyncio
import bisect
import os
from collections.abc import Iterator, Sequence

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
    multiprocess,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from zserve.client.pending import Answer
from zserve.frontends import prometheus_internals
from zserve.protocol import HealthReport

REQUESTS = Counter("zserve_requests_total", "Predict requests answered, by model and HTTP code", ["model", "code"])
BATCH_SIZE = Histogram(
    "zserve_batch_size",
    "Size of the batch each answered request was computed in",
    ["model"],
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
)
LATENCY = Histogram(
    "zserve_request_latency_seconds",
    "Time from request received to response ready, in the frontend",
    ["model"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
)


class BrokerCollector:
    """Gauges read from the broker's latest health report at scrape time (the broker has no HTTP port)."""

    def __init__(self, report: HealthReport | None) -> None:
        self.report = report

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        if self.report is None:
            return
        depth = GaugeMetricFamily("zserve_queue_depth", "Requests waiting in the broker's queue", labels=["model"])
        in_flight = GaugeMetricFamily(
            "zserve_in_flight", "Requests dispatched to engines and not yet answered", labels=["model"]
        )
        ready = GaugeMetricFamily("zserve_ready_engines", "Engines registered with the broker", labels=["model"])
        busy = CounterMetricFamily(
            "zserve_stage_busy_seconds",
            "Compute time reported by workers, by role (preprocess stages, engines): compare with wall time "
            "to see which side is the bottleneck",
            labels=["model", "role"],
        )
        waiting = GaugeMetricFamily(
            "zserve_stage_queue_depth",
            "Work waiting for a role: requests for preprocess (or engine, without a stage), preprocessed "
            "batches for engine",
            labels=["model", "role"],
        )
        workers = GaugeMetricFamily("zserve_workers", "Workers registered, by role", labels=["model", "role"])
        running = GaugeMetricFamily(
            "zserve_running_sequences", "Generative models: sequences held by engines", labels=["model"]
        )
        free_kv = GaugeMetricFamily(
            "zserve_free_kv_blocks", "Generative models: free KV blocks over all engines", labels=["model"]
        )
        kv_usage = GaugeMetricFamily(
            "zserve_kv_cache_usage", "Generative models: fraction of the KV pools in use (0-1)", labels=["model"]
        )
        steps = CounterMetricFamily("zserve_engine_steps", "Generative models: engine steps run", labels=["model"])
        batch_tokens = CounterMetricFamily(
            "zserve_engine_batch_tokens",
            "Generative models: tokens forwarded in engine steps (mean batch = this / zserve_engine_steps_total)",
            labels=["model"],
        )
        preemptions = CounterMetricFamily(
            "zserve_preemptions", "Generative models: sequences preempted for KV blocks (recomputed)", labels=["model"]
        )
        prompt_tokens = CounterMetricFamily(
            "zserve_prompt_tokens", "Generative models: prompt tokens admitted to engines", labels=["model"]
        )
        cached_tokens = CounterMetricFamily(
            "zserve_prefix_cache_hit_tokens",
            "Generative models: prompt tokens found in the prefix cache",
            labels=["model"],
        )
        hit_rate = GaugeMetricFamily(
            "zserve_prefix_cache_hit_rate",
            "Generative models: prefix cache hit tokens / prompt tokens",
            labels=["model"],
        )
        step_s = GaugeMetricFamily(
            "zserve_engine_step_seconds_mean", "Generative models: mean engine step time", labels=["model"]
        )
        cost = CounterMetricFamily(
            "zserve_batch_cost",
            "Models batched by cost (max_batch_cost): the items' cost (tokens, for text models) in dispatched batches",
            labels=["model"],
        )
        padded_cost = CounterMetricFamily(
            "zserve_batch_padded_cost",
            "Models batched by cost: what their batches computed (size x largest cost); padding efficiency = "
            "zserve_batch_cost_total / zserve_batch_padded_cost_total",
            labels=["model"],
        )
        generative = (kv_usage, steps, batch_tokens, preemptions, prompt_tokens, cached_tokens, hit_rate, step_s)
        for m in self.report.models:
            if m.generative:
                running.add_metric([m.name], m.running_sequences)
                free_kv.add_metric([m.name], m.free_kv_blocks)
                if m.kv_blocks:
                    kv_usage.add_metric([m.name], 1.0 - m.free_kv_blocks / m.kv_blocks)
                steps.add_metric([m.name], m.engine_steps)
                batch_tokens.add_metric([m.name], m.batch_tokens)
                preemptions.add_metric([m.name], m.preemptions)
                prompt_tokens.add_metric([m.name], m.prompt_tokens)
                cached_tokens.add_metric([m.name], m.cached_prompt_tokens)
                hit_rate.add_metric([m.name], m.cached_prompt_tokens / m.prompt_tokens if m.prompt_tokens else 0.0)
                if m.engine_steps:
                    step_s.add_metric([m.name], m.engine_busy_s / m.engine_steps)
            if m.padded_cost:
                cost.add_metric([m.name], m.batched_cost)
                padded_cost.add_metric([m.name], m.padded_cost)
            depth.add_metric([m.name], m.queue_depth)
            in_flight.add_metric([m.name], m.in_flight)
            ready.add_metric([m.name], m.ready_workers)
            busy.add_metric([m.name, "engine"], m.engine_busy_s)
            workers.add_metric([m.name, "engine"], m.ready_workers)
            if m.preprocess_workers:
                busy.add_metric([m.name, "preprocess"], m.preprocess_busy_s)
                waiting.add_metric([m.name, "preprocess"], m.queue_depth)
                waiting.add_metric([m.name, "engine"], m.prepared_depth)
                workers.add_metric([m.name, "preprocess"], m.preprocess_workers)
            else:
                waiting.add_metric([m.name, "engine"], m.queue_depth)
        yield from (depth, in_flight, ready, busy, waiting, workers, running, free_kv, cost, padded_cost, *generative)
        yield from _routing(self.report)
        yield from _tenants(self.report)


def _tenants(report: HealthReport) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
    """Per tenant (docs/http-api.md#priorities-tenants-and-quotas), since the broker started."""
    admitted = CounterMetricFamily("zserve_tenant_admitted", "Requests admitted, per tenant", labels=["tenant"])
    limited = CounterMetricFamily(
        "zserve_tenant_rate_limited", "Requests answered 429, past one of the tenant's quotas", labels=["tenant"]
    )
    overloaded = CounterMetricFamily(
        "zserve_tenant_overloaded",
        "Requests answered 503 after the tenant's quotas: a full queue, or a deadline out of reach",
        labels=["tenant"],
    )
    pending = GaugeMetricFamily("zserve_tenant_pending", "The tenant's requests in the broker now", labels=["tenant"])
    served = CounterMetricFamily(
        "zserve_tenant_served_cost",
        "Cost (tokens, else requests) taken from a model's queue for the tenant: its fair share",
        labels=["model", "tenant"],
    )
    for t in report.tenants:
        admitted.add_metric([t.name], t.admitted)
        limited.add_metric([t.name], t.rate_limited)
        overloaded.add_metric([t.name], t.overloaded)
        pending.add_metric([t.name], t.pending)
        for model, cost in t.served_cost.items():
            served.add_metric([model, t.name], cost)
    yield from (admitted, limited, overloaded, pending, served)


def _routing(report: HealthReport) -> Iterator[CounterMetricFamily]:
    """Generative models routed cache_aware: per model and engine, since the broker started."""
    labels = ["model", "engine"]
    requested = CounterMetricFamily(
        "zserve_route_prompt_blocks",
        "Cache-aware routing: prompt blocks of the requests routed to an engine",
        labels=labels,
    )
    found = CounterMetricFamily(
        "zserve_route_cached_blocks",
        "Cache-aware routing: of those, held by the engine's prefix cache when routed (hit rate = this / "
        "zserve_route_prompt_blocks_total)",
        labels=labels,
    )
    decisions = CounterMetricFamily(
        "zserve_route_decisions",
        "Cache-aware routing: requests routed to an engine, by reason (match: it held the most of the prompt; spill: "
        "the best match ran too many sequences; least_loaded: nothing held anywhere)",
        labels=[*labels, "reason"],
    )
    for m in report.models:
        for r in m.routing:
            requested.add_metric([m.name, r.engine], r.prompt_blocks)
            found.add_metric([m.name, r.engine], r.cached_blocks)
            for reason, count in (("match", r.match), ("spill", r.spill), ("least_loaded", r.least_loaded)):
                decisions.add_metric([m.name, r.engine, reason], count)
    yield from (requested, found, decisions)


CONTENT_TYPE = CONTENT_TYPE_LATEST


class ModelMetrics:
    """The per-request metrics of one model. ``answered`` only counts in memory (~0.5 us); the counts reach
    prometheus' multiprocess files in one ``flush`` per event-loop turn, scheduled by the first answer of
    the turn. Each write there takes a lock and an mmap store: five per request cost 4.4 us, a fifth of the
    fast HTTP path's CPU per request, and a turn answers a whole batch."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.batch_size = BATCH_SIZE.labels(model)
        self.latency = LATENCY.labels(model)
        for child in (self.batch_size, self.latency):  # what _Observations.write_to writes to
            prometheus_internals.require(child)
        self._codes: dict[int, Counter] = {}
        self._counts: dict[int, int] = {}
        self._latency = _Observations(prometheus_internals.upper_bounds(self.latency))
        self._batch_size = _Observations(prometheus_internals.upper_bounds(self.batch_size))
        self._flush_scheduled = False

    def answered(self, code: int, latency_s: float, batch_size: int = 0) -> None:
        self._counts[code] = self._counts.get(code, 0) + 1
        self._latency.add(latency_s)
        if batch_size:
            self._batch_size.add(batch_size)
        if not self._flush_scheduled:
            try:
                asyncio.get_running_loop().call_soon(self.flush)
            except RuntimeError:  # no event loop (a script, a test): write now
                return self.flush()
            self._flush_scheduled = True

    def answered_each(self, code: int, latency_s: float, answers: Sequence[Answer]) -> None:
        """One count per input of a request that carried several (``/v1/embeddings``, ``/v1/rerank``), each with
        its own batch size, as if each had come to the native route; one count when none was answered."""
        if not answers:
            return self.answered(code, latency_s)
        for answer in answers:
            self.answered(code, latency_s, answer.batch_size)

    def flush(self) -> None:
        self._flush_scheduled = False
        counts, self._counts = self._counts, {}
        for code, n in counts.items():
            counter = self._codes.get(code)
            if counter is None:
                counter = self._codes[code] = REQUESTS.labels(self.model, str(code))
            counter.inc(n)
        self._latency.write_to(self.latency)
        self._batch_size.write_to(self.batch_size)


class _Observations:
    """Observations of one histogram counted per bucket, written out as one increment per bucket."""

    def __init__(self, upper_bounds: list[float]) -> None:
        self.bounds = list(upper_bounds)  # ascending, +Inf last
        self.counts = [0] * len(self.bounds)
        self.total = 0.0

    def add(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # the first bound >= value, as observe()
        self.total += value

    def write_to(self, child: Histogram) -> None:
        """What ``child.observe(v)`` for every value added would have written. Histogram has no public way
        to add many observations: prometheus_internals writes its bucket and sum values (checked in ModelMetrics)."""
        if not any(self.counts):
            return
        prometheus_internals.add(child, self.counts, self.total)
        self.counts = [0] * len(self.counts)
        self.total = 0.0


def render(report: HealthReport | None) -> bytes:
    """This process's metrics (all workers' in multiprocess mode) plus the broker's gauges."""
    registry = CollectorRegistry()
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        multiprocess.MultiProcessCollector(registry)
    else:
        registry.register(_Forward(REGISTRY))
    registry.register(BrokerCollector(report))
    return generate_latest(registry)


class _Forward:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterator:
        return self.registry.collect()
