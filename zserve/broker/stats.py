"""Per-model serving statistics the broker reports in its HealthReport (for /metrics and `zserve status`):
batch sizes and answer latencies over a recent window, and generative engines' step counters. Pure."""

from __future__ import annotations

from dataclasses import dataclass, field

WINDOW = 2048  # recent requests (and batches) the percentiles and mean batch size are taken over
_EWMA = 0.1  # weight of the newest batch in the per-item compute time


@dataclass(slots=True)
class ModelStats:
    batches: int = 0
    workers_hung: int = 0  # workers of this model found hung (and killed) since the broker started
    slowest_batch_s: float = 0.0  # over recent batches (decays: halved every WINDOW batches)
    engine_steps: int = 0
    batch_tokens: int = 0
    # engine compute time per item over recent batches (an EWMA), and that divided by the engines that
    # reported it: how long the queue takes to move by one item (0 until a batch was computed)
    item_s: float = 0.0
    drain_s_per_item: float = 0.0
    # appended to directly on the broker's hot path (one per answered request); trimmed per batch
    latencies_s: list[float] = field(default_factory=list)
    _sizes: list[int] = field(default_factory=list)

    def batch_done(self, size: int, compute_s: float = 0.0, engines: int = 1) -> None:
        self.batches += 1
        self._sizes.append(size)
        if compute_s > 0.0 and size:
            per_item = compute_s / size
            self.item_s = per_item if not self.item_s else self.item_s + _EWMA * (per_item - self.item_s)
            self.drain_s_per_item = self.item_s / max(1, engines)
        if compute_s > self.slowest_batch_s:
            self.slowest_batch_s = compute_s
        elif self.batches % WINDOW == 0:
            self.slowest_batch_s /= 2.0
        for recent in (self._sizes, self.latencies_s):
            if len(recent) > 2 * WINDOW:  # trimmed in halves: amortised O(1)
                del recent[: len(recent) - WINDOW]

    def mean_batch_size(self) -> float:
        recent = self._sizes[-WINDOW:]
        return sum(recent) / len(recent) if recent else 0.0

    def latency_ms(self, *quantiles: float) -> list[float]:
        recent = sorted(self.latencies_s[-WINDOW:])
        if not recent:
            return [0.0] * len(quantiles)
        return [recent[min(len(recent) - 1, int(q * len(recent)))] * 1000.0 for q in quantiles]
