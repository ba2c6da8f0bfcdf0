"""ModelMetrics counts answers in memory and writes them once per event-loop turn: what it writes must be
exactly what one prometheus call per answer would have written."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from zserve.client.pending import Answer
from zserve.frontends import metrics
from zserve.frontends.metrics import ModelMetrics

ANSWERS = [(200, 0.0004, 1), (200, 0.0021, 37), (503, 0.5, 0), (200, 31.0, 600), (400, 0.001, 0), (200, 0.01, 64)]


def _samples(text: bytes, model: str) -> list[str]:
    return sorted(line for line in text.decode().splitlines() if f'model="{model}"' in line)


def _reference(model: str) -> list[str]:
    """The same answers, one observe/inc each, on fresh metrics of the same names and buckets."""
    registry = CollectorRegistry()
    requests = Counter("zserve_requests", "", ["model", "code"], registry=registry)
    batch = Histogram("zserve_batch_size", "", ["model"], buckets=metrics.BATCH_SIZE._upper_bounds, registry=registry)
    latency = Histogram(
        "zserve_request_latency_seconds", "", ["model"], buckets=metrics.LATENCY._upper_bounds, registry=registry
    )
    for code, latency_s, batch_size in ANSWERS:
        requests.labels(model, str(code)).inc()
        latency.labels(model).observe(latency_s)
        if batch_size:
            batch.labels(model).observe(batch_size)
    return _samples(generate_latest(registry), model)


def test_one_flush_per_turn_writes_what_one_call_per_answer_would():
    model = "metrics-test-a"
    m = ModelMetrics(model)

    async def turn() -> list[str]:
        for answer in ANSWERS:
            m.answered(*answer)
        before = _samples(generate_latest(), model)
        await asyncio.sleep(0)  # the flush runs at the start of the next turn
        return before

    before = asyncio.run(turn())
    assert all(line.endswith(" 0.0") for line in before if "_created" not in line)  # nothing inside the turn
    written = [line for line in _samples(generate_latest(), model) if "_created" not in line]
    assert written == [line for line in _reference(model) if "_created" not in line]


def test_without_an_event_loop_every_answer_is_written_at_once():
    model = "metrics-test-b"
    m = ModelMetrics(model)
    m.answered(200, 0.003, 5)
    text = generate_latest().decode()
    assert f'zserve_requests_total{{code="200",model="{model}"}} 1.0' in text
    assert f'zserve_batch_size_bucket{{le="8.0",model="{model}"}} 1.0' in text
    assert f'zserve_batch_size_bucket{{le="4.0",model="{model}"}} 0.0' in text


def test_a_request_of_several_inputs_counts_each_input_with_its_batch_size():
    """/v1/embeddings and /v1/rerank: one count per input, as if each had come to the native route; a request that
    failed before any input was answered counts once, with no batch size."""
    model = "metrics-test-c"
    m = ModelMetrics(model)
    m.answered_each(200, 0.003, [Answer(None, 3, 0.0, 0.0), Answer(None, 40, 0.0, 0.0)])
    m.answered_each(400, 0.001, [])
    text = generate_latest().decode()
    assert f'zserve_requests_total{{code="200",model="{model}"}} 2.0' in text
    assert f'zserve_requests_total{{code="400",model="{model}"}} 1.0' in text
    assert f'zserve_batch_size_count{{model="{model}"}} 2.0' in text
    assert f'zserve_batch_size_bucket{{le="4.0",model="{model}"}} 1.0' in text


def test_tenant_metrics_come_from_the_health_report():
    from zserve.protocol import HealthReport, TenantHealth

    registry = CollectorRegistry()
    tenant = TenantHealth("batch", 40, 7, {"lm": 900}, overloaded=3, pending=5)
    registry.register(metrics.BrokerCollector(HealthReport(1, 1, False, [], [tenant])))
    text = generate_latest(registry).decode()
    expected = [
        'zserve_tenant_admitted_total{tenant="batch"} 40.0',
        'zserve_tenant_rate_limited_total{tenant="batch"} 7.0',
        'zserve_tenant_overloaded_total{tenant="batch"} 3.0',
        'zserve_tenant_pending{tenant="batch"} 5.0',
        'zserve_tenant_served_cost_total{model="lm",tenant="batch"} 900.0',
    ]
    for line in expected:
        assert line in text.splitlines(), line
