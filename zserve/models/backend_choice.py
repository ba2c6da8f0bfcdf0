"""``backend = "auto"`` for embedders: ONNX Runtime where it is installed and, measured when the engine starts on
this model and this CPU, faster than torch with the same vectors; torch otherwise. One log line says which and why.

The choice is pure (``choose``, tested with made-up timings); ``measure`` times both on two batch shapes (one
short sentence; 32 of them), best of a few runs within a time budget, and compares their outputs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

log = logging.getLogger("zserve.backend")

TOLERANCE = 1e-5  # the largest |difference| of an embedding element for ONNX Runtime to count as the same vectors
SHAPES = (1, 32)  # rows timed: one request alone, and a full batch
BUDGET_S = 1.0  # the measurement's time, both backends and both shapes together (the export is apart, cached)
# Of several lengths, so that the comparison sees padding and the timing a batch of uneven rows.
_SENTENCES = (
    "zserve measures which backend computes this sentence's embedding faster on this machine",
    "hello",
    "A cross-encoder scores how well a document answers a query; an embedder maps each text to one vector.",
    "the quick brown fox",
)


@dataclass(frozen=True)
class Timing:
    """Best seconds per call at ``rows`` rows, for each backend."""

    rows: int
    torch_s: float
    onnx_s: float


def choose(timings: list[Timing], max_diff: float | None, why_not: str = "") -> tuple[str, str]:
    """``("onnx" | "torch", reason)``: ONNX Runtime only when it ran (``max_diff`` is not None), its outputs are
    within TOLERANCE of torch's, and it is faster at every measured shape, so it is never the slower one where
    measured."""
    if max_diff is None:
        return "torch", f"ONNX Runtime unavailable ({why_not})"
    if not max_diff <= TOLERANCE:
        return "torch", f"ONNX Runtime's vectors differ from torch's by {max_diff:.1e} (> {TOLERANCE:.0e})"
    ratios = ", ".join(f"{t.torch_s / t.onnx_s:.2f}x at {t.rows} row{'s' * (t.rows > 1)}" for t in timings)
    if all(t.onnx_s < t.torch_s for t in timings):
        return "onnx", f"ONNX Runtime {ratios} torch's speed, max |diff| {max_diff:.1e}"
    return "torch", f"ONNX Runtime not faster everywhere ({ratios} torch's speed)"


def best_s(call: Callable[[], Any], budget_s: float, clock: Callable[[], float] = time.perf_counter) -> float:
    """The fastest of repeated calls (at least 2: the first may pay one-time costs) within ``budget_s``."""
    best, spent, runs = float("inf"), 0.0, 0
    while runs < 2 or (spent < budget_s and runs < 50):
        start = clock()
        call()
        took = clock() - start
        best, spent, runs = min(best, took), spent + took, runs + 1
    return best


Call = Callable[[dict[str, Any]], Any]


def measure(model: Any, torch_call: Call, onnx_call: Call) -> tuple[list[Timing], float]:
    """Both backends on SHAPES batches of sentences made by ``model.preprocess`` (the library's tokenising):
    their timings and the largest |difference| of their sentence embeddings."""
    timings, max_diff = [], 0.0
    share = BUDGET_S / (2 * len(SHAPES))
    for rows in SHAPES:
        features = model.preprocess([_SENTENCES[i % len(_SENTENCES)] for i in range(rows)])
        a = torch_call(features)["sentence_embedding"].float().numpy()
        b = onnx_call(features)["sentence_embedding"].float().numpy()
        max_diff = max(max_diff, float(np.max(np.abs(a - b))))
        timings.append(Timing(rows, best_s(lambda f=features: torch_call(f), share),
                              best_s(lambda f=features: onnx_call(f), share)))  # fmt: skip
    return timings, max_diff
