import sys
from pathlib import Path

import pytest

# tests/support holds the test models; engine subprocesses get it through PYTHONPATH (see fixtures).
SUPPORT = Path(__file__).resolve().parent / "support"
sys.path.insert(0, str(SUPPORT))
sys.path.insert(0, str(SUPPORT.parent))  # tests/cluster.py


def pytest_sessionfinish(session, exitstatus) -> None:
    from deployment import stop_leftovers

    stop_leftovers()


# Tiny models of each batch task (tests/support/tinymodels.py), built once per run.
@pytest.fixture(scope="session")
def tiny_classifier(tmp_path_factory) -> Path:
    from tinymodels import build_tiny_classifier

    return build_tiny_classifier(tmp_path_factory.mktemp("tiny-classifier") / "classifier")


@pytest.fixture(scope="session")
def tiny_cross_encoder(tmp_path_factory) -> Path:
    from tinymodels import build_tiny_cross_encoder

    return build_tiny_cross_encoder(tmp_path_factory.mktemp("tiny-cross-encoder") / "reranker")


@pytest.fixture(scope="session")
def tiny_vit(tmp_path_factory) -> Path:
    from tinymodels import build_tiny_vit

    return build_tiny_vit(tmp_path_factory.mktemp("tiny-vit") / "vit")
