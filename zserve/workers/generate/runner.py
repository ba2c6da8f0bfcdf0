"""The generative engine's process shell: sequences in, one StepOutput per engine step out.

Three threads, one job each, connected by in-process queues only:
  * the link's thread (``WorkerLink.serve``) owns the DEALER: it decodes and tokenises each admitted
    sequence (a Batch of one) and forwards aborts; a structured one waits for its grammar (compiled by
    ``grammar_compile.GrammarService`` in a child process, under a budget) outside the core, and joins it
    from the service's thread when the grammar is ready: no compile ever holds up admission;
  * the step thread owns the engine core: it adds and aborts sequences between steps and runs the steps
    back to back while there is work. It touches no socket and does no text work, so on a GPU the device
    never waits for Python string handling;
  * the output thread owns a PUSH: it detokenises (incrementally, outside the step loop), watches for stop
    strings (and asks the step thread to abort a sequence that hit one), and sends what every sequence
    produced in a step as one message. When it falls behind, it folds several steps into one message.

The broker admits at most ``max_running`` sequences to this engine (its credits) and learns the free KV
blocks from every StepOutput and heartbeat, and what the prefix cache stored and evicted (block hashes) from
every StepOutput, on top of the snapshot in the Hello: its router sends a request where its prompt is cached.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

from zserve import payload
from zserve.errors import BadRequest, ZserveError
from zserve.frames import pack
from zserve.generation import (
    GenerateResponse,
    PromptLogprob,
    TokenLogprob,
    decode_generate_request,
    parse_generate_request,
)
from zserve.generator.detokenize import TextStream
from zserve.generator.generator import PreparedPrompt, generator_of
from zserve.generator.grammar_compile import Ticket
from zserve.generator.step_core import TokenOutput
from zserve.protocol import Batch, Codec, Status, StepOutput
from zserve.transport import make_socket
from zserve.workers.items import Failure
from zserve.workers.runtime import WorkerLink, enter_compute_thread

log = logging.getLogger("zserve.generate")

_IDLE_WAIT_S = 0.1  # the step thread's wait for work when it has none (it wakes at once on new work)
_GRAMMAR_START_S = 60.0  # the longest the engine waits at start for its grammar compiler process


@dataclass(slots=True)
class Admitted:
    """A sequence ready for the core (tokenised on the link's thread)."""

    batch_id: int
    stream: bool
    decoded: bool
    prompt: PreparedPrompt
    priority: int = 0  # the request's (Batch.priorities), lower is more urgent
    arrived_s: float = 0.0  # time.monotonic() when it reached the engine: the core ages its priority from there


@dataclass(slots=True)
class _StepReport:
    """What one step tells the broker besides tokens (the core's counters, copied on the step thread)."""

    step_ms: float
    free_blocks: int
    batch_tokens: int
    preemptions: int
    prompt_tokens: int
    cached_tokens: int
    stored_blocks: list[int]  # block hashes the prefix cache took in and let go since the last report
    evicted_blocks: list[int]

    @classmethod
    def of(cls, step_ms: float, core: Any) -> _StepReport:
        s = core.stats
        stored, evicted = core.blocks.take_events()
        return cls(
            step_ms, core.free_blocks, s.batch_tokens, s.preemptions, s.prompt_tokens, s.cached_tokens, stored, evicted
        )


@dataclass(slots=True)
class _Output:
    """The output thread's view of one sequence."""

    stream: bool
    decoded: bool
    text: TextStream
    prompt_length: int
    num_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None  # when the request asked for them
    prompt_ids: list[int] | None = None  # when the request asked for prompt logprobs
    prompt_logprobs: list[PromptLogprob] | None = None
    logprobs_streamed: int = 0  # of ``logprobs``, those that went out with streamed text


@dataclass(slots=True)
class _Entry:
    text: str = ""
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)  # those of ``text``'s tokens
    num_tokens: int = 0
    finished: bool = False
    status: Status = Status.OK
    message: str = ""
    field: str = ""
    frames: list[Any] = dataclasses.field(default_factory=list)


