"""backend = "auto" for embedders: the choice between torch and ONNX Runtime, from made-up timings."""

from __future__ import annotations

import itertools

from zserve.models.backend_choice import PROBE_MARGIN, TOLERANCE, Timing, best_pair_s, choose


def test_onnx_is_chosen_only_when_faster_at_every_shape_with_the_same_vectors():
    fast = [Timing(1, 2.0, 1.0), Timing(32, 10.0, 8.0)]
    choice, reason = choose(fast, 1e-7)
    assert choice == "onnx" and "2.00x at 1 row" in reason and "1.25x at 32 rows" in reason
    assert choose([Timing(1, 2.0, 1.0), Timing(32, 8.0, 10.0)], 1e-7)[0] == "torch"  # slower on the full batch
    assert choose([Timing(1, 1.0, 1.0)], 0.0)[0] == "torch"  # a tie keeps the default library
    assert choose(fast, float("nan"))[0] == "torch"


def test_the_probes_must_hold_a_tenth_of_the_tolerance():
    fast = [Timing(1, 2.0, 1.0), Timing(32, 10.0, 8.0)]
    assert choose(fast, TOLERANCE / PROBE_MARGIN)[0] == "onnx"
    # Within the tolerance on the probes is not enough: other texts differ more (the tests' tiny stacks: 3.6x).
    choice, reason = choose(fast, TOLERANCE / 2)
    assert choice == "torch" and "differ from torch's by 5.0e-06 on the probes" in reason, reason
    assert choose(fast, 10 * TOLERANCE)[0] == "torch"


def test_without_onnx_runtime_it_is_torch_and_the_reason_says_why():
    assert choose([], None, "not installed") == ("torch", "ONNX Runtime unavailable (not installed)")


def test_the_pair_runs_in_turns_at_least_once_each_and_stops_at_its_budget():
    ticks = itertools.count()
    clock = lambda: next(ticks) * 0.5  # noqa: E731  every call takes 0.5 s
    calls: list[str] = []
    assert best_pair_s(lambda: calls.append("a"), lambda: calls.append("b"), budget_s=0.1, clock=clock) == (0.5, 0.5)
    assert calls == ["a", "b"]  # past its budget after one turn, but each has a time
    calls.clear()
    best_pair_s(lambda: calls.append("a"), lambda: calls.append("b"), budget_s=2.0, clock=clock)
    assert calls == ["a", "b"] * 2


def test_each_gets_its_own_best():
    times = iter([3.0, 1.0, 2.0, 4.0, 5.0, 5.0])  # a, b, a, b, a, b: durations from consecutive clock pairs
    now = [0.0]

    def clock():
        return now[0]

    def call():
        now[0] += next(times)

    assert best_pair_s(call, call, budget_s=14.0, clock=clock) == (2.0, 1.0)
