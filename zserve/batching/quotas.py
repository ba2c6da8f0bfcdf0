"""Per-tenant quotas checked when the broker admits a request. Pure: ``now`` (seconds, monotonic) is passed in.

Requests per second and tokens per minute are token buckets (a bucket holds at most one second's requests, or one
minute's tokens, so a tenant idle for an hour cannot then send an hour's worth at once); concurrent requests are a
count of the tenant's requests pending in the broker, which the caller passes in. A request past a quota takes
nothing from any bucket, and the refusal says which quota and when to retry. A request admitted and then refused
OVERLOADED (queue full, pushed out, or it would be late) gets what it took back: it was computed for nobody.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class TokenBucket:
    rate: float  # tokens added per second
    capacity: float
    level: float = -1.0  # -1: full (set on first use)
    last_s: float = 0.0

    def _fill(self, now: float) -> None:
        if self.level < 0:
            self.level, self.last_s = self.capacity, now
            return
        if now > self.last_s:
            self.level = min(self.capacity, self.level + (now - self.last_s) * self.rate)
            self.last_s = now

    def wait_s(self, now: float, amount: float) -> float:
        """Seconds until ``amount`` can be taken (0: now). An amount above the capacity counts as the capacity
        (one request larger than a minute's tokens is let through when the bucket is full, not refused forever)."""
        self._fill(now)
        need = min(amount, self.capacity) - self.level
        return 0.0 if need <= 0 else need / self.rate

    def take(self, amount: float) -> None:
        self.level -= min(amount, self.capacity)

    def give_back(self, amount: float) -> None:
        """Return what ``take(amount)`` took (the bucket still holds at most its capacity)."""
        self.level = min(self.capacity, self.level + min(amount, self.capacity))


@dataclass(frozen=True, slots=True)
class Refusal:
    quota: str  # the config key: requests_per_s, tokens_per_min, max_concurrent
    retry_after_s: float
    message: str


@dataclass(slots=True)
class TenantQuota:
    requests_per_s: float = 0.0  # 0: no limit
    tokens_per_min: float = 0.0
    max_concurrent: int = 0
    _rps: TokenBucket | None = None
    _tpm: TokenBucket | None = None

    def __post_init__(self) -> None:
        if self.requests_per_s > 0:
            self._rps = TokenBucket(self.requests_per_s, max(1.0, self.requests_per_s))
        if self.tokens_per_min > 0:
            self._tpm = TokenBucket(self.tokens_per_min / 60.0, self.tokens_per_min)

    def admit(self, tenant: str, now: float, cost: int, pending: int) -> Refusal | None:
        """Take one request of ``cost`` tokens, or say which quota it is past (and take nothing)."""
        if self.max_concurrent and pending >= self.max_concurrent:
            return Refusal("max_concurrent", 1.0, f"tenant {tenant!r} has {pending} requests pending (max_concurrent)")
        rps_wait = self._rps.wait_s(now, 1.0) if self._rps is not None else 0.0
        if rps_wait > 0:
            return Refusal(
                "requests_per_s", rps_wait, f"tenant {tenant!r} is past {self.requests_per_s:g} requests per second"
            )
        tpm_wait = self._tpm.wait_s(now, cost) if self._tpm is not None else 0.0
        if tpm_wait > 0:
            return Refusal(
                "tokens_per_min", tpm_wait, f"tenant {tenant!r} is past {self.tokens_per_min:g} tokens per minute"
            )
        if self._rps is not None:
            self._rps.take(1.0)
        if self._tpm is not None:
            self._tpm.take(cost)
        return None

    def refund(self, cost: int) -> None:
        """Give back what ``admit`` took for a request of ``cost`` tokens that was then refused without being served."""
        if self._rps is not None:
            self._rps.give_back(1.0)
        if self._tpm is not None:
            self._tpm.give_back(cost)
