"""Socket construction in one place, and the process-level helpers every zserve child uses."""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
from typing import Any

import zmq

_PR_SET_PDEATHSIG = 1
_TCP_PING_MS = 500

# The CURVE identity (a zserve.keys.CurveKeys) every socket of this process uses when it connects to a tcp
# endpoint; set once by a worker that joins a remote broker, so that each of its sockets (the runner's own
# result PUSH included) authenticates without being told.
_tcp_curve: Any = None


def use_curve_for_tcp(keys: Any) -> None:
    global _tcp_curve
    _tcp_curve = keys


def make_socket(
    ctx: zmq.Context,
    kind: int,
    endpoint: str,
    *,
    bind: bool,
    identity: bytes | None = None,
    hwm: int = 100_000,
    linger_ms: int = 0,
    mandatory: bool = False,
    curve: Any = None,
) -> zmq.Socket:
    """A socket with explicit options. ``mandatory`` (ROUTER): a send to a departed peer raises
    EHOSTUNREACH instead of vanishing, so the broker notices at once. ``curve`` (a zserve.keys.CurveKeys):
    authenticate a tcp connection with it (default: the process's, see ``use_curve_for_tcp``)."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, linger_ms)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    if kind == zmq.ROUTER:
        sock.setsockopt(zmq.ROUTER_MANDATORY, int(mandatory))
        # A restarted worker or client that reuses its identity takes over the old connection.
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    if endpoint.startswith("tcp://"):
        sock.setsockopt(zmq.IPV6, 1)
        # ZMTP pings: a connection whose link died without a FIN (a cable, a partition) is dropped and
        # redialled within seconds, rather than left to TCP's retransmission backoff of minutes.
        sock.setsockopt(zmq.HEARTBEAT_IVL, _TCP_PING_MS)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 4 * _TCP_PING_MS)
        curve = curve if curve is not None else _tcp_curve
        if curve is not None and not bind:
            sock.curve_publickey = curve.public
            sock.curve_secretkey = curve.secret
            sock.curve_serverkey = curve.server_public
    if bind:
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)
    return sock


def free_tcp_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


PARENT_PID_ENV = "ZSERVE_PARENT_PID"


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: ours) for a child that calls ``die_with_parent``: it names us as the parent, so the
    child can tell its parent died before it asked to be told, even when we are PID 1 (a container's init)."""
    out = dict(os.environ if env is None else env)
    out[PARENT_PID_ENV] = str(os.getpid())
    return out


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask Linux to send ``sig`` when our parent exits, so no child outlives its supervisor."""
    # Taken out of our environment, so that our own children do not read our parent's pid as theirs.
    expected = os.environ.pop(PARENT_PID_ENV, "")
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        return
    # The parent died before prctl took effect, and we were re-parented. Without the parent's pid, a parent
    # of 1 is taken for that; with it, a parent that is PID 1 itself (a container's init) is not.
    parent = os.getppid()
    if (parent != int(expected)) if expected.isdigit() else (parent == 1):
        os.kill(os.getpid(), sig)
