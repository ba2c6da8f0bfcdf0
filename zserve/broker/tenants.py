"""Tenants at the broker's door (a job split out of the broker core, working through its public collaborators:
the request table and the outbox): each tenant's quotas (``zserve.batching.quotas``), checked as its requests
arrive, and the counts the HealthReport shows per tenant. Pure: the clock is passed in."""

from __future__ import annotations

from collections.abc import Iterable

from zserve.batching.quotas import TenantQuota
from zserve.broker.outbox import Outbox
from zserve.broker.requests import Request, RequestTable
from zserve.config import TenantConfig
from zserve.protocol import Reply, Status


class Tenants:
    def __init__(self, tenants: Iterable[TenantConfig], requests: RequestTable, outbox: Outbox) -> None:
        self.requests = requests
        self.outbox = outbox
        # per tenant with a quota
        self.quotas = {
            t.name: TenantQuota(t.requests_per_s, t.tokens_per_min, t.max_concurrent)
            for t in tenants
            if t.requests_per_s or t.tokens_per_min or t.max_concurrent
        }
        self.counts: dict[str, list[int]] = {}  # tenant -> [admitted, refused past a quota, overloaded]

    def admit(self, request: Request, tenant: str, now: float) -> bool:
        """Check ``tenant``'s quotas for this request: past one, answer RATE_LIMITED naming it (``field``) with
        when to retry, and return False; else count it as the tenant's."""
        counts = self.counts.get(tenant)
        if counts is None:
            counts = self.counts[tenant] = [0, 0, 0]
        quota = self.quotas.get(tenant)
        if quota is not None:
            pending = self.requests.pending_by_tenant.get(tenant, 0)
            refusal = quota.admit(tenant, now, request.cost, pending)
            if refusal is not None:
                counts[1] += 1
                self.requests.pop(request.item_id)
                retry_ms = max(1, round(refusal.retry_after_s * 1000.0))
                reply = Reply(
                    request.req_id, Status.RATE_LIMITED, refusal.message, refusal.quota, retry_after_ms=retry_ms
                )
                self.outbox.answer(request.client, reply)
                return False
        counts[0] += 1
        self.requests.set_tenant(request, tenant)
        return True

    def count_overloaded(self, request: Request) -> None:
        """The admitted request is refused OVERLOADED (queue full, pushed out, or it would be late): count it, and
        give its tenant's quotas back what its admission took, as it is computed for nobody."""
        if request.tenant:
            self.counts[request.tenant][2] += 1
            quota = self.quotas.get(request.tenant)
            if quota is not None:
                quota.refund(request.cost)
