"""The fast path's connection state machine (zserve/frontends/fast_state.py): its paths, its error and disconnect
edges, and what it refuses."""

from __future__ import annotations

import pytest

from zserve.frontends.fast_state import ENDING, TRANSITIONS, ConnState, Event, InvalidTransition, advance

S, E = ConnState, Event


def run(*events: Event, start: ConnState = S.READING) -> ConnState:
    state = start
    for event in events:
        state = advance(state, event)
    return state


@pytest.mark.parametrize(
    ("events", "end"),
    [
        ((E.LAST_REQUEST, E.CLOSE, E.LOST), S.CLOSED),  # Connection: close
        ((E.CLOSE, E.LOST), S.CLOSED),  # idle keep-alive
        ((E.HOLD, E.RESUME_HELD, E.FEED_HELD), S.READING),  # a long pipeline
        ((E.HANDOVER_REQUEST, E.HANDED_OVER), S.CLOSED),  # nothing to answer first
        ((E.HANDOVER_REQUEST, E.ANSWERS_OUT, E.HANDED_OVER), S.CLOSED),
        ((E.REFUSED, E.CLOSE_LINGERING, E.LOST), S.CLOSED),  # 413 / malformed, lingering
        ((E.REFUSED, E.REFUSED, E.CLOSE, E.LOST), S.CLOSED),  # no write_eof
        ((E.HANDOVER_REQUEST, E.REFUSED, E.CLOSE_LINGERING), S.LINGERING),  # malformed body of the app's request
    ],
)
def test_paths(events, end):
    assert run(*events) is end


@pytest.mark.parametrize("state", list(S))
def test_a_disconnect_ends_every_state(state):
    assert advance(state, E.LOST) is S.CLOSED


@pytest.mark.parametrize("state", [s for s in S if s not in ENDING])
def test_every_open_state_may_close(state):
    assert advance(state, E.CLOSE) is S.CLOSING


@pytest.mark.parametrize("state", ENDING)
@pytest.mark.parametrize("event", [e for e in E if e is not E.LOST])
def test_ending_states_absorb_events(state, event):
    assert advance(state, event) is state


def test_what_is_not_in_the_table_is_refused():
    refused = [(s, e) for s in S for e in E if (s, e) not in TRANSITIONS]
    assert (S.READING, E.HANDED_OVER) in refused and (S.FINAL, E.HOLD) in refused
    for state, event in refused:
        with pytest.raises(InvalidTransition, match=f"{event.name} in state {state.name}"):
            advance(state, event)
