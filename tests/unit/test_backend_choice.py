"""backend = "auto" for embedders: the choice between torch and ONNX Runtime, from made-up timings."""

from __future__ import annotations

import itertools

from zserve.models.backend_choice import TOLERANCE, Timing, best_s, choose


def test_onnx_is_chosen_only_when_faster_at_every_shape_with_the_same_vectors():
    fast = [Timing(1, 2.0, 1.0), Timing(32, 10.0, 8.0)]
    choice, reason = choose(fast, 1e-7)
    assert choice == "onnx" and "2.00x at 1 row" in reason and "1.25x at 32 rows" in reason
    assert choose([Timing(1, 2.0, 1.0), Timing(32, 8.0, 10.0)], 1e-7)[0] == "torch"  # slower on the full batch
    assert choose([Timing(1, 1.0, 1.0)], 0.0)[0] == "torch"  # a tie keeps the default library
    assert choose(fast, TOLERANCE)[0] == "onnx"
    choice, reason = choose(fast, 10 * TOLERANCE)
    assert choice == "torch" and "differ" in reason
    assert choose(fast, float("nan"))[0] == "torch"


def test_without_onnx_runtime_it_is_torch_and_the_reason_says_why():
    assert choose([], None, "not installed") == ("torch", "ONNX Runtime unavailable (not installed)")


def test_best_time_runs_at_least_twice_and_stops_at_its_budget():
    ticks = itertools.count()
    clock = lambda: next(ticks) * 0.5  # noqa: E731  every call takes 0.5 s
    calls = []
    assert best_s(lambda: calls.append(1), budget_s=0.1, clock=clock) == 0.5
    assert len(calls) == 2  # past its budget after one, but the first run may pay one-time costs
    calls.clear()
    best_s(lambda: calls.append(1), budget_s=2.0, clock=clock)
    assert len(calls) == 4
