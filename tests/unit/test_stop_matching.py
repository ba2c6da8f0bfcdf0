"""Stop strings matched incrementally (detokenize.StopMatcher): the same text released, held and cut as the
full rescan it replaced, on random texts, pieces and stops; at a bounded cost per token."""

from __future__ import annotations

import time

from hypothesis import given, settings
from hypothesis import strategies as st

from zserve.generator.detokenize import StopMatcher, TextStream


class RescanStream:
    """The matcher before issue 40: every stop searched in the whole pending text, then every stop compared
    with every tail (the cut at the earliest stop, which is what the text means when two end in one piece)."""

    def __init__(self, stop: list[str]) -> None:
        self.stop = [s for s in stop if s]
        self.held, self.text, self.stopped = "", "", False

    def push_text(self, piece: str) -> str:
        if self.stopped:
            return ""
        pending = self.held + piece
        found = [at for s in self.stop if (at := pending.find(s)) >= 0]
        if found:
            at = min(found)
            self.stopped, self.held = True, ""
            self.text += pending[:at]
            return pending[:at]
        keep = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(pending)), keep, -1):
                if s.startswith(pending[-n:]):
                    keep = n
                    break
        out, self.held = pending[: len(pending) - keep], pending[len(pending) - keep :]
        self.text += out
        return out


alphabet = st.sampled_from("ab\n你")  # few letters: stops and their prefixes occur often
texts = st.text(alphabet, max_size=6)


@settings(max_examples=400, deadline=None)
@given(st.lists(texts, max_size=12), st.lists(st.text(alphabet, max_size=5), max_size=6))
def test_same_deltas_as_the_full_rescan(pieces: list[str], stops: list[str]) -> None:
    new, old = TextStream(None, stops), RescanStream(stops)
    for piece in pieces:
        assert new.push_text(piece) == old.push_text(piece)
        assert new.stopped == old.stopped
    assert new.flush() == ("" if old.stopped else old.held)
    full = "".join(pieces)
    if new.stopped:  # the text up to a stop string, which follows it
        assert full.startswith(new.text) and any(s and full[len(new.text) :].startswith(s) for s in stops)
    else:
        assert new.text == full and not any(s and s in full for s in stops)


def test_held_is_the_longest_tail_that_begins_a_stop() -> None:
    m = StopMatcher(["</answer>", "STOP", "xyz"])
    assert m.held("the answer</ans") == 5
    assert m.held("S") == 1 and m.held("ST") == 2 and m.held("STO") == 3
    assert m.held("abc") == 0 and m.held("") == 0
    assert m.find("a STOP b") == 2 and m.find("no") == -1
    assert StopMatcher([]).find("text") == -1 and StopMatcher([]).held("text") == 0


def test_cost_per_token_does_not_grow_with_the_held_text_times_the_stops() -> None:
    """800 long stops (the issue's attack), the text held back the whole time as a prefix of the last one:
    the rescan compared every other stop with every tail on every token; the matcher stays far below it."""
    stops = [f"{i:05d}" + "a" * 95 for i in range(800)]
    pieces = ["00799"] + ["a" * 4] * 22

    def per_token(stream) -> float:
        start = time.perf_counter()
        for p in pieces:
            stream.push_text(p)
        return (time.perf_counter() - start) / len(pieces)

    new = min(per_token(TextStream(None, stops)) for _ in range(3))
    old = min(per_token(RescanStream(stops)) for _ in range(2))
    assert new * 20 < old, (new, old)
    assert new < 2e-3, new
