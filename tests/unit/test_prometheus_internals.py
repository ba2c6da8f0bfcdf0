"""The private Histogram fields metrics.py writes (zserve/frontends/prometheus_internals.py) are still there: this
fails naming the field and prometheus-client's version when a release moves one."""

from __future__ import annotations

from zserve.frontends import metrics, prometheus_internals


def test_the_installed_prometheus_client_has_the_histogram_fields():
    assert prometheus_internals.problems(metrics.LATENCY.labels("contract")) == []


def test_a_moved_field_is_named_with_the_version():
    found = prometheus_internals.problems(object())
    assert found == [
        f"prometheus-client {prometheus_internals.VERSION}: Histogram.{f}" for f in prometheus_internals.FIELDS
    ]
