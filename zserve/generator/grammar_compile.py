"""Grammar compiles off the engine's admission path, within a budget (issue 40).

A JSON schema's compile can take minutes and gigabytes (a tool of 5,000 optional properties: 11 minutes
of one core, and over 20 GB to serialise, on SmolLM2's 49k vocabulary), so it never runs on a thread that
admits requests, and never without a bound:

* one child process compiles, one schema at a time (``python -m zserve.generator.grammar_compile``, started
  with the service at engine start: it imports xgrammar and builds the tokenizer's info there). Its address
  space is capped at what it used after start plus ``memory_bytes``; a compile past ``time_s`` or past
  that cap (xgrammar's allocation fails, or the child dies) is a ``BadRequest`` naming the request's
  field, the child is killed and another started. A request cancelled while its schema compiles (and no
  other request waits for the same schema) kills the compile too: no work runs on for nobody.
* the compiled grammar comes back serialised (xgrammar's ``serialize_json``; no pickle) and is deserialised
  on the service's thread; xgrammar's compile and (de)serialisation release the interpreter lock, so no
  heartbeat or step waits for them (a thread ticking every 10 ms saw at most 56 ms between ticks during the
  11-minute compile).
* compiled grammars are cached by schema text, least recently used first out, bounded by count and by
  their bytes (``CompiledGrammar.memory_size_bytes``); at most ``max_waiting`` distinct schemas wait to
  compile (a request waiting holds its engine credit), past it a new one is Overloaded (503, retry later).

The caller's thread only looks the cache up and queues; the answer comes through ``on_done`` on the
service's thread (the runner then adds the sequence to the engine core: until then it waits outside the
scheduler's queues and takes no KV blocks).
"""

from __future__ import annotations

import logging
import os
import queue
import re
import resource
import socket
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from zserve.errors import BadRequest, Overloaded, ZserveError

log = logging.getLogger("zserve.generator.grammar_compile")

_ANY_OBJECT = '{"type": "object", "additionalProperties": true}'  # json_object: any object, any keys
_POLL_S = 0.05  # how often a waiting compile checks its deadline and its requests


@dataclass(frozen=True, slots=True)
class CompileBudget:
    """What one schema may cost (CausalLM's options ``grammar_compile_s``, ``grammar_memory_mb``,
    ``grammar_cache_mb``) and what the cache keeps."""

    time_s: float = 10.0
    memory_bytes: int = 1 << 30
    cache_entries: int = 256
    cache_bytes: int = 256 << 20
    # distinct schemas waiting to compile (each holds its requests' engine credits while it waits): past it a
    # new one is refused with Overloaded (503, retry later), so costly schemas cannot take every credit
    max_waiting: int = 8


OnDone = Callable[[Any, ZserveError | None], None]  # (compiled grammar or None, the refusal or None)


