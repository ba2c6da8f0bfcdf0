"""What the broker reports per model and per tenant in its HealthReport (for /metrics and `zserve status`). Pure."""

from __future__ import annotations

from zserve.batching.scheduler import Scheduler
from zserve.batching.workers import ENGINE, PREPROCESS, WorkerPool
from zserve.broker.stats import ModelStats
from zserve.protocol import ModelHealth, TenantHealth


def model_health(
    name: str,
    pool: WorkerPool,
    scheduler: Scheduler,
    stats: ModelStats,
    busy_s: dict[tuple[str, str], float],
    generative: bool,
) -> ModelHealth:
    """One model's line of the HealthReport: its workers, queues, counters and latencies."""
    engines = pool.engines(name)
    in_flight = pool.in_flight_items(name)
    batched_cost, padded_cost = scheduler.padding.get(name, (0, 0))
    p50, p90, p99 = stats.latency_ms(0.5, 0.9, 0.99)
    return ModelHealth(
        name,
        ready_workers=len(engines),
        queue_depth=scheduler.depth(name),
        in_flight=in_flight,
        busy_workers=sum(1 for w in engines if w.in_flight),
        preprocess_workers=pool.ready_count(name, PREPROCESS),
        prepared_depth=scheduler.prepared_depth(name),
        engine_busy_s=busy_s.get((name, ENGINE), 0.0),
        preprocess_busy_s=busy_s.get((name, PREPROCESS), 0.0),
        generative=generative,
        running_sequences=in_flight if generative else 0,
        free_kv_blocks=sum(w.free_kv_blocks for w in engines),
        kv_blocks=sum(w.kv_blocks for w in engines),
        engine_steps=stats.engine_steps,
        batch_tokens=stats.batch_tokens,
        preemptions=sum(w.preemptions for w in engines),
        prompt_tokens=sum(w.prompt_tokens for w in engines),
        cached_prompt_tokens=sum(w.cached_prompt_tokens for w in engines),
        credits=sum(w.credits for w in engines),
        free_credits=sum(w.free_credits for w in engines),
        batches=stats.batches,
        mean_batch_size=stats.mean_batch_size(),
        latency_p50_ms=p50,
        latency_p90_ms=p90,
        latency_p99_ms=p99,
        batched_cost=batched_cost,
        padded_cost=padded_cost,
        workers_hung=stats.workers_hung,
        versions=sorted({w.versions for w in engines if w.versions}),
    )


def tenant_health(
    tenant_counts: dict[str, list[int]], scheduler: Scheduler, pending_by_tenant: dict[str, int]
) -> list[TenantHealth]:
    """Per tenant seen (``tenant_counts``: admitted, refused past a quota, overloaded): those counts, the
    cost served per model and the requests pending."""
    if not tenant_counts:
        return []
    served: dict[str, dict[str, int]] = {}
    for model, fair in scheduler.fair.items():
        for tenant, cost in fair.served.items():
            if tenant:
                served.setdefault(tenant, {})[model] = cost
    return [
        TenantHealth(name, admitted, refused, served.get(name, {}), overloaded, pending_by_tenant.get(name, 0))
        for name, (admitted, refused, overloaded) in sorted(tenant_counts.items())
    ]
