from __future__ import annotations

import pytest
from cluster import Cluster


@pytest.fixture
def cluster_factory(tmp_path):
    made: list[Cluster] = []

    def make(toml: str) -> Cluster:
        cluster = Cluster(toml, tmp_path)
        made.append(cluster)
        return cluster

    yield make
    for cluster in made:
        cluster.stop()