class Ticket:
    """One request waiting for a schema; ``cancel()`` before its answer and ``on_done`` is never called."""

    __slots__ = ("cancelled", "field", "key", "on_done")

    def __init__(self, key: str, field: str, on_done: OnDone) -> None:
        self.key, self.field, self.on_done = key, field, on_done
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class GrammarService:
    """Compiles JSON schemas for one tokenizer in a child process, under a budget; caches the results."""

    def __init__(self, tokenizer: Any, vocab_size: int, budget: CompileBudget = CompileBudget()) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.budget = budget
        # the tokenizer's info, built once here (~0.2-0.9 s, partly holding the interpreter lock): at engine
        # start, before the engine registers, never on a request
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self._info_json = self.info.serialize_json()
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._cache_bytes = 0
        self._lock = threading.Lock()  # the cache and the waiting tickets
        self._waiting: dict[str, list[Ticket]] = {}
        self._jobs: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._child: _Child | None = _Child.start(self._info_json, budget.memory_bytes)
        self.compiles = self.refusals = self.kills = 0  # counters, for tests and logs
        self._ready = threading.Event()  # the first child has imported xgrammar and can compile
        self._thread = threading.Thread(target=self._loop, name="grammar-compile", daemon=True)
        self._thread.start()

    # ---- any thread ----

    def submit(self, schema: str | None, field: str, on_done: OnDone) -> Ticket | None:
        """The compiled grammar for ``schema`` (JSON text; None: any JSON object): from the cache, ``on_done``
        is called now and None returned; else a Ticket, and ``on_done`` is called on the service's thread.
        A refusal (the compiler's, or the budget's) is a BadRequest naming ``field``; with ``max_waiting``
        other schemas waiting, an Overloaded at once."""
        key = _ANY_OBJECT if schema is None else schema
        with self._lock:
            compiled = self._cache.get(key)
            busy = compiled is None and key not in self._waiting and self._waiting_live() >= self.budget.max_waiting
            if compiled is not None:
                self._cache.move_to_end(key)
            elif not busy:
                ticket = Ticket(key, field, on_done)
                waiting = self._waiting.setdefault(key, [])
                waiting.append(ticket)
                if len(waiting) == 1:
                    self._jobs.put(key)
                return ticket
        if busy:
            why = f"{self.budget.max_waiting} schemas are waiting to compile on this engine: retry later"
            on_done(None, Overloaded(why, field=field))
        else:
            on_done(compiled, None)
        return None

    def _waiting_live(self) -> int:
        """Schemas some request still waits for (a cancelled one's entry lasts until the thread sees it)."""
        return sum(1 for tickets in self._waiting.values() if any(not t.cancelled for t in tickets))

    def compile(self, schema: str | None, field: str = "response_format") -> Any:
        """Blocking: the compiled grammar, or the BadRequest raised (in-process generation)."""
        done = threading.Event()
        answer: list[Any] = []

        def on_done(compiled: Any, error: ZserveError | None) -> None:
            answer[:] = [compiled, error]
            done.set()

        self.submit(schema, field, on_done)
        done.wait()
        if answer[1] is not None:
            raise answer[1]
        return answer[0]

    def wait_ready(self, timeout_s: float) -> bool:
        """Wait until the compiler process can compile (it imports xgrammar: seconds), so the first structured
        request does not pay for it; False if it was not ready in ``timeout_s``."""
        return self._ready.wait(timeout_s)

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=5)
        with self._lock:
            child, self._child = self._child, None
        if child is not None:
            child.kill()

    @property
    def cache_size(self) -> tuple[int, int]:
        """(grammars, bytes) in the cache."""
        with self._lock:
            return len(self._cache), self._cache_bytes

    # ---- the service's thread ----

    def _loop(self) -> None:
        while True:
            child = self._child
            if child is not None and child.alive():
                child.prime()  # while idle: the next schema does not wait for the child's start
            self._ready.set()
            key = self._jobs.get()
            if key is None:
                return
            if not self._live(key):
                self._finish(key, None, None)
                continue
            try:
                compiled, error = self._compile(key)
                if error is None and compiled is None and self._live(key):  # the child died before: once more
                    compiled, error = self._compile(key)
                if error is None and compiled is None and self._live(key):
                    error = BadRequest("the grammar compiler process keeps failing to start")
            except Exception as exc:  # a bug here must not leave requests waiting forever
                log.exception("grammar compile failed")
                compiled, error = None, BadRequest(f"the JSON schema could not be compiled: {exc!r}")
            self._finish(key, compiled, error)

    def _live(self, key: str) -> bool:
        with self._lock:
            return any(not t.cancelled for t in self._waiting.get(key, ()))

    def _compile(self, key: str) -> tuple[Any, BadRequest | None]:
        child = self._child
        if child is None or not child.alive():
            child = self._child = _Child.start(self._info_json, self.budget.memory_bytes)
        if not child.send(key):  # blocks while a child that just started imports xgrammar: not in the budget
            self._restart(child, "the compiler process had died")
            return None, None
        deadline = time.monotonic() + self.budget.time_s
        why = ""
        while not why:
            if child.ready(_POLL_S):
                reply = child.receive()
                if reply is None:
                    why = f"the compiler ran out of its {self.budget.memory_bytes >> 20} MiB memory budget"
                    break
                self.compiles += 1
                kind, text = reply[:1], reply[1:].decode()
                if kind == b"e":
                    return None, BadRequest(f"the JSON schema cannot be compiled: {text}")
                if kind == b"m":
                    why = f"the compiler ran out of its {self.budget.memory_bytes >> 20} MiB memory budget ({text})"
                    break
                return self._xgr.CompiledGrammar.deserialize_json(text, self.info), None
            if time.monotonic() > deadline:
                why = f"the grammar did not compile within its {self.budget.time_s:g} s budget"
            elif not self._live(key):
                self._restart(child, "every request waiting for it was cancelled")
                return None, None
        self._restart(child, why)
        self.refusals += 1
        return None, BadRequest(f"the JSON schema is too costly to enforce: {why}")

    def _restart(self, child: _Child, why: str) -> None:
        """Kill the child and start another, which imports while the refusal goes out."""
        log.warning("grammar compile stopped (%s): restarting the compiler process", why)
        self.kills += 1
        child.kill()
        self._child = _Child.start(self._info_json, self.budget.memory_bytes)

    def _finish(self, key: str, compiled: Any, error: BadRequest | None) -> None:
        with self._lock:
            if compiled is None and error is None and any(not t.cancelled for t in self._waiting.get(key, ())):
                # Dropped because every ticket was cancelled, but one for the same schema joined since (a
                # client retrying at once): it queued no job of its own, so compile again for it.
                self._jobs.put(key)
                return
            tickets = self._waiting.pop(key, [])
            if compiled is not None:
                self._remember(key, compiled)
        for t in tickets:
            if t.cancelled or (compiled is None and error is None):
                continue
            if error is not None:
                t.on_done(None, BadRequest(error.message, field=t.field))
            else:
                t.on_done(compiled, None)

    def _remember(self, key: str, compiled: Any) -> None:
        size = int(compiled.memory_size_bytes)
        if size > self.budget.cache_bytes:
            return  # used by the requests that wait for it, not kept
        self._cache[key] = compiled
        self._cache_bytes += size
        while len(self._cache) > self.budget.cache_entries or self._cache_bytes > self.budget.cache_bytes:
            _, old = self._cache.popitem(last=False)
            self._cache_bytes -= int(old.memory_size_bytes)