class GenerationRunner:
    def __init__(self, model: Any, link: WorkerLink) -> None:
        self.model = model  # its request hooks (direct clients send bodies the engine decodes)
        self.generator = generator_of(model)
        self.core = self.generator.core
        self.link = link
        link.credits = self.generator.max_running
        link.kv_blocks = self.core.num_blocks
        link.free_kv_blocks = self.core.free_blocks
        self.core.blocks.report_events()  # from now on, every step reports what its prefix cache changed
        # the broker's aging, so that the engine orders queued sequences as the broker ordered their requests
        self.core.scheduler.aging_s = link.priority_aging_s
        link.cache_snapshot = self._cache_snapshot
        # started before the engine registers: the tokenizer's info for grammars is built now, and the compiler
        # process has started, not on the first structured request
        self.grammars = self.generator.start_grammars()
        if self.grammars is not None and not self.grammars.wait_ready(_GRAMMAR_START_S):
            log.warning("the grammar compiler process is not ready after %.0f s; structured requests will wait for it",
                        _GRAMMAR_START_S)  # fmt: skip
        self._compiling: dict[int, Ticket | None] = {}  # batch id -> its grammar's ticket (None: being submitted)
        self._compiling_lock = threading.Lock()
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()  # -> step thread
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()  # -> output thread
        self._ctx = zmq.Context()  # the output thread's own: the link's is terminated when serve returns
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=link.guarded(self._step_loop), name="generate-step", daemon=True),
            threading.Thread(target=link.guarded(self._output_loop), name="generate-output", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # ---- the link's thread ----

    def _cache_snapshot(self) -> list[int]:
        """The hashes the prefix cache holds now, for the Hello (read while the step thread may change them)."""
        for _ in range(100):
            try:
                return list(self.core.blocks.by_hash)
            except RuntimeError:  # the step thread resized it meanwhile: read again
                continue
        return []  # the router learns the rest from the next steps' deltas

    def run(self, batch: Batch, frames: list[Any]) -> None:
        """Admit one sequence (the broker sends a generative engine Batches of one). Its answer comes later,
        from the output thread."""
        batch_id, decoded = batch.batch_id, batch.decoded[0]
        stream = bool(batch.stream and batch.stream[0])
        try:
            # a decoded request is the deployment's own GenerateRequest (a frontend's, with its prompt_token_ids),
            # decoded once with its type; a raw body is a client's, for the model's decode_request
            if decoded:
                try:
                    request = decode_generate_request(_first_buffer(frames))
                except BadRequest:  # another shape a direct client sent as decoded (a prompt string, say): as before
                    request = parse_generate_request(payload.decode(frames), token_ids=True)
            else:
                request = parse_generate_request(self.model.decode_request(payload.decode(frames)))
            prompt = self.generator.prepare(request)
        except Exception as exc:
            self.outbox.put(("fail", batch_id, Failure.from_exception(exc, Status.BAD_REQUEST, "prepare")))
        else:
            priority = batch.priorities[0] if batch.priorities else 0
            admitted = Admitted(batch_id, stream, decoded, prompt, priority, time.monotonic())
            if prompt.structured and self.grammars is not None:
                self._compile(admitted)
            else:
                self.inbox.put(("add", admitted))

    def _compile(self, admitted: Admitted) -> None:
        """Queue the sequence's schema; it joins the core when compiled (at once from the cache)."""
        batch_id = admitted.batch_id

        def on_done(compiled: Any, error: ZserveError | None) -> None:
            # Under the lock up to the put: an abort either finds the id here, or comes after the add in the
            # inbox (else the step thread would abort an unknown id, then add a sequence nobody waits for).
            with self._compiling_lock:
                if batch_id not in self._compiling:
                    return  # aborted meanwhile
                del self._compiling[batch_id]
                if error is not None:
                    self.outbox.put(("fail", batch_id, Failure(error.status, error.message, error.field)))
                else:
                    admitted.prompt = admitted.prompt.with_grammar(compiled)
                    self.inbox.put(("add", admitted))

        with self._compiling_lock:
            self._compiling[batch_id] = None
        ticket = self.grammars.submit(admitted.prompt.schema, "response_format", on_done)
        with self._compiling_lock:
            if batch_id in self._compiling:
                self._compiling[batch_id] = ticket
            elif ticket is not None:  # aborted while it was being submitted
                ticket.cancel()

    def _cancel_compiles(self, batch_ids: list[int] | None, then: tuple[str, Any]) -> None:
        """Compiles nobody waits for any more stop (a cancelled one that no other request shares is killed),
        and ``then`` goes to the step thread, in the same hold of the lock as ``on_done``'s put (see there)."""
        with self._compiling_lock:
            ids = list(self._compiling) if batch_ids is None else [b for b in batch_ids if b in self._compiling]
            tickets = [self._compiling.pop(b) for b in ids]
            self.inbox.put(then)
        for ticket in tickets:
            if ticket is not None:
                ticket.cancel()

    def abort(self, batch_ids: list[int]) -> None:
        self._cancel_compiles(batch_ids, ("abort", batch_ids))

    def reset(self) -> None:
        self._cancel_compiles(None, ("reset", None))

    def close(self) -> None:
        """Stop stepping, let the output thread send what the last step made, then stop it."""
        self._stop.set()
        self.inbox.put(("stop", None))
        step, output = self._threads
        step.join(timeout=10)
        self.outbox.put(("stop", None, None))
        output.join(timeout=5)
        if not output.is_alive():
            self._ctx.term()  # else it is stuck sending to a broker that is gone: exit without waiting
        if not step.is_alive():
            self.generator.close()  # a tensor parallel group's other ranks stop with it

    # ---- the step thread ----

    def _step_loop(self) -> None:
        enter_compute_thread(self.link.threads)
        core = self.core  # its sequence ids are the broker's batch ids

        def drop(batch_id: int) -> None:
            core.abort(batch_id)
            self.outbox.put(("drop", batch_id, None))

        while not self._stop.is_set():
            try:
                kind, item = self.inbox.get(timeout=None if not core.has_work() else 0)
            except queue.Empty:
                kind = None
            while kind is not None:
                if kind == "stop":
                    return
                if kind == "add":
                    try:
                        core.add(item.batch_id, item.prompt.prompt_ids, item.prompt.params, priority=item.priority,
                                 now=item.arrived_s)  # fmt: skip
                    except ValueError as exc:
                        self.outbox.put(("fail", item.batch_id, Failure(Status.BAD_REQUEST, str(exc), "prompt")))
                    else:
                        self.outbox.put(("start", item.batch_id, item))
                elif kind == "abort":
                    for batch_id in item:
                        drop(batch_id)
                elif kind == "reset":  # the broker forgot us: nobody waits for these any more
                    for batch_id in list(core.sequences):
                        drop(batch_id)
                try:
                    kind, item = self.inbox.get_nowait()
                except queue.Empty:
                    kind = None
            self.link.free_kv_blocks = core.free_blocks  # aborts free blocks too; heartbeats carry it
            if not core.has_work():
                continue
            started = time.perf_counter()
            try:
                outputs = core.step()
            except Exception as exc:  # a bug or a device error: fail what ran, keep serving
                why = "".join(traceback.format_exception_only(exc)).strip()
                log.error("engine step failed: %s; failing %d sequences", why, len(core.sequences))
                for batch_id in list(core.sequences):
                    drop(batch_id)
                    self.outbox.put(("fail", batch_id, Failure(Status.INTERNAL, f"engine step raised {why}")))
                continue
            step = _StepReport.of((time.perf_counter() - started) * 1000.0, core)
            self.link.free_kv_blocks = core.free_blocks
            self.outbox.put(("step", outputs, step))

    # ---- the output thread ----

    def _output_loop(self) -> None:
        codec = Codec()
        push = make_socket(self._ctx, zmq.PUSH, self.link.out_endpoint, bind=False, linger_ms=2000)
        push.setsockopt(zmq.SNDTIMEO, 30_000)
        sequences: dict[int, _Output] = {}
        try:
            while True:
                news = [self.outbox.get()]
                while True:  # fold whatever else is queued into this message
                    try:
                        news.append(self.outbox.get_nowait())
                    except queue.Empty:
                        break
                entries: dict[int, _Entry] = {}
                steps: list[_StepReport] = []
                for kind, batch_id_or_tokens, extra in news:
                    if kind == "stop":
                        return
                    if kind == "step":
                        self._tokens(batch_id_or_tokens, sequences, entries)
                        steps.append(extra)
                    elif kind == "start":
                        a: Admitted = extra
                        text = self.generator.text_stream(a.prompt)
                        params = a.prompt.params
                        sequences[batch_id_or_tokens] = _Output(
                            a.stream, a.decoded, text, len(a.prompt.prompt_ids),
                            logprobs=[] if params.logprobs >= 0 else None,
                            prompt_ids=a.prompt.prompt_ids if params.prompt_logprobs >= 0 else None,
                        )  # fmt: skip
                    elif kind == "drop":
                        sequences.pop(batch_id_or_tokens, None)
                    elif kind == "fail":
                        failure: Failure = extra
                        sequences.pop(batch_id_or_tokens, None)
                        entries[batch_id_or_tokens] = _Entry(
                            finished=True, status=failure.status, message=failure.message, field=failure.field
                        )
                if entries or steps:
                    try:
                        push.send_multipart(self._message(codec, entries, steps), copy=False)
                    except zmq.Again:  # no broker for SNDTIMEO: what waited for these answers is gone with it
                        log.warning("broker unreachable: dropped the output of %d sequences", len(entries))
        finally:
            push.close(linger=2000)

    def _tokens(self, tokens: list[TokenOutput], sequences: dict[int, _Output], entries: dict[int, _Entry]) -> None:
        for out in tokens:
            batch_id, token_id, reason = out.seq_id, out.token_id, out.finish_reason
            seq = sequences.get(batch_id)
            if seq is None:
                continue  # aborted, or stopped by a stop string a step ago
            seq.num_tokens += 1
            if seq.logprobs is not None and out.logprobs is not None:
                seq.logprobs.append(self.generator.token_logprob(token_id, out.logprobs))
            if seq.prompt_ids is not None and out.prompt_logprobs is not None:
                seq.prompt_logprobs = self.generator.prompt_token_logprobs(seq.prompt_ids, out.prompt_logprobs)
            delta, reason = seq.text.advance(token_id, reason)
            if seq.text.stopped:
                self.inbox.put(("abort", [batch_id]))
            entry = entries.setdefault(batch_id, _Entry())
            entry.num_tokens = seq.num_tokens
            if seq.stream and delta:
                entry.text += delta
                if seq.logprobs is not None:
                    entry.logprobs += seq.logprobs[seq.logprobs_streamed :]
                    seq.logprobs_streamed = len(seq.logprobs)
            if reason:
                del sequences[batch_id]
                entry.finished = True
                response = GenerateResponse(
                    seq.text.text, seq.num_tokens, seq.prompt_length, reason, seq.logprobs, seq.prompt_logprobs
                )
                try:
                    body = msgspec.to_builtins(response) if seq.decoded else self.model.encode_response(response)
                    entry.frames = payload.encode(body)
                except Exception as exc:
                    entry.status, entry.message = Status.INTERNAL, f"encode_response raised {exc!r}"

    def _message(self, codec: Codec, entries: dict[int, _Entry], steps: list[_StepReport]) -> list[Any]:
        last = steps[-1] if steps else None
        ids = [b for b, e in entries.items() if e.finished or e.text]  # nothing to say for the rest
        picked = [entries[b] for b in ids]
        header = StepOutput(
            self.link.worker_id,
            ids,
            [e.text for e in picked],
            [e.num_tokens for e in picked],
            [e.finished for e in picked],
            [e.status for e in picked],
            [e.message for e in picked],
            [len(e.frames) for e in picked],
            last.free_blocks if last else -1,
            sum(s.step_ms for s in steps),
            [e.field for e in picked],
            len(steps),
            sum(s.batch_tokens for s in steps),
            last.preemptions if last else 0,
            last.prompt_tokens if last else 0,
            last.cached_tokens if last else 0,
            [e.logprobs for e in picked] if any(e.logprobs for e in picked) else [],
            *_net_blocks(steps),
        )
        return [codec.encode(header), *pack([f for e in picked for f in e.frames])]


def _first_buffer(frames: list[Any]) -> Any:
    """A payload's first frame (msgpack of the body) as a buffer, without a copy."""
    if not frames:
        raise payload.PayloadError("empty payload")
    return frames[0].buffer if hasattr(frames[0], "buffer") else frames[0]


def _net_blocks(steps: list[_StepReport]) -> tuple[list[int], list[int]]:
    """(stored, evicted) over several steps: each hash once, in its last state."""
    if len(steps) == 1:
        return steps[0].stored_blocks, steps[0].evicted_blocks
    last: dict[int, bool] = {}
    for step in steps:
        last.update(dict.fromkeys(step.evicted_blocks, False))
        last.update(dict.fromkeys(step.stored_blocks, True))
    return [h for h, stored in last.items() if stored], [h for h, stored in last.items() if not stored]
