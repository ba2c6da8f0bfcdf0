"""What the benchmark sends to each model, and the deployment it measures.

The deployment is the repo's ``supervisor.toml`` (or ``--config``), narrowed to the models asked for, with
the port, run dir and torch thread count overridden. Its ``max_batch_size`` is the batch of the
in-process limit, so the limit is always "the engine's full batch, called directly".
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from bench.common.paths import REPO
from zserve.config import Config, ModelConfig, load_config, to_toml

DEFAULT_CONFIG = REPO / "supervisor.toml"

# One sentence of ordinary length for every embedding request, so that HTTP, the direct client, the naive
# baseline and the in-process batch all tokenize to the same length (no padding differences between them).
SENTENCE = "The quick brown fox jumps over the lazy dog while the server quietly batches incoming requests."

# Request bodies by handler; a model served by another handler needs an entry here.
BODIES: dict[str, Any] = {
    "zserve.models.echo:Echo": {"x": 1, "text": "hello"},
    "zserve.models.embedding:SentenceEmbedding": {"text": SENTENCE},
}

THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


@dataclass(frozen=True)
class ModelPlan:
    """One model under test: how it is deployed and what a request looks like."""

    config: ModelConfig
    body: Any

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def batch(self) -> int:
        return self.config.max_batch_size

    @property
    def threads(self) -> int:
        return self.config.threads

    @property
    def body_bytes(self) -> bytes:
        return json.dumps(self.body, separators=(",", ":")).encode()


def plan_models(config_path: Path, names: list[str], threads: int | None) -> tuple[Config, list[ModelPlan]]:
    """Load the base deployment, keep ``names`` (in that order), apply the thread override."""
    config = load_config(config_path)
    known = {m.name: m for m in config.models}
    missing = [n for n in names if n not in known]
    if missing:
        raise SystemExit(f"bench: {config_path} has no model named {', '.join(missing)} (it has {', '.join(known)})")
    plans = []
    for name in names:
        model = known[name]
        if threads is not None:
            model.threads = threads
        if model.handler not in BODIES:
            raise SystemExit(
                f"bench: no request body known for handler {model.handler}; add one to bench/common/catalog.py"
            )
        plans.append(ModelPlan(model, BODIES[model.handler]))
    config.models = [p.config for p in plans]
    return config, plans


def deployment_toml(config: Config, port: int) -> str:
    """The deployment as a supervisor.toml: loopback on ``port``, a run dir derived from the file's path."""
    config = msgspec.structs.replace(
        config,
        supervisor=msgspec.structs.replace(config.supervisor, run_dir=""),
        frontends=msgspec.structs.replace(config.frontends, host="127.0.0.1", port=port),
    )
    return to_toml(config)


def thread_env(threads: int) -> dict[str, str]:
    """The environment of a process that runs torch with ``threads`` intra-op threads."""
    env = dict(os.environ)
    env.update({var: str(threads) for var in THREAD_VARS})
    return env


def clean_env() -> dict[str, str]:
    """The environment for `zserve up`: no inherited thread variables, so each engine's ``threads`` rules."""
    return {k: v for k, v in os.environ.items() if k not in THREAD_VARS}
