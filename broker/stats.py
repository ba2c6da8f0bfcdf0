"""Per-model serving statistics the broker reports in its HealthReport (for /metrics and `zserve status`):
batch sizes and answer latencies over a recent window, and generative engines' step counters. Pure."""

from __future__ import annotations

from dataclasses import dataclass, field

WINDOW = 2048  # recent requests (and batches) the percentiles and mean batch size are taken over


@dataclass(slots=True)
class ModelStats:
    batches: int = 0
    engine_steps: int = 0
    batch_tokens: int = 0
    _sizes: list[int] = field(default_factory=list)
    _latencies_s: list[float] = field(default_factory=list)

    def batch_done(self, size: int) -> None:
        self.batches += 1
        sizes = self._sizes
        sizes.append(size)
        if len(sizes) > 2 * WINDOW:
            del sizes[:WINDOW]

    def answered(self, latency_s: float) -> None:
        lat = self._latencies_s
        lat.append(latency_s)
        if len(lat) > 2 * WINDOW:  # trimmed in halves: amortised O(1) per request
            del lat[:WINDOW]

    def mean_batch_size(self) -> float:
        recent = self._sizes[-WINDOW:]
        return sum(recent) / len(recent) if recent else 0.0

    def latency_ms(self, *quantiles: float) -> list[float]:
        recent = sorted(self._latencies_s[-WINDOW:])
        if not recent:
            return [0.0] * len(quantiles)
        return [recent[min(len(recent) - 1, int(q * len(recent)))] * 1000.0 for q in quantiles]
