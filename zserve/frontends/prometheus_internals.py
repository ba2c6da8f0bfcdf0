"""prometheus-client's private Histogram fields, in one place: Histogram has no public way to add many
observations at once, and ``metrics.ModelMetrics`` writes a turn's answers as one increment per bucket.
``problems`` names what the installed release lacks, with its version (tests/unit/test_prometheus_internals.py
and every ModelMetrics check it); pyproject.toml bounds prometheus-client below 1."""

from __future__ import annotations

from importlib.metadata import version
from typing import Any

VERSION = version("prometheus-client")
FIELDS = ("_buckets", "_sum", "_upper_bounds")  # a labelled Histogram child's counters and bucket bounds


def problems(child: Any) -> list[str]:
    return [f"prometheus-client {VERSION}: Histogram.{name}" for name in FIELDS if not hasattr(child, name)]


def require(child: Any) -> None:
    found = problems(child)
    if found:
        raise RuntimeError("zserve's metrics do not fit this prometheus-client: " + ", ".join(found))


def upper_bounds(child: Any) -> list[float]:
    return list(child._upper_bounds)  # ascending, +Inf last


def add(child: Any, bucket_counts: list[int], total: float) -> None:
    """What ``child.observe(v)`` for every value counted would have written (counts per bucket, their sum)."""
    child._sum.inc(total)
    for i, n in enumerate(bucket_counts):
        if n:
            child._buckets[i].inc(n)
