"""The performance targets of the issue, checked against one run's measurements."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from measure import DIRECT, HTTP, INPROCESS, NAIVE, Measurement, find

HIGH = 64
RTT = "zmq-round-trip"  # a pseudo-scenario: the bare pyzmq round trip, not a Measurement


@dataclass
class Target:
    name: str
    goal: str
    measured: str
    met: bool | None  # None: a measurement it needs was not taken in this run

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


Need = tuple[str, str, int | None]  # scenario, model, concurrency


def evaluate(results: list[Measurement], rtt: dict[str, float] | None, echo: str, embed: str) -> list[Target]:
    """``echo`` and ``embed``: the names the echo and the embedding model are served under in this run."""
    targets: list[Target] = []

    def check(name: str, goal: str, needs: list[Need], judge: Callable[..., tuple[str, bool]]) -> None:
        found: list[Any] = [rtt if s == RTT else find(results, s, m, c) for s, m, c in needs]
        missing = [
            f"{s} {m} c{c}" if c else f"{s} {m}".strip() for (s, m, c), f in zip(needs, found, strict=True) if not f
        ]
        if missing:
            targets.append(Target(name, goal, "not measured: " + ", ".join(missing), None))
        else:
            measured, met = judge(*found)
            targets.append(Target(name, goal, measured, met))

    def qps_ratio(minimum: float) -> Callable[[Measurement, Measurement], tuple[str, bool]]:
        def judge(a: Measurement, b: Measurement) -> tuple[str, bool]:
            ratio = a.qps / b.qps if b.qps else 0.0
            return f"{ratio:.2f}x ({a.qps:,.1f} vs {b.qps:,.1f} per s)", ratio >= minimum

        return judge

    def p99_vs_call(http: Measurement, limit: Measurement) -> tuple[str, bool]:
        ratio = http.p99_ms / limit.p50_ms
        return f"{ratio:.2f}x (p99 {http.p99_ms:.0f} ms vs one call {limit.p50_ms:.0f} ms)", ratio <= 2.5

    def added_p50(http: Measurement, naive: Measurement) -> tuple[str, bool]:
        added = http.p50_ms - naive.p50_ms
        return f"{added:+.2f} ms (p50 {http.p50_ms:.2f} vs {naive.p50_ms:.2f} ms)", added <= 2.0

    def direct_vs_rtt(direct: Measurement, bare: dict[str, float]) -> tuple[str, bool]:
        ratio = direct.p50_ms * 1000.0 / bare["rtt_p50_us"]
        return (
            f"{ratio:.1f}x (p50 {direct.p50_ms * 1000:.0f} us vs round trip {bare['rtt_p50_us']:.0f} us)",
            ratio <= 5.0,
        )

    check("embed-vs-limit", f"{embed} over HTTP at c64 >= 0.9x the in-process batch-32 limit",
          [(HTTP, embed, HIGH), (INPROCESS, embed, None)], qps_ratio(0.9))  # fmt: skip
    check("embed-vs-naive", f"{embed} over HTTP at c64 >= 1.7x naive",
          [(HTTP, embed, HIGH), (NAIVE, embed, HIGH)], qps_ratio(1.7))  # fmt: skip
    check("embed-p99", f"{embed} over HTTP at c64: p99 <= 2.5x the in-process batch-32 call time (its p50)",
          [(HTTP, embed, HIGH), (INPROCESS, embed, None)], p99_vs_call)  # fmt: skip
    check("embed-http-vs-direct", f"{embed} over HTTP at c64 >= 0.95x the direct client's throughput at c64",
          [(HTTP, embed, HIGH), (DIRECT, embed, HIGH)], qps_ratio(0.95))  # fmt: skip
    check("echo-vs-naive", f"{echo} over HTTP at c64 >= 1.0x naive QPS",
          [(HTTP, echo, HIGH), (NAIVE, echo, HIGH)], qps_ratio(1.0))  # fmt: skip
    check("echo-c1-latency", f"{echo} over HTTP at c1 adds <= 2 ms p50 over naive",
          [(HTTP, echo, 1), (NAIVE, echo, 1)], added_p50)  # fmt: skip
    check("echo-direct-vs-rtt", f"{echo} through the direct client at c1: p50 <= 5x the bare zmq round trip",
          [(DIRECT, echo, 1), (RTT, "", None)], direct_vs_rtt)  # fmt: skip
    return targets


def format_targets(targets: list[Target]) -> str:
    lines = ["Targets:"]
    for t in targets:
        mark = {True: "MET   ", False: "MISSED", None: "n/a   "}[t.met]
        lines.append(f"  [{mark}] {t.goal}: {t.measured}")
    met = sum(1 for t in targets if t.met)
    measured = sum(1 for t in targets if t.met is not None)
    skipped = len(targets) - measured
    lines.append(
        f"  {met}/{measured} measured targets met" + (f"; {skipped} not measured in this run" if skipped else "")
    )
    return "\n".join(lines)
