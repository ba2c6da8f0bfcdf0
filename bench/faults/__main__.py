"""``python -m bench.faults``: overload, soak, abuse, broker-burst and qos (bench/README.md)."""

import sys

from bench.common.cli import Scenario, dispatch

SCENARIOS = {
    "overload": Scenario("bench.faults.overload", "goodput at 10x the offered load of capacity, RSS growth"),
    "soak": Scenario("bench.faults.soak", "30 min at 80% of capacity: RSS, open fds, p50/p99 over time"),
    "abuse": Scenario("bench.faults.abuse", "one caller's huge request: others' p99 before and after, workers lost"),
    "broker-burst": Scenario("bench.faults.broker_burst", "100k requests at once: the broker's heartbeat gaps"),
    "qos": Scenario("bench.faults.qos", "tenants' fair share, an urgent stream's latency, a quota's 429s"),
}

if __name__ == "__main__":
    sys.exit(dispatch("faults", SCENARIOS))
