"""``python -m bench.faults``: overload and soak (bench/README.md)."""

import sys

from bench.common.cli import Scenario, dispatch

SCENARIOS = {
    "overload": Scenario("bench.faults.overload", "goodput at 10x the offered load of capacity, RSS growth"),
    "soak": Scenario("bench.faults.soak", "30 min at 80% of capacity: RSS, open fds, p50/p99 over time"),
}

if __name__ == "__main__":
    sys.exit(dispatch("faults", SCENARIOS))