class _Child:
    """The compiler process and our end of its socket (messages: schema text in; ``o`` + serialised grammar,
    ``e`` + the compiler's complaint, or ``m`` + a memory error out)."""

    def __init__(self, process: subprocess.Popen, conn: Connection, info_json: str) -> None:
        self.process, self.conn = process, conn
        self._info_json: str | None = info_json  # sent before the first schema (the child reads it once imported)

    @classmethod
    def start(cls, info_json: str, memory_bytes: int) -> _Child:
        from zserve.transport import child_env  # not at the top: the GPU check imports the generator without zmq

        ours, theirs = socket.socketpair()
        process = subprocess.Popen(
            [sys.executable, "-m", "zserve.generator.grammar_compile", str(theirs.fileno()), str(memory_bytes)],
            pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, env=child_env(),
        )  # fmt: skip
        theirs.close()
        return cls(process, Connection(ours.detach()), info_json)

    def alive(self) -> bool:
        return self.process.poll() is None

    def prime(self) -> bool:
        """Give the child the tokenizer's info and wait until it is ready to compile (it imports xgrammar
        first: seconds, which no schema's budget should pay). False: the child is dead."""
        if self._info_json is not None:
            info, self._info_json = self._info_json, None
            try:
                self.conn.send_bytes(info.encode())
            except OSError:
                return False
            return self.receive() == b"r"
        return self.alive()

    def send(self, key: str) -> bool:
        """Send a schema; False: the child is dead."""
        if not self.prime():
            return False
        try:
            self.conn.send_bytes(key.encode())
        except OSError:
            return False
        return True

    def ready(self, timeout_s: float) -> bool:
        return self.conn.poll(timeout_s)

    def receive(self) -> bytes | None:
        """The reply; None when the child died (killed by the kernel or by a failed allocation)."""
        try:
            return self.conn.recv_bytes()
        except (EOFError, OSError):
            return None

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        self.conn.close()


def _serve(fd: int, memory_bytes: int) -> None:
    """The child: build the tokenizer info, cap the address space, then compile schema after schema."""
    from zserve.transport import die_with_parent

    die_with_parent()
    conn = Connection(fd)
    import xgrammar as xgr

    info = xgr.TokenizerInfo.deserialize_json(conn.recv_bytes().decode())
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    used = _address_space_bytes()
    resource.setrlimit(resource.RLIMIT_AS, (used + memory_bytes, used + memory_bytes))
    conn.send_bytes(b"r")
    while True:
        try:
            key = conn.recv_bytes().decode()
        except EOFError:
            return
        try:
            compiled = compiler.compile_json_schema(key, any_whitespace=False)
            if compiled.memory_size_bytes > memory_bytes:
                conn.send_bytes(b"m" + f"the grammar alone takes {compiled.memory_size_bytes >> 20} MiB".encode())
                continue
            reply = b"o" + compiled.serialize_json().encode()
        except MemoryError as exc:
            reply = b"m" + str(exc).encode()
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError with its parser's message
            lines = str(exc).strip().splitlines() or [type(exc).__name__]
            message = re.sub(r"^\[[\d:]+\] \S+: ", "", lines[-1])  # less xgrammar's "[time] file.cc:line: "
            reply = (b"m" if "bad_alloc" in message or "memory" in message.lower() else b"e") + message.encode()
        conn.send_bytes(reply)


def _address_space_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[0]) * resource.getpagesize()


if __name__ == "__main__":
    _serve(int(sys.argv[1]), int(sys.argv[2]))
