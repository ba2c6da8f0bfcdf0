"""Prometheus metrics of the REST frontends, safe across gunicorn worker processes.

The supervisor sets PROMETHEUS_MULTIPROC_DIR (a folder in the run dir) before gunicorn starts; every
worker writes its samples there and ``/metrics``, served by any worker, aggregates all of them.
"""

from __future__ import annotations

import os

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)

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
QUEUE_WAIT = Histogram(
    "zserve_queue_wait_seconds",
    "Time a request waited in the broker before dispatch to an engine",
    ["model"],
    buckets=(0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0),
)
QUEUE_DEPTH = Gauge(
    "zserve_queue_depth",
    "Requests waiting in the broker's queue (read from the broker at scrape time)",
    ["model"],
    multiprocess_mode="mostrecent",
)
IN_FLIGHT = Gauge(
    "zserve_in_flight",
    "Requests dispatched to engines and not yet answered (read from the broker at scrape time)",
    ["model"],
    multiprocess_mode="mostrecent",
)
READY_ENGINES = Gauge(
    "zserve_ready_engines",
    "Engines registered with the broker (read at scrape time)",
    ["model"],
    multiprocess_mode="mostrecent",
)

CONTENT_TYPE = CONTENT_TYPE_LATEST


def render() -> bytes:
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return generate_latest(registry)
    return generate_latest(REGISTRY)
