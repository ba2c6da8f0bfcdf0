"""API keys: ``Authorization: Bearer KEY`` (what the OpenAI client sends) on every route but the health ones.

Keys come from ``[frontends] api_keys_file`` (one key per line, ``#`` comment lines; each worker reads it
again on SIGHUP) and from ``ZSERVE_API_KEYS`` (comma separated). A line of the file may name, after the key,
the key's tenant, default priority and most urgent priority: ``KEY tenant=NAME priority=N max_priority=M``
(docs/http-api.md). With neither, the
API is open. A key is compared with every accepted key by ``hmac.compare_digest``, with no early exit, so the
answer's timing says nothing about how much of a key was right. Keys are never logged: log lines name the file
and a count.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import signal
from dataclasses import dataclass
from typing import Any

import falcon.asgi

from zserve.frontends.resources import error_writer

log = logging.getLogger("zserve.frontend")

HEALTH_PATHS = ("/healthz", "/readyz", "/metrics")
ENV_VAR = "ZSERVE_API_KEYS"
MISSING_KEY = "an API key is required: send `Authorization: Bearer KEY`"


PRIORITY_BOUND = 1_000_000  # |priority| of a request or a key, as the API types bound it


@dataclass(frozen=True, slots=True)
class Caller:
    """Who a key speaks for: its tenant ("" = none), the priority its requests get when they name none, and the
    most urgent one they may name (``max_priority``; lower is more urgent): a key cannot jump ahead of the others
    further than its line in the keys file allows."""

    tenant: str = ""
    priority: int = 0
    max_priority: int = 0

    def priority_refusal(self, priority: int) -> str | None:
        """Why this key may not ask for ``priority`` (an HTTP 403), or None."""
        if priority >= self.max_priority:
            return None
        return (f"priority {priority} is more urgent than this API key may ask for: {self.max_priority} at most "
                "(max_priority in the keys file)")  # fmt: skip


ANONYMOUS = Caller()
_FIELDS = ("tenant", "priority", "max_priority")


def _caller(path: str, number: int, fields: list[str]) -> Caller:
    values: dict[str, str] = {}
    for field in fields:
        name, eq, value = field.partition("=")
        if not eq or name not in _FIELDS or not value or name in values:
            raise ValueError(
                f"{path}:{number}: after the key, only tenant=NAME, priority=N and max_priority=N may follow"
            )
        values[name] = value
    numbers = {}
    for name in ("priority", "max_priority"):
        try:
            numbers[name] = int(values.get(name, "0"))
        except ValueError:
            raise ValueError(f"{path}:{number}: {name} must be an integer") from None
        if abs(numbers[name]) > PRIORITY_BOUND:
            raise ValueError(f"{path}:{number}: {name} must be within +-{PRIORITY_BOUND}")
    priority = numbers["priority"]
    # Without max_priority the key's own priority is the most urgent it may ask for.
    most_urgent = numbers["max_priority"] if "max_priority" in values else priority
    if most_urgent > priority:
        raise ValueError(f"{path}:{number}: max_priority {most_urgent} is less urgent than the key's priority")
    return Caller(values.get("tenant", ""), priority, most_urgent)


def read_keys_file(path: str) -> list[tuple[bytes, Caller]]:
    """The keys in ``path`` and whom each speaks for: one per line (``KEY``, optionally followed by ``tenant=NAME``,
    ``priority=N``, ``max_priority=M``),
    blank lines and lines starting with ``#`` skipped. Raises ``OSError`` if the file cannot be read,
    ``ValueError`` (naming the line, not the key) for a line that is not of that form."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    keys = []
    for number, line in enumerate(lines, 1):
        key = line.strip()
        if not key or key.startswith("#"):
            continue
        key, *fields = key.split()
        keys.append((key.encode(), _caller(path, number, fields) if fields else ANONYMOUS))
    return keys


