"""The worker's link to the broker against a scripted broker (a ROUTER and a PULL over ipc): what it says and
when, for the exchanges that decide whether work is lost (issue 27): a Reset that arrives while its Hello is
outstanding draws no second Hello; SIGTERM's leave says Leave, hands a crossing Batch back unstarted, keeps
heartbeating and the `registered` file gone, and ends on the broker's Shutdown."""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path

import zmq

from zserve.protocol import Batch, Codec, Heartbeat, Hello, Leave, Reset, Shutdown
from zserve.workers.runtime import WorkerLink


class ScriptedBroker:
    def __init__(self, run_dir: Path) -> None:
        self.ctx = zmq.Context()
        self.codec = Codec()
        self.work_endpoint, self.out_endpoint = f"ipc://{run_dir}/work.sock", f"ipc://{run_dir}/out.sock"
        self.work = self.ctx.socket(zmq.ROUTER)
        self.work.bind(self.work_endpoint)
        self.out = self.ctx.socket(zmq.PULL)
        self.out.bind(self.out_endpoint)
        self.identity = b""

    def recv(self, timeout_s: float = 5.0):
        """The next message from the worker on the work socket, or None."""
        if not self.work.poll(int(timeout_s * 1000)):
            return None
        identity, header, *_ = self.work.recv_multipart()
        self.identity = identity
        return self.codec.decode(header)

    def send(self, msg, *frames: bytes) -> None:
        self.work.send_multipart([self.identity, self.codec.encode(msg), *frames])

    def heartbeats(self, timeout_s: float) -> int:
        count, deadline = 0, time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if self.out.poll(int(left * 1000)) and isinstance(self.codec.decode(self.out.recv()), Heartbeat):
                count += 1
        return count

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def test_a_reset_while_registering_draws_no_second_hello_and_a_leave_ends_on_shutdown(monkeypatch):
    run_dir = Path(tempfile.mkdtemp(prefix="zl-"))
    state = run_dir / "state"
    monkeypatch.setenv("ZSERVE_WORKER_STATE_DIR", str(state))
    broker = ScriptedBroker(run_dir)
    link = WorkerLink(name="engine-x", role="engine", models=["x"], credits=2, work_endpoint=broker.work_endpoint,
                      out_endpoint=broker.out_endpoint, heartbeat_interval_ms=50, heartbeat_liveness=20)  # fmt: skip
    handled: list[int] = []
    serving = threading.Thread(target=link.serve, args=(lambda batch, frames: handled.append(batch.batch_id),))
    serving.start()
    try:
        assert isinstance(broker.recv(), Hello)
        for _ in range(3):  # stale heartbeats of a dead broker's era, each answered by its successor with a Reset
            broker.send(Reset("unknown worker"))
        broker.send(Heartbeat("broker"))  # the welcome of the Hello
        assert broker.recv(timeout_s=0.5) is None  # no second Hello
        assert link.registered.wait(2) and (state / "registered").exists() and (state / "alive").exists()

        broker.send(Reset("unknown worker"))  # registered, then forgotten: Hello again, as always
        assert isinstance(broker.recv(), Hello)
        broker.send(Heartbeat("broker"))
        assert link.registered.wait(2)
        broker.send(Batch(7, "x", [1], [0], [False]))
        time.sleep(0.2)
        assert handled == [7]

        link.leaving.set()  # what SIGTERM does
        assert broker.recv() == Leave(link.worker_id, [])
        assert not (state / "registered").exists()  # not ready any more (a pod leaves its Service)
        broker.send(Batch(8, "x", [2], [0], [False]))  # crossed the Leave: back, unstarted
        assert broker.recv() == Leave(link.worker_id, [8]) and handled == [7]
        assert broker.heartbeats(0.3) >= 2  # still alive while it finishes what it holds
        broker.send(Shutdown("left: you hold nothing"))
        serving.join(timeout=5)
        assert not serving.is_alive()
    finally:
        link.stop.set()
        serving.join(timeout=5)
        broker.close()
