"""zserve: high-throughput model serving.

Public API: ``Model`` (write one), ``Client``/``AsyncClient`` (talk to a running deployment), and the
typed errors they raise.
"""

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

__version__ = "0.1.0"

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
