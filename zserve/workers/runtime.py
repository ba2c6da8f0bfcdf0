"""The worker shell shared by every worker role (engines, preprocess stages): registration with
the broker, heartbeats both ways, re-registration after a broker restart, and clean exit on SIGTERM or
Shutdown.

SIGTERM (a scale-down, a rollout, `zserve up` stopping) is a leave, never a loss: the worker says Leave,
takes no new work (a Batch that crossed its Leave goes back with another Leave, unstarted), finishes what it
holds, and exits when the broker, seeing it hold nothing, answers Shutdown, or when the broker is silent for
the liveness period (then whatever it held is the old broker's, which clients resubmit to the new one).

``ZSERVE_WORKER_STATE_DIR`` (set by `zserve k8s`'s pods): the link keeps the file ``registered`` there while
the broker knows it (a readiness probe) and touches ``alive`` at least every heartbeat interval while its
thread turns (a liveness probe).

Sockets and threads (one owner per socket):
  * the compute thread owns the DEALER (Hello out; Batch, Heartbeat, Reset, Shutdown in) and a PUSH for
    results, so a batch goes socket -> compute -> socket with no thread hop;
  * a heartbeat thread owns its own PUSH and keeps saying "alive" while a long batch runs.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from zserve.batching.fair_share import DEFAULT_AGING_S
from zserve.config import ModelConfig
from zserve.errors import EXIT_CANNOT_LOAD, ModelLoadError
from zserve.frames import pack, received
from zserve.keys import CurveKeys
from zserve.logs import setup_logging
from zserve.model import Model, load_handler
from zserve.protocol import Abort, Batch, BatchResult, Codec, Heartbeat, Hello, Leave, Replace, Reset, Shutdown
from zserve.transport import die_with_parent, make_socket, use_curve_for_tcp
from zserve.versions import library_versions

log = logging.getLogger("zserve.worker")

EXIT_REPLACED = 3  # the broker found this worker hung and asked it to exit (Replace)

# A handler answers a Batch with its result, or with None when the answer goes out later on a socket of its
# own (the generative engine streams one StepOutput per step).
BatchHandler = Callable[[Batch, list[Any]], tuple[BatchResult, list[Any]] | None]


class WorkerLink:
    """A worker's connection to the broker. ``serve(handle)`` runs until SIGTERM or Shutdown."""

    def __init__(
        self,
        *,
        name: str,
        role: str,
        models: list[str],
        credits: int,
        work_endpoint: str,
        out_endpoint: str,
        heartbeat_interval_ms: int,
        heartbeat_liveness: int,
    ) -> None:
        self.name = name
        self.worker_id = f"{name}:{os.getpid()}"
        self.role = role
        self.models = models
        self.credits = credits
        self.kv_blocks = 0  # a generative engine's KV pool, declared in its Hello
        self.preprocesses = False  # an engine that preprocesses a staged model's batches itself when idle (Hello)
        self.free_kv_blocks = -1  # and what is free now, in every heartbeat (-1: not generative)
        # a generative engine's prefix cache as its Hello declares it (block hashes), for the broker's router
        self.cache_snapshot: Callable[[], list[int]] | None = None
        self.work_endpoint = work_endpoint
        self.out_endpoint = out_endpoint
        self.interval_s = heartbeat_interval_ms / 1000.0
        self.liveness_s = self.interval_s * heartbeat_liveness
        self.stop = threading.Event()
        self.failed = False  # a thread of the runner died: the process exits 1 and its supervisor restarts it
        self.busy = False
        self.threads = 1  # torch intra-op threads of the runner's compute thread (run_worker sets it)
        self.priority_aging_s = DEFAULT_AGING_S  # the broker's [broker] priority_aging_ms (run_worker sets it)
        self.registered = threading.Event()
        self.leaving = threading.Event()  # SIGTERM: leave (see the module's docstring)
        self.state_dir = os.environ.get("ZSERVE_WORKER_STATE_DIR", "")
        self._alive_at = 0.0
        if self.state_dir:
            os.makedirs(self.state_dir, mode=0o700, exist_ok=True)
            self._set_registered(False)
        self.ctx = zmq.Context()
        self.codec = Codec()
        self.dealer: zmq.Socket | None = None
        self.monitor: zmq.Socket | None = None
        self.push = make_socket(self.ctx, zmq.PUSH, out_endpoint, bind=False, linger_ms=2000)

    def guarded(self, loop: Callable[[], None]) -> Callable[[], None]:
        """``loop`` as a thread target that takes the process with it when it dies: a worker that stays
        registered but serves nothing would hold its batches until their deadlines."""

        def run() -> None:
            try:
                loop()
            except BaseException:
                log.critical(
                    "%s thread died; stopping %s", threading.current_thread().name, self.worker_id, exc_info=True
                )
                self.failed = True
                self.stop.set()

        return run

    def install_signal_handlers(self) -> None:
        def on_term(signum: int, _frame: Any) -> None:
            log.info("%s received signal %d: leaving (no new work, finishing what it holds)", self.name, signum)
            self.leaving.set()

        signal.signal(signal.SIGTERM, on_term)
        signal.signal(signal.SIGINT, on_term)

    def _connect(self) -> None:
        if self.dealer is not None:
            self.dealer.disable_monitor()
            self.dealer.close(linger=0)  # drops Hellos queued for a broker that is gone
        self.dealer = make_socket(
            self.ctx, zmq.DEALER, self.work_endpoint, bind=False, identity=self.worker_id.encode()
        )
        if self.work_endpoint.startswith("tcp://"):
            # Over CURVE a refused key looks like silence; the monitor tells the two apart.
            failed = zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            self.monitor = self.dealer.get_monitor_socket(failed)

    def _refused(self) -> bool:
        """Whether the broker refused this worker's CURVE key since the last connect."""
        refused = False
        while self.monitor is not None and self.monitor.poll(0):
            self.monitor.recv_multipart()
            refused = True
        return refused

    def _set_registered(self, registered: bool) -> None:
        if registered:
            self.registered.set()
        else:
            self.registered.clear()
        self._publish_registered(registered)

    def _publish_registered(self, registered: bool) -> None:
        if self.state_dir:
            path = os.path.join(self.state_dir, "registered")
            if registered:
                open(path, "w").close()
            elif os.path.exists(path):
                os.unlink(path)

    def _touch_alive(self) -> None:
        now = time.monotonic()
        if self.state_dir and now - self._alive_at >= self.interval_s:
            self._alive_at = now
            path = os.path.join(self.state_dir, "alive")
            with open(path, "a"):
                os.utime(path)

    def _send(self, what: str, frame: bytes) -> None:
        """To the broker, never blocking: a DEALER's send blocks while no broker is connected (one that refused
        this host's CURVE key, or is gone), and this thread must go on, to see SIGTERM and the broker's silence.
        Unsent, a Hello is sent again when the silence is noticed, and a Leave is what that silence then ends."""
        try:
            self.dealer.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            log.warning("%s: no broker connected to take its %s", self.worker_id, what)

    def _leave(self, batch_ids: list[int]) -> None:
        self._send("Leave", self.codec.encode(Leave(self.worker_id, batch_ids)))

    def _hello(self) -> None:
        self._set_registered(False)
        hello = Hello(self.worker_id, os.getpid(), self.role, self.models, self.credits, kv_blocks=self.kv_blocks,
                      preprocesses=self.preprocesses, versions=library_versions(),
                      block_hashes=self.cache_snapshot() if self.cache_snapshot is not None else [])  # fmt: skip
        self._send("Hello", self.codec.encode(hello))

    def _heartbeats(self) -> None:
        codec = Codec()
        push = make_socket(self.ctx, zmq.PUSH, self.out_endpoint, bind=False, hwm=16)
        try:
            while not self.stop.wait(self.interval_s):
                if self.registered.is_set():
                    try:
                        push.send(codec.encode(Heartbeat(self.worker_id, self.busy, self.free_kv_blocks)), zmq.NOBLOCK)
                    except zmq.Again:
                        pass  # broker unreachable; the compute thread notices its silence
        finally:
            push.close(linger=0)

    def serve(
        self,
        handle: BatchHandler,
        on_abort: Callable[[list[int]], None] | None = None,
        on_reset: Callable[[], None] | None = None,
    ) -> None:
        """Run until SIGTERM or Shutdown. ``on_abort(batch_ids)``: the broker cancelled work in progress;
        ``on_reset()``: the broker forgot this worker (restart, expiry), so whatever it holds is orphaned."""
        self._connect()
        self._hello()
        log.info("%s registering with the broker (%d credits)", self.worker_id, self.credits)
        beater = threading.Thread(target=self._heartbeats, name="heartbeat", daemon=True)
        beater.start()
        last_broker_s = time.monotonic()
        left = False  # Leave sent
        try:
            while not self.stop.is_set():
                self._touch_alive()
                if self.leaving.is_set() and not left:
                    left = True
                    self._publish_registered(False)  # not ready; still registered (heartbeats go on)
                    self._leave([])
                    log.info("%s: told the broker it is leaving; finishing what it holds", self.worker_id)
                if not self.dealer.poll(int(self.interval_s * 1000)):
                    if time.monotonic() - last_broker_s > self.liveness_s:
                        if left:
                            log.warning("%s: broker silent while leaving: exiting", self.worker_id)
                            break
                        if self._refused():
                            log.error(
                                "%s: the broker at %s refused this host's CURVE key (not in its authorized_keys_dir, "
                                "or the broker key is wrong); retrying", self.worker_id, self.work_endpoint,
                            )  # fmt: skip
                        else:
                            log.warning(
                                "%s: broker silent for %.1fs; registering again", self.worker_id, self.liveness_s
                            )
                        if on_reset is not None:
                            on_reset()
                        self._connect()
                        self._hello()
                        last_broker_s = time.monotonic()
                    continue
                frames = self.dealer.recv_multipart(copy=False)
                last_broker_s = time.monotonic()
                msg = self.codec.decode(frames[0].buffer, "broker")
                if isinstance(msg, Batch) and left:
                    self._leave([msg.batch_id])  # crossed our Leave: back to the broker, unstarted
                elif isinstance(msg, Batch):
                    self.busy = True
                    try:
                        answer = handle(msg, received(frames[1:], "the broker"))
                    finally:
                        self.busy = False
                    if answer is not None:
                        result, out = answer
                        self.push.send_multipart([self.codec.encode(result), *pack(out)], copy=False)
                elif isinstance(msg, Abort):
                    if on_abort is not None:
                        on_abort(msg.batch_ids)
                elif isinstance(msg, Heartbeat):
                    if not self.registered.is_set() and not left:
                        self._set_registered(True)
                        log.info("%s registered", self.worker_id)
                elif isinstance(msg, Reset) and left:
                    log.info("%s: the broker forgot this leaving worker (%s): exiting", self.worker_id, msg.reason)
                    break
                elif isinstance(msg, Reset) and not self.registered.is_set():
                    # Our Hello is on its way (its welcome comes next, or silence makes us say it again). The Reset
                    # answers heartbeats queued for a broker that died and delivered to its successor: each Hello
                    # more would make the broker take back, with an attempt counted, what it just gave us.
                    log.debug("%s: Reset while registering (%s): ignored", self.worker_id, msg.reason)
                elif isinstance(msg, Reset):
                    log.info("%s: broker asked to register again (%s)", self.worker_id, msg.reason)
                    if on_reset is not None:
                        on_reset()
                    self._hello()
                elif isinstance(msg, Shutdown):
                    log.info("%s: broker asked to shut down (%s)", self.worker_id, msg.reason)
                    break
                elif isinstance(msg, Replace):
                    # the thread that hangs cannot be stopped from here, and the process must not linger
                    log.error("%s: the broker found this worker hung (%s): exiting to be restarted",
                              self.worker_id, msg.reason)  # fmt: skip
                    logging.shutdown()
                    os._exit(EXIT_REPLACED)
        finally:
            self.stop.set()
            self._set_registered(False)
            beater.join(timeout=2 * self.interval_s + 1)
            if self.monitor is not None:
                self.dealer.disable_monitor()
                self.monitor.close(linger=0)
            self.dealer.close(linger=0)
            self.push.close(linger=2000)
            self.ctx.term()


_THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def _set_threads(threads: int) -> None:
    # Before torch is imported (by the handler's setup), so its thread pools start at this size.
    for var in _THREAD_VARS:
        os.environ.setdefault(var, str(threads))


def _keep_main_serial() -> None:
    """libgomp gives every thread that starts parallel regions a team of its own, and once more threads
    are in teams than there are cores it stops spinning between regions: every region then wakes its
    workers from sleep. Measured on 2 cores with 2 torch threads: a 200k-element ``exp`` takes 31 us on the
    only team and 105 us on a second one, and an engine step 1.3x as long. An engine computes on its own
    thread, so every other thread (main: load, warm-up, sockets) runs OpenMP serially and never starts a
    team: the environment says 1 before torch is imported, and the compute thread sets its own count."""
    for var in _THREAD_VARS:
        os.environ[var] = "1"
    _torch_threads(1)  # torch imported already (by a handler module's import): set it there too


def _torch_threads(threads: int) -> None:
    """torch's intra-op threads for the calling thread; nothing to set where no handler imported torch."""
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(threads)


def enter_compute_thread(threads: int) -> None:
    """First call on a runner's compute thread: torch's intra-op threads are this thread's (see above)."""
    _torch_threads(threads)


def run_worker(
    role: str,
    description: str | None,
    start: Callable[[Model, str], None],
    make_runner: Callable[[Model, WorkerLink], Any],
    argv: list[str] | None = None,
    *,
    computes_on_thread: bool = False,
) -> int:
    """The main of every worker process: parse the supervisor's arguments, load the handler, ``start`` it
    (setup + warm-up for engines, setup_preprocess for stages), register, and serve batches with
    the runner ``make_runner(model, link)`` returns (its ``run``, and its ``abort``/``reset`` if it has them)
    until SIGTERM or Shutdown; a runner may set the link's credits before it registers.
    ``computes_on_thread``: the runner computes on a thread of its own, which calls
    ``enter_compute_thread(link.threads)`` first; the main thread keeps torch serial."""
    parser = argparse.ArgumentParser(prog=f"python -m zserve.workers.{role}", description=description)
    parser.add_argument("--name", required=True, help="process name, e.g. engine-echo-0")
    parser.add_argument("--model-json", required=True, help="the model's [[models]] table as JSON")
    parser.add_argument("--work-endpoint", required=True)
    parser.add_argument("--out-endpoint", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--credits", type=int, default=None, help="default: the model's credits")
    parser.add_argument("--heartbeat-interval-ms", type=int, default=250)
    parser.add_argument("--heartbeat-liveness", type=int, default=4)
    parser.add_argument(
        "--priority-aging-ms", type=float, default=DEFAULT_AGING_S * 1000.0,
        help="[broker] priority_aging_ms: a generative engine orders its queued sequences as the broker does",
    )  # fmt: skip
    parser.add_argument("--curve-key", default="", help="this host's NAME.key_secret, for tcp endpoints")
    parser.add_argument("--broker-key", default="", help="the broker's public NAME.key, for tcp endpoints")
    args = parser.parse_args(argv)

    setup_logging(args.name)
    die_with_parent()
    try:
        config = msgspec.json.decode(args.model_json, type=ModelConfig)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        log.error("bad --model-json: %s", exc)
        return 2
    if computes_on_thread:
        _keep_main_serial()
    else:
        _set_threads(config.threads)
    if args.curve_key:
        use_curve_for_tcp(CurveKeys.load(args.curve_key, args.broker_key))
    link = WorkerLink(
        name=args.name,
        role=role,
        models=[config.name],
        credits=args.credits or config.credits,
        work_endpoint=args.work_endpoint,
        out_endpoint=args.out_endpoint,
        heartbeat_interval_ms=args.heartbeat_interval_ms,
        heartbeat_liveness=args.heartbeat_liveness,
    )
    if not 0 < args.priority_aging_ms <= 86_400_000:  # as [broker]'s; NaN and inf fail too
        log.error("--priority-aging-ms must be > 0 and at most a day (86400000), not %r", args.priority_aging_ms)
        return 2
    link.priority_aging_s = args.priority_aging_ms / 1000.0
    link.install_signal_handlers()
    started = time.monotonic()
    log.info("loading %s %s (%s) on %s, %d thread(s)", role, config.name, config.handler, args.device, config.threads)
    log.info("%s runs on %s", args.name, library_versions())  # for bug reports; `zserve status` shows it too
    model = load_handler(config.handler, config.options)
    try:
        start(model, args.device)
    except ModelLoadError as exc:
        log.error("%s cannot load model %s: %s", args.name, config.name, exc)
        return EXIT_CANNOT_LOAD
    link.threads = config.threads
    if not computes_on_thread:
        _torch_threads(config.threads)  # the runner computes on this thread
    log.info("%s %s ready after %.1fs", role, config.name, time.monotonic() - started)
    if not link.stop.is_set() and not link.leaving.is_set():  # SIGTERM while loading: nothing to leave
        runner = make_runner(model, link)
        link.serve(runner.run, getattr(runner, "abort", None), getattr(runner, "reset", None))
        close = getattr(runner, "close", None)
        if close is not None:
            close()
        if link.failed:
            log.error("%s exiting after a failure", args.name)
            return 1
    log.info("%s exiting", args.name)
    return 0
