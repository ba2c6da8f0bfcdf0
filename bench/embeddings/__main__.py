"""``python -m bench.embeddings``: zserve's embeddings against infinity-emb and mosec (bench/embeddings/README.md)."""

import sys

from bench.common.cli import Scenario, dispatch

SCENARIOS = {
    "compare": Scenario("bench.embeddings.run", "every target on each workload and concurrency, and the limits"),
    "backends": Scenario("bench.embeddings.backends", "the model's forward in process, per backend and thread count"),
}

if __name__ == "__main__":
    sys.exit(dispatch("embeddings", SCENARIOS))
