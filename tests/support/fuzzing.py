"""Hypothesis settings for the fuzz suites: a bounded run in CI, a long one with ZSERVE_SLOW=1."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

SLOW = os.environ.get("ZSERVE_SLOW") == "1"


def fuzz_settings(ci_examples: int, slow_examples: int | None = None) -> settings:
    """``ci_examples`` cases in CI (``slow_examples``, default 20x, with ZSERVE_SLOW=1); no deadline (a live
    deployment's latency is not the property), no example database left in the checkout."""
    return settings(
        max_examples=(slow_examples or 20 * ci_examples) if SLOW else ci_examples,
        deadline=None,
        database=None,
        derandomize=not SLOW,  # CI runs the same cases every time; a slow run explores
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
