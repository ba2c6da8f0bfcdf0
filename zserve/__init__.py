"""zserve: high-throughput model serving.

Public API: ``Model`` (write one), ``Client``/``AsyncClient`` (talk to a running deployment), and the
typed errors they raise.

The names are imported when first used (PEP 562), not with the package: ``import zserve.generator...`` on a
machine without pyzmq (the GPU check's image, bench/gpu/) must not import the clients' ZeroMQ sockets.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# name -> the module that defines it
_PUBLIC = {
    "Answer": "zserve.client",
    "AsyncClient": "zserve.client",
    "Client": "zserve.client",
    "Pipeline": "zserve.entrypoints",
    "ServedClient": "zserve.entrypoints",
    "pipeline": "zserve.entrypoints",
    "serve": "zserve.entrypoints",
    "BadRequest": "zserve.errors",
    "BrokerUnavailable": "zserve.errors",
    "Cancelled": "zserve.errors",
    "DeadlineExceeded": "zserve.errors",
    "EngineLost": "zserve.errors",
    "ModelError": "zserve.errors",
    "ModelLoadError": "zserve.errors",
    "Overloaded": "zserve.errors",
    "ShuttingDown": "zserve.errors",
    "UnknownModel": "zserve.errors",
    "ZserveError": "zserve.errors",
    "Model": "zserve.model",
    "Streamer": "zserve.streamer",
}

__all__ = [
    "Answer",
    "AsyncClient",
    "BadRequest",
    "BrokerUnavailable",
    "Cancelled",
    "Client",
    "DeadlineExceeded",
    "EngineLost",
    "Model",
    "ModelError",
    "ModelLoadError",
    "Overloaded",
    "Pipeline",
    "ServedClient",
    "ShuttingDown",
    "Streamer",
    "UnknownModel",
    "ZserveError",
    "pipeline",
    "serve",
]

if TYPE_CHECKING:
    from zserve.client import Answer, AsyncClient, Client
    from zserve.entrypoints import Pipeline, ServedClient, pipeline, serve
    from zserve.errors import (
        BadRequest,
        BrokerUnavailable,
        Cancelled,
        DeadlineExceeded,
        EngineLost,
        ModelError,
        ModelLoadError,
        Overloaded,
        ShuttingDown,
        UnknownModel,
        ZserveError,
    )
    from zserve.model import Model
    from zserve.streamer import Streamer


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'zserve' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
