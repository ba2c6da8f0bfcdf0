"""Typed exceptions, shared by the Python clients, the engines and the frontends."""

from __future__ import annotations

import re

import msgspec

from zserve.protocol import Status

# msgspec ends a validation error's text with the path of the value at fault: "... - at `$.models[0].engines`".
_AT_PATH = re.compile(r" - at `\$\.?(.*)`$")


class ZserveError(Exception):
    """Base of every error a zserve client raises. ``status`` is the wire status behind it."""

    status: Status = Status.INTERNAL
    http_status: int = 500
    type_name: str = "internal_error"

    def __init__(self, message: str = "", *, field: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.field = field


class BadRequest(ZserveError):
    """The input was rejected. Raise it from ``decode_request`` or ``predict`` to answer 400."""

    status = Status.BAD_REQUEST
    http_status = 400
    type_name = "bad_request"


class UnknownModel(ZserveError):
    status = Status.UNKNOWN_MODEL
    http_status = 404
    type_name = "unknown_model"


class Overloaded(ZserveError):
    """The model's queue is full (or the broker is shutting down): retry later."""

    status = Status.OVERLOADED
    http_status = 503
    type_name = "overloaded"


class RateLimited(ZserveError):
    """The request's tenant is past one of its quotas (``field`` names it: ``requests_per_s``, ``tokens_per_min``,
    ``max_concurrent``): retry after ``retry_after_s``."""

    status = Status.RATE_LIMITED
    http_status = 429
    type_name = "rate_limited"

    def __init__(self, message: str = "", *, field: str = "", retry_after_s: float = 1.0) -> None:
        super().__init__(message, field=field)
        self.retry_after_s = retry_after_s


class ShuttingDown(Overloaded):
    status = Status.SHUTTING_DOWN
    type_name = "shutting_down"


class DeadlineExceeded(ZserveError):
    status = Status.DEADLINE_EXCEEDED
    http_status = 504
    type_name = "deadline_exceeded"


class EngineLost(ZserveError):
    """The worker holding the request died (after one re-dispatch), or the broker restarted."""

    status = Status.ENGINE_LOST
    http_status = 503
    type_name = "engine_lost"


class BrokerUnavailable(EngineLost):
    """The broker stopped answering while the request was pending."""

    type_name = "broker_unavailable"


class ModelError(ZserveError):
    """The model raised, or returned the wrong number of outputs."""

    status = Status.INTERNAL
    http_status = 500
    type_name = "model_error"


class Cancelled(ZserveError):
    status = Status.CANCELLED
    http_status = 499
    type_name = "cancelled"


EXIT_CANNOT_LOAD = 4  # a worker's exit status after a ModelLoadError


class ModelLoadError(RuntimeError):
    """A handler's ``setup`` or ``setup_preprocess`` found that its model cannot be loaded (a folder the library
    cannot read, a model of the wrong kind). Restarting would fail the same way, so the worker exits with
    ``EXIT_CANNOT_LOAD`` and the supervisor stops the deployment with this message instead of restarting it."""


_BY_STATUS: dict[Status, type[ZserveError]] = {
    cls.status: cls
    for cls in (
        BadRequest,
        UnknownModel,
        Overloaded,
        RateLimited,
        ShuttingDown,
        DeadlineExceeded,
        EngineLost,
        ModelError,
        Cancelled,
    )
}


def error_for(status: Status, message: str, field: str = "", retry_after_ms: int = 0) -> ZserveError:
    """The typed exception for a non-OK wire status."""
    if status == Status.RATE_LIMITED:
        return RateLimited(message, field=field, retry_after_s=max(1, retry_after_ms) / 1000.0)
    return _BY_STATUS.get(status, ZserveError)(message, field=field)


def validation_parts(exc: msgspec.ValidationError) -> tuple[str, str]:
    """msgspec's message and the path it names, apart: "Expected `int`, got `str` - at `$.models[0].engines`" is
    ("Expected `int`, got `str`", "models[0].engines"). The path is "" at the top level (msgspec names none there)."""
    text = str(exc)
    match = _AT_PATH.search(text)
    return (text, "") if match is None else (text[: match.start()], match.group(1))


def field_of(exc: msgspec.ValidationError) -> str:
    """The request field a validation error is about: the one its message names (missing, or unknown to a struct
    that forbids unknown fields), else the first key of its path, else "body"."""
    message, path = validation_parts(exc)
    for named in ("missing required field `", "unknown field `"):
        if named in message:
            return message.split(named, 1)[1].split("`", 1)[0]
    return path.split("[", 1)[0].split(".", 1)[0] or "body"
