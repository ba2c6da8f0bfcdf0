"""``python -m bench.capacity``: the broker's capacity, scaling over engines and alone (bench/README.md)."""

import sys

from bench.common.cli import Scenario, dispatch

SCENARIOS = {
    "scaling": Scenario("bench.capacity.scaling", "throughput over 1..N engines whose predict sleeps like a device"),
    "broker-alone": Scenario("bench.capacity.broker_alone", "the broker process alone: no-op workers, raw clients"),
}

if __name__ == "__main__":
    sys.exit(dispatch("capacity", SCENARIOS))
