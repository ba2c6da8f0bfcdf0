"""The broker process shell: sockets, the poll loop, signals. The request lifecycle, batching included,
is the pure ``BrokerCore`` (``core.py``); this shell only receives, decodes, hands messages to the core,
and sends what ``flush`` returns, telling the core about peers it could not reach.

Sockets (the broker binds, everyone else connects):
  client ROUTER  <- Submits / Cancel / HealthQuery from frontends and direct clients;
                 -> Chunks / Replies (coalesced per client) / HealthReport
  work   ROUTER  <- Hello from workers; -> Batch / Heartbeat / Reset / Shutdown / Abort, addressed by identity
  out    PULL    <- BatchResult and Heartbeat from every worker (fan-in); StepOutput from generative engines

``python -m zserve.broker.broker --config-json '{...}' --client ... --work ... --out ...``
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from zserve.broker.core import BrokerCore
from zserve.config import Config, Endpoints
from zserve.frames import pack, received
from zserve.keys import apply_server, start_authenticator
from zserve.logs import setup_logging
from zserve.protocol import Codec
from zserve.transport import die_with_parent, make_socket

log = logging.getLogger("zserve.broker")

_NOBLOCK = int(zmq.NOBLOCK)  # a plain int: combining zmq's Flag enums costs more than the send
# What one socket may take of a loop turn: this many messages, or this much handling time (a Submits of 1024
# items refused takes ~15 ms), whichever comes first. The rest waits for the next turn, after the other sockets, the
# liveness check and the sends: a burst of 100k requests is admitted over many short turns, never in one long one.
_DRAIN_LIMIT = 512
_DRAIN_BUDGET_S = 0.02
_SLOW_TURN_LOG_S = 5.0  # at most one "slow loop turn" line per this many seconds


class Broker:
    def __init__(
        self,
        config: Config,
        endpoints: Endpoints,
        staged: frozenset[str] = frozenset(),
        generative: frozenset[str] = frozenset(),
    ) -> None:
        self.core = BrokerCore(
            config,
            epoch=random.getrandbits(48),
            # a restarted broker must not reuse ids an old engine may still report on
            first_batch_id=random.getrandbits(40) << 8,
            staged=staged,
            generative=generative,
        )
        self.codec = Codec()
        self.stopping = False
        # ZSERVE_BROKER_STOP=handover (`zserve k8s` sets it): SIGTERM means this broker is being replaced
        # behind the same address, not that the deployment stops (BrokerCore.start_draining)
        self.handover = os.environ.get("ZSERVE_BROKER_STOP", "drain") == "handover"
        self.ctx = zmq.Context()
        self.client = make_socket(self.ctx, zmq.ROUTER, endpoints.client, bind=True, mandatory=True)
        self.work = make_socket(self.ctx, zmq.ROUTER, endpoints.work, bind=True, mandatory=True)
        self.out = make_socket(self.ctx, zmq.PULL, endpoints.out, bind=True)
        self.auth = self._bind_remote(config)
        self.poller = zmq.Poller()
        for sock in (self.client, self.work, self.out):
            self.poller.register(sock, zmq.POLLIN)

    def _bind_remote(self, config: Config) -> Any:
        """Bind [broker]'s tcp endpoints beside the ipc ones. libzmq copies a socket's options when it binds,
        so the ipc endpoints (bound above, in the 0700 run dir) stay plain while the tcp ones are CURVE
        servers whose clients the ZAP handler checks against the authorized keys."""
        b = config.broker
        pairs = [(s, e) for s, e in zip((self.client, self.work, self.out), b.remote_endpoints(), strict=True) if e]
        if not pairs:
            return None
        auth = None
        if not b.insecure:
            auth = start_authenticator(self.ctx, b.authorized_keys_dir)
        for sock, endpoint in pairs:
            if not b.insecure:
                apply_server(sock, b.curve_key)
            sock.bind(endpoint)
            log.info("listening on %s (%s)", endpoint, "plain, insecure" if b.insecure else "CURVE")
        return auth

    # ---- receiving ----

    def on_client(self, frames: list[zmq.Frame], now: float) -> None:
        identity = frames[0].bytes
        msg = self.codec.decode(frames[1].buffer, f"client {identity!r}") if len(frames) > 1 else None
        if msg is not None:
            self.core.on_client(identity, msg, received(frames[2:], f"client {identity!r}"), now)

    def on_work(self, frames: list[zmq.Frame], now: float) -> None:
        identity = frames[0].bytes
        msg = self.codec.decode(frames[1].buffer, f"worker {identity!r}") if len(frames) > 1 else None
        if msg is not None:
            self.core.on_work(identity, msg, now)

    def on_out(self, frames: list[zmq.Frame], now: float) -> None:
        msg = self.codec.decode(frames[0].buffer, "a worker (out socket)")
        if msg is not None:
            self.core.on_out(msg, received(frames[1:], "a worker (out socket)"), now)

    def _drain(self, sock: zmq.Socket, handle: Callable[[list[zmq.Frame], float], None]) -> int:
        """Handle what ``sock`` holds, within this turn's share; the number of messages handled, or -1 when the
        socket was found empty (everything sent to it before the call was handled)."""
        started = time.monotonic()
        for count in range(_DRAIN_LIMIT):
            try:
                frames = sock.recv_multipart(_NOBLOCK, copy=False)
            except zmq.Again:
                return -1
            handle(frames, time.monotonic())
            if time.monotonic() - started > _DRAIN_BUDGET_S:
                return count + 1
        return _DRAIN_LIMIT

    # ---- sending ----

    def _send(self, sock: zmq.Socket, identity: bytes, header: Any, frames: list[Any]) -> bool:
        try:
            sock.send_multipart([identity, self.codec.encode(header), *pack(frames)], _NOBLOCK, copy=False)
            return True
        except zmq.ZMQError as exc:  # EHOSTUNREACH: the peer is gone; EAGAIN: it stopped reading
            log.info("cannot send to %r: %s", identity, exc.strerror)
            return False

    def send_output(self) -> None:
        """Send what the core has; a peer we cannot reach is reported back, which may make more to send."""
        for _ in range(8):  # each round only follows up on failed sends, so this ends quickly
            clients, work = self.core.flush()
            if not clients and not work:
                return
            unreachable: dict[bytes, set[int]] = {}
            for send in work:
                lost = unreachable.get(send.worker_id)
                if lost is not None:  # failed earlier in this round: nothing more goes to it
                    if send.batch_id:
                        lost.add(send.batch_id)
                elif not self._send(self.work, send.worker_id, send.header, send.frames):
                    unreachable[send.worker_id] = {send.batch_id} if send.batch_id else set()
            for worker_id, undelivered in unreachable.items():
                self.core.worker_unreachable(worker_id, undelivered)
            gone = {c.identity for c in clients if not self._send(self.client, c.identity, c.header, c.frames)}
            for identity in gone:
                self.core.client_unreachable(identity)

    # ---- the loop ----

    def run(self) -> None:
        core = self.core
        log.info("broker ready (epoch %x), models: %s", core.epoch, ", ".join(core.timeouts_s))
        heard_s = time.monotonic()  # when the out socket was last found empty: see BrokerCore.tick
        slow = LoopLag(core.interval_s)
        while True:
            now = time.monotonic()
            if self.stopping:
                core.start_draining(now, handover=self.handover)
            if core.drained(now):
                break
            timeout_ms = max(0, int(core.next_wakeup_s(now) * 1000.0 + 0.999))  # round up: early only spins
            events = dict(self.poller.poll(timeout_ms))
            turn_s = time.monotonic()
            handled = [0, 0, 0]
            if self.work in events:
                handled[1] = self._drain(self.work, self.on_work)
            if self.client in events:
                handled[2] = self._drain(self.client, self.on_client)
            # The out socket last, right before the liveness check: heartbeats that came while this turn handled
            # clients are read before anyone is judged lost, and a turn that could not empty it judges by the
            # last time it did (a slow broker must not take its own lag for its workers' silence).
            before = time.monotonic()
            handled[0] = self._drain(self.out, self.on_out)
            if handled[0] < 0:
                heard_s = before
            core.tick(time.monotonic(), heard_s)
            self.send_output()
            for pid, name in core.take_kills():
                self.kill_hung(pid, name)
            slow.turn(turn_s, time.monotonic(), handled)
        self.shutdown()

    def kill_hung(self, pid: int, name: str) -> None:
        """SIGKILL a hung worker of this host; its supervisor (zserve up, supervisord) starts a new one. The
        pid is checked against the worker's name first: a pid that was reused, or that of another host's worker,
        belongs to someone else."""
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            argv = []
        if name.rsplit(":", 1)[0].encode() not in argv:
            log.warning("hung worker %s (pid %d) is not a process of this host: it was told to exit (Replace), its "
                        "host's supervisor restarts it", name, pid)  # fmt: skip
            return
        log.warning("killing hung worker %s (pid %d)", name, pid)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def shutdown(self) -> None:
        self.core.shut_down()
        self.send_output()
        for sock in (self.client, self.work, self.out):
            sock.close(linger=500)
        if self.auth is not None:
            self.auth.stop()
        self.ctx.term()
        log.info("broker stopped")


class LoopLag:
    """The broker's own lag: a loop turn longer than a heartbeat interval is logged (at most once per
    ``_SLOW_TURN_LOG_S``, with the slowest turn since the last line), since it delays every answer and every
    heartbeat the broker sends."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.slowest_s = 0.0
        self.slow_turns = 0
        self.logged_s = float("-inf")
        self.handled: list[int] = []

    def turn(self, started_s: float, ended_s: float, handled: list[int]) -> None:
        took_s = ended_s - started_s
        if took_s <= self.interval_s:
            return
        self.slow_turns += 1
        if took_s > self.slowest_s:
            self.slowest_s, self.handled = took_s, handled
        if ended_s - self.logged_s >= _SLOW_TURN_LOG_S:
            out, work, client = (max(0, n) for n in self.handled)
            log.warning("broker loop turn took %.3fs (%d turns over the %.3fs heartbeat interval; messages out %d, "
                        "work %d, client %d)", self.slowest_s, self.slow_turns, self.interval_s, out, work,
                        client)  # fmt: skip
            self.logged_s, self.slowest_s, self.slow_turns = ended_s, 0.0, 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zserve.broker.broker", description=__doc__)
    parser.add_argument("--config-json", required=True, help="the whole supervisor.toml, as JSON")
    parser.add_argument("--client", required=True, help="client endpoint to bind")
    parser.add_argument("--work", required=True, help="work endpoint to bind")
    parser.add_argument("--out", required=True, help="out (results) endpoint to bind")
    parser.add_argument("--staged-models", default="", help="comma-separated models with a preprocess stage")
    parser.add_argument("--generative-models", default="", help="comma-separated generative models")
    args = parser.parse_args(argv)
    setup_logging("broker")
    die_with_parent()
    config = msgspec.json.decode(args.config_json, type=Config)
    staged = frozenset(filter(None, args.staged_models.split(",")))
    generative = frozenset(filter(None, args.generative_models.split(",")))
    broker = Broker(config, Endpoints(args.client, args.work, args.out), staged, generative)

    def on_term(signum: int, _frame: Any) -> None:
        broker.stopping = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    broker.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
