"""The life of one fast-path connection (``fast_http.py``) as a state machine: the states, the events that move
it, and every allowed transition, in one table. Pure: no sockets, no clock, no gunicorn.

A state says what happens to the bytes that arrive and who owns the connection:

- READING: parsed now, on the fast path.
- HOLDING: MAX_PIPELINED requests wait for answers; what arrives is kept unparsed (reading is paused).
- HOLD_RESUMING: enough answers went out; the kept bytes are parsed on the next event-loop turn.
- HANDING_OVER: the request being parsed is the ASGI app's; its bytes (and any after) are kept until the answers
  before it are written.
- HANDOVER_SCHEDULED: those answers are out; the connection goes to gunicorn's ASGI protocol next turn.
- FINAL: the client said close: its last answer is queued and nothing more is read (bytes are dropped).
- LINGER: an answer that ends the connection and leaves request bytes unread is queued (413, malformed HTTP).
- CLOSING: closed by us (after the last answer, idle, or aborted); the transport flushes, connection_lost follows.
- LINGERING: closing after a LINGER answer: our side is shut, and what the client still sends is read and
  dropped a while, so that closing does not reset the connection under an answer the client has not read.
- CLOSED: not ours any more (the connection was lost, or handed over to the ASGI protocol).

The three ending states (CLOSING, LINGERING, CLOSED) absorb every event but LOST: once a connection is going
away nothing reopens it (what a late reply or a parse error in the same read asks for does not apply).

The hot path only compares states (``state is READING``); transitions (``advance``) happen per connection, or
per MAX_PIPELINED requests, never per request of a keep-alive connection.
"""

from __future__ import annotations

import enum


class ConnState(enum.Enum):
    READING = "reading"
    HOLDING = "holding"
    HOLD_RESUMING = "hold_resuming"
    HANDING_OVER = "handing_over"
    HANDOVER_SCHEDULED = "handover_scheduled"
    FINAL = "final"
    LINGER = "linger"
    CLOSING = "closing"
    LINGERING = "lingering"
    CLOSED = "closed"

    # Identity hashing (Enum's own __hash__ is Python code): the transition table is looked up per transition.
    __hash__ = object.__hash__


class Event(enum.Enum):
    HANDOVER_REQUEST = "handover_request"  # headers of a request for the ASGI app were parsed
    LAST_REQUEST = "last_request"  # a request whose client said close was submitted
    REFUSED = "refused"  # an answer that leaves request bytes unread was queued (413, malformed HTTP)
    HOLD = "hold"  # MAX_PIPELINED requests wait: the rest is kept unparsed
    RESUME_HELD = "resume_held"  # answers went out: parse the kept bytes next turn
    FEED_HELD = "feed_held"  # the kept bytes are parsed now
    ANSWERS_OUT = "answers_out"  # the answers before the ASGI app's request are written
    HANDED_OVER = "handed_over"  # gunicorn's ASGI protocol has the connection
    CLOSE = "close"  # we close: after the last answer, when idle, or aborting on a write error
    CLOSE_LINGERING = "close_lingering"  # we shut our side after a LINGER answer, and drop what still arrives
    LOST = "lost"  # asyncio's connection_lost

    __hash__ = object.__hash__


S, E = ConnState, Event
ENDING = (S.CLOSING, S.LINGERING, S.CLOSED)
_OPEN = tuple(s for s in S if s not in ENDING)

TRANSITIONS: dict[tuple[ConnState, Event], ConnState] = {
    (S.READING, E.HANDOVER_REQUEST): S.HANDING_OVER,
    (S.READING, E.LAST_REQUEST): S.FINAL,
    (S.READING, E.REFUSED): S.LINGER,
    # A malformed body of the ASGI app's request: the error is answered, the handover never happens.
    (S.HANDING_OVER, E.REFUSED): S.LINGER,
    # A 413 then a parse error in the rest of the same read: the connection already ends.
    (S.LINGER, E.REFUSED): S.LINGER,
    (S.READING, E.HOLD): S.HOLDING,
    (S.HOLDING, E.RESUME_HELD): S.HOLD_RESUMING,
    (S.HOLD_RESUMING, E.FEED_HELD): S.READING,
    (S.HANDING_OVER, E.ANSWERS_OUT): S.HANDOVER_SCHEDULED,
    (S.HANDING_OVER, E.HANDED_OVER): S.CLOSED,  # nothing to answer first: at once
    (S.HANDOVER_SCHEDULED, E.HANDED_OVER): S.CLOSED,
    (S.LINGER, E.CLOSE_LINGERING): S.LINGERING,
    # Every open state may close: after the last answer (FINAL, LINGER; any state once a stopping worker
    # answers its last request with Connection: close), when idle (READING), or on a write error.
    **{(s, E.CLOSE): S.CLOSING for s in _OPEN},
    **{(s, E.LOST): S.CLOSED for s in S},
    # The ending states absorb the rest (see the module's docstring).
    **{(s, e): s for s in ENDING for e in E if e is not E.LOST},
}


class InvalidTransition(RuntimeError):
    """A bug of the fast path: an event its state cannot take."""


def advance(state: ConnState, event: Event) -> ConnState:
    """The state after ``event``; InvalidTransition when the table has no such edge."""
    try:
        return TRANSITIONS[state, event]
    except KeyError:
        raise InvalidTransition(f"fast HTTP connection: {event.name} in state {state.name}") from None
