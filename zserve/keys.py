"""CURVE key pairs for tcp endpoints: ``zserve keys generate``, loading them, and the broker's ZAP handler.

Layout (what ``zmq.auth.create_certificates`` writes): ``NAME.key`` holds the public key only (hand it to
the other side), ``NAME.key_secret`` the pair (keep it on its host, mode 0600). The broker admits a remote
party only if that party's ``NAME.key`` is in its ``authorized_keys_dir``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import msgspec
import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from zserve.errors import BrokerUnavailable

ZAP_DOMAIN = "zserve"


class AuthenticationFailed(BrokerUnavailable):
    """The broker refused our CURVE key (not in its authorized keys) or we have the wrong broker key."""

    type_name = "authentication_failed"


class CurveKeys(msgspec.Struct, frozen=True):
    """A connecting party's CURVE identity: its own pair and the broker's public key (z85 bytes)."""

    public: bytes
    secret: bytes
    server_public: bytes

    @classmethod
    def load(cls, key_file: str | os.PathLike[str], broker_key_file: str | os.PathLike[str]) -> CurveKeys:
        """``key_file``: our ``NAME.key_secret``; ``broker_key_file``: the broker's ``NAME.key``."""
        public, secret = _load(key_file, need_secret=True)
        server_public, _ = _load(broker_key_file, need_secret=False)
        return cls(public, secret, server_public)


def _load(path: str | os.PathLike[str], *, need_secret: bool) -> tuple[bytes, bytes]:
    try:
        public, secret = zmq.auth.load_certificate(os.fspath(path))
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read CURVE key {path}: {exc}") from None
    if need_secret and not secret:
        raise ValueError(f"{path} holds no secret key (use the NAME.key_secret file)")
    return public, secret or b""


def generate(directory: str | os.PathLike[str], name: str) -> tuple[Path, Path]:
    """Write ``DIR/NAME.key`` and ``DIR/NAME.key_secret`` (0600); refuses to overwrite an existing pair."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    public, secret = directory / f"{name}.key", directory / f"{name}.key_secret"
    if public.exists() or secret.exists():
        raise FileExistsError(f"{public} or {secret} exists already: not overwritten")
    old = os.umask(0o077)
    try:
        written = zmq.auth.create_certificates(str(directory), name)
    finally:
        os.umask(old)
    return Path(written[0]), Path(written[1])


def apply_server(sock: zmq.Socket, key_file: str) -> None:
    """Before bind: the next endpoints bound on ``sock`` are CURVE servers (ZAP checks each client)."""
    public, secret = _load(key_file, need_secret=True)
    sock.curve_publickey = public
    sock.curve_secretkey = secret
    sock.curve_server = True
    sock.zap_domain = ZAP_DOMAIN.encode()


class _RefusalLog(logging.LoggerAdapter):
    """pyzmq's authenticator logs refusals at DEBUG; a refused party is an event worth a WARNING line."""

    def debug(self, msg: Any, *args: Any, **kwargs: Any) -> None:
        text = str(msg) % args if args else str(msg)
        if text.startswith("DENIED"):
            self.logger.warning("refused a connection: %s", text)


def start_authenticator(ctx: zmq.Context, authorized_keys_dir: str) -> ThreadAuthenticator:
    """The ZAP handler: admits CURVE clients whose public key is in ``authorized_keys_dir``; plain
    (NULL) connections, which only the ipc endpoints accept, pass."""
    if not Path(authorized_keys_dir).is_dir():
        raise ValueError(f"authorized_keys_dir {authorized_keys_dir} is not a directory")
    auth = ThreadAuthenticator(ctx, log=_RefusalLog(logging.getLogger("zserve.auth"), {}))
    auth.start()
    auth.configure_curve(domain=ZAP_DOMAIN, location=authorized_keys_dir)  # pyzmq's "*" is no wildcard
    return auth


def check_broker_keys(curve_key: str, authorized_keys_dir: str) -> None:
    """At start, not in the broker child: a missing key file is a config error, not a crash loop."""
    from zserve.config import ConfigError

    try:
        _load(curve_key, need_secret=True)
    except ValueError as exc:
        raise ConfigError(f"broker.curve_key: {exc}") from None
    if not Path(authorized_keys_dir).is_dir():
        raise ConfigError(f"broker.authorized_keys_dir: {authorized_keys_dir} is not a directory")
