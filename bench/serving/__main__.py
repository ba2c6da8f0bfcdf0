"""``python -m bench.serving``: zserve against the naive server, the peers and the model's limit (bench/README.md)."""

import sys

from bench.common.cli import Scenario, dispatch

SCENARIOS = {
    "compare": Scenario("bench.serving.run", "every target at each concurrency: the table, the targets, JSON and plot"),
    "hops": Scenario("bench.serving.hops", "the per-hop profile: CPU per request of every process, optional py-spy"),
}

if __name__ == "__main__":
    sys.exit(dispatch("serving", SCENARIOS))
