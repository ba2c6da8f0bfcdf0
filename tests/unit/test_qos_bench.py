"""bench.faults.qos's bookkeeping: a window's statuses, rate, percentiles and 429s without Retry-After."""

from __future__ import annotations

from bench.faults.qos import Stream, summary


def test_a_window_counts_only_its_answers_and_flags_429s_without_retry_after() -> None:
    s = Stream("http://127.0.0.1:1", "k", clients=0)  # no threads: records written by hand
    s.records = [(0.5, 0.010, 200, None), (1.0, 0.020, 200, None), (1.5, 0.030, 429, "1"), (1.6, 0.001, 429, None),
                 (3.0, 0.040, 200, None)]  # fmt: skip
    w = s.window(1.0, 2.0)
    assert w["statuses"] == {200: 1, 429: 2} and w["ok_per_s"] == 1.0
    assert w["p50_ms"] == 20.0 and w["429_without_retry_after"] == 1


def test_summary_names_the_shares() -> None:
    fair = {"a": {"share": 0.5}, "b": {"share": 0.5}}
    assert summary({"fair_1_1": fair}) == ["fair share 1:1, 10x clients on the first: shares a 0.5, b 0.5"]


def test_summary_names_each_floods_served_refused_and_pushed_out() -> None:
    run = {"tenants": {"a": {"offered": 10, "ok": 4, "overloaded": 3, "pushed_out": 3, "share": 0.5},
                       "b": {"offered": 4, "ok": 4, "share": 0.5}}}  # fmt: skip
    assert summary({"flood": {"after_10x": run}}) == [
        "flood after_10x: a 10 offered, 4 served (0.5), 3 refused, 3 pushed out, "
        "b 4 offered, 4 served (0.5), 0 refused, 0 pushed out"
    ]
