"""The performance targets of the issue, checked against one run's measurements."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from bench.common.measure import BROKER, BROKER_ALONE, DIRECT, HTTP, INPROCESS, MOSEC, NAIVE, PEERS, Measurement, find

HIGH = 64
RTT = "zmq-round-trip"  # a pseudo-scenario: the bare pyzmq round trip, not a Measurement
BEST_PEER = "best-peer"  # a pseudo-scenario: the peer (naive, mosec, service-streamer) with the highest QPS
BROKER_ITEMS_PER_S = 150_000


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
        def lookup(s: str, m: str, c: int | None) -> Any:
            if s == RTT:
                return rtt
            if s == BEST_PEER:
                peers = [p for p in (find(results, peer, m, c) for peer in PEERS) if p]
                return max(peers, key=lambda p: p.qps) if peers else None
            if s in (BROKER, BROKER_ALONE):
                return next((r for r in results if r.scenario == s), None)
            return find(results, s, m, c)

        found: list[Any] = [lookup(s, m, c) for s, m, c in needs]
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

    def named_ratio(minimum: float) -> Callable[[Measurement, Measurement], tuple[str, bool]]:
        def judge(a: Measurement, b: Measurement) -> tuple[str, bool]:
            measured, met = qps_ratio(minimum)(a, b)
            return f"{measured[:-1]}, {b.scenario})", met

        return judge

    def p99_vs(maximum: float) -> Callable[[Measurement, Measurement], tuple[str, bool]]:
        def judge(a: Measurement, b: Measurement) -> tuple[str, bool]:
            ratio = a.p99_ms / b.p99_ms if b.p99_ms else float("inf")
            return f"{ratio:.2f}x (p99 {a.p99_ms:.2f} vs {b.p99_ms:.2f} ms)", ratio <= maximum

        return judge

    def p50_at_most(ms: float) -> Callable[[Measurement], tuple[str, bool]]:
        def judge(m: Measurement) -> tuple[str, bool]:
            return f"p50 {m.p50_ms:.2f} ms", m.p50_ms <= ms

        return judge

    def broker_items(b: Measurement) -> tuple[str, bool]:
        d = b.detail
        return (
            f"{b.qps:,.0f} items/s, {d['workers']} no-op workers, {d['clients']} raw clients x {d['window']} Submits "
            f"of {d['items_per_message']} items; broker {d['broker_us_per_item']:.2f} us CPU/item "
            f"({d['broker_cores']:.2f} cores)",
            b.qps >= BROKER_ITEMS_PER_S,
        )

    # Issue 9 (data plane v2): zserve against the fastest peers, measured in this run.
    check("i9-echo-vs-mosec", f"{echo} over HTTP at c64 >= 0.5x mosec's QPS",
          [(HTTP, echo, HIGH), (MOSEC, echo, HIGH)], qps_ratio(0.5))  # fmt: skip
    check("i9-echo-p99-vs-mosec", f"{echo} over HTTP at c64: p99 <= 2x mosec's p99",
          [(HTTP, echo, HIGH), (MOSEC, echo, HIGH)], p99_vs(2.0))  # fmt: skip
    check("i9-echo-c1-p50", f"{echo} over HTTP at c1: p50 <= 1.0 ms", [(HTTP, echo, 1)], p50_at_most(1.0))
    check("i9-direct-vs-mosec", f"{echo} through the direct client at c64 >= 1.5x mosec's HTTP QPS at c64",
          [(DIRECT, echo, HIGH), (MOSEC, echo, HIGH)], qps_ratio(1.5))  # fmt: skip
    check("i9-capacity-vs-mosec", f"broker capacity (direct clients, Client.submit) >= 1.5x mosec's {echo} QPS at c64",
          [(BROKER, "", None), (MOSEC, echo, HIGH)], qps_ratio(1.5))  # fmt: skip
    check("i9-broker-capacity", f"the broker alone with no-op engines >= {BROKER_ITEMS_PER_S:,} items/s",
          [(BROKER_ALONE, "", None)], broker_items)  # fmt: skip
    check("i9-embed-vs-limit", f"{embed} over HTTP at c64 >= 0.95x the in-process batch-32 limit",
          [(HTTP, embed, HIGH), (INPROCESS, embed, None)], qps_ratio(0.95))  # fmt: skip
    check("i9-embed-vs-best-peer", f"{embed} over HTTP at c64 >= 1.0x the best peer's QPS at c64",
          [(HTTP, embed, HIGH), (BEST_PEER, embed, HIGH)], named_ratio(1.0))  # fmt: skip

    # Issue 2 (the first data plane).
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