def env_keys(value: str | None) -> list[tuple[bytes, Caller]]:
    return [(k.strip().encode(), ANONYMOUS) for k in (value or "").split(",") if k.strip()]


class ApiKeys:
    """The keys a worker accepts: the file's (replaced by ``reload``) plus the environment's."""

    def __init__(self, path: str, from_env: list[tuple[bytes, Caller]]) -> None:
        self.path = path
        self.from_env = from_env
        try:
            self.from_file: list[tuple[bytes, Caller]] = read_keys_file(path) if path else []
        except OSError as exc:
            raise RuntimeError(f"[frontends] api_keys_file: cannot read {path}: {exc.strerror}") from None
        if path and not self.from_file:
            log.warning("api_keys_file %s holds no key: every request needs one, so all are refused", path)

    @property
    def enabled(self) -> bool:
        return bool(self.path or self.from_env)

    def reload(self) -> None:
        """Read the file again; on an error keep the keys in force (a half-written file locks nobody out)."""
        try:
            keys = read_keys_file(self.path)
        except (OSError, ValueError) as exc:
            log.error("api_keys_file not reloaded, the previous keys stay in force: %s", exc)
            return
        self.from_file = keys
        log.info("api_keys_file %s reloaded: %d keys", self.path, len(keys))

    def allows(self, authorization: str | None, also: tuple[bytes, ...] = ()) -> bool:
        """Whether ``authorization`` is ``Bearer KEY`` with an accepted key (or one of ``also``)."""
        return self.caller(authorization, also) is not None

    def caller(self, authorization: str | None, also: tuple[bytes, ...] = ()) -> Caller | None:
        """Whom ``authorization`` (``Bearer KEY``) speaks for, or None if its key is not accepted. Every key is
        compared, with no early exit."""
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None
        given = token.strip().encode()
        found: Caller | None = None
        for key, caller in (*self.from_file, *self.from_env, *((k, ANONYMOUS) for k in also)):
            if hmac.compare_digest(given, key) and found is None:
                found = caller
        return found


class RequireApiKey:
    """falcon middleware: a request without an accepted key gets 401 in its route's error shape."""

    def __init__(self, keys: ApiKeys, auth_health: bool, probe_key: str = "") -> None:
        self.keys = keys
        self.open_paths = () if auth_health else HEALTH_PATHS
        self.probe_keys = (probe_key.encode(),) if probe_key else ()

    async def process_startup(self, scope: Any, event: Any) -> None:
        # In the worker's running loop (gunicorn's asgi worker runs the lifespan protocol): SIGHUP's
        # default action would end the worker, so it is taken over here.
        if self.keys.path:
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self.keys.reload)

    def refusal(self, path: str, authorization: str | None) -> str | None:
        """Why a request to ``path`` with this ``Authorization`` header is refused (a 401), or None."""
        if path in self.open_paths:
            return None
        also = self.probe_keys if path in HEALTH_PATHS else ()
        if self.keys.allows(authorization, also):
            return None
        return "invalid API key" if authorization is not None else MISSING_KEY

    def caller(self, authorization: str | None) -> Caller:
        """Whom an accepted request speaks for (ANONYMOUS for a key without tenant, or an open path)."""
        return self.keys.caller(authorization) or ANONYMOUS

    async def process_request(self, req: falcon.asgi.Request, resp: falcon.asgi.Response) -> None:
        authorization = req.get_header("Authorization")
        message = self.refusal(req.path, authorization)
        if message is None:
            req.context.caller = self.caller(authorization)
            return
        error_writer(req.path)(resp, 401, "invalid_api_key", message)
        resp.set_header("WWW-Authenticate", "Bearer")
        resp.complete = True  # falcon skips routing and the responder


def api_keys_from(path: str) -> ApiKeys:
    """The keys for a worker: ``path`` (may be "") and ``ZSERVE_API_KEYS``."""
    return ApiKeys(path, env_keys(os.environ.get(ENV_VAR)))
