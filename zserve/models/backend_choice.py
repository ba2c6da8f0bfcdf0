"""``backend = "auto"`` (the embedders' default): ONNX Runtime where it is installed and, measured when the engine
starts on this model and this CPU, faster than torch with the same vectors; torch otherwise. One log line says which
and why.

The choice is pure (``choose``, tested with made-up timings); ``measure`` compares both backends' vectors on a few
probe texts (short, empty, past the model's length) and times them on two batch shapes (one short sentence; 32 of
them), the two backends taking turns, within a time budget.
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
# The probes are a handful of texts; other texts differ more (up to 3.6x the probes' largest difference on the
# tests' tiny stacks), so the probes must be within a tenth of the tolerance.
PROBE_MARGIN = 10
SHAPES = (1, 32)  # rows timed: one request alone, and a full batch
BUDGET_S = 1.0  # the timed runs, both backends and both shapes together, after one untimed run of each
MAX_RUNS = 50
# Timed: of several lengths, so that a batch of them has uneven rows.
_SENTENCES = (
    "zserve measures which backend computes this sentence's embedding faster on this machine",
    "hello",
    "A cross-encoder scores how well a document answers a query; an embedder maps each text to one vector.",
    "the quick brown fox",
)
# Compared only: the extremes, an empty text and a long one (about 1,000 tokens: past most models' limit, so the
# model truncates it), the latter alone so that the others are not padded to its length.
_LONG = "Berlin is the capital and largest city of Germany, by both area and population. " * 60
_PROBES = ((*_SENTENCES, ""), (_LONG,))


@dataclass(frozen=True)
class Timing:
    """Best seconds per call at ``rows`` rows, for each backend."""

    rows: int
    torch_s: float
    onnx_s: float


def choose(timings: list[Timing], max_diff: float | None, why_not: str = "") -> tuple[str, str]:
    """``("onnx" | "torch", reason)``: ONNX Runtime only when it ran (``max_diff`` is not None), its outputs on
    the probes are within TOLERANCE / PROBE_MARGIN of torch's, and it is faster at every measured shape, so it is
    never the slower one where measured."""
    if max_diff is None:
        return "torch", f"ONNX Runtime unavailable ({why_not})"
    if not max_diff <= TOLERANCE / PROBE_MARGIN:
        bound = f"{TOLERANCE / PROBE_MARGIN:.0e}, a tenth of the {TOLERANCE:.0e} it must hold everywhere"
        return "torch", f"ONNX Runtime's vectors differ from torch's by {max_diff:.1e} on the probes (over {bound})"
    ratios = ", ".join(f"{t.torch_s / t.onnx_s:.2f}x at {t.rows} row{'s' * (t.rows > 1)}" for t in timings)
    if all(t.onnx_s < t.torch_s for t in timings):
        return "onnx", f"ONNX Runtime {ratios} torch's speed, max |diff| {max_diff:.1e}"
    return "torch", f"ONNX Runtime not faster everywhere ({ratios} torch's speed)"


def best_pair_s(
    first: Callable[[], Any], second: Callable[[], Any], budget_s: float, clock: Callable[[], float] = time.perf_counter
) -> tuple[float, float]:
    """The fastest call of each of two callables, run in turns (so that a burst of load elsewhere slows both), at
    least once each, until ``budget_s`` is spent. Both should have run once before, untimed: one-time costs."""
    best, spent, runs = [float("inf"), float("inf")], 0.0, 0
    while runs < 1 or (spent < budget_s and runs < MAX_RUNS):
        for i, call in enumerate((first, second)):
            start = clock()
            call()
            took = clock() - start
            best[i], spent = min(best[i], took), spent + took
        runs += 1
    return best[0], best[1]


Call = Callable[[dict[str, Any]], Any]


def _max_diff(model: Any, torch_call: Call, onnx_call: Call, texts: list[str]) -> float:
    features = model.preprocess(texts)
    a = torch_call(features)["sentence_embedding"].float().numpy()
    b = onnx_call(features)["sentence_embedding"].float().numpy()
    return float(np.max(np.abs(a - b)))


def measure(model: Any, torch_call: Call, onnx_call: Call) -> tuple[list[Timing], float]:
    """Both backends on batches made by ``model.preprocess`` (the library's tokenising): their timings at SHAPES
    and the largest |difference| of their sentence embeddings on the probes and the timed batches. MiniLM at 1
    thread on a 2-core EPYC: 1.4 s of CPU time; the budget bounds the timed runs, not the untimed ones."""
    max_diff = max(_max_diff(model, torch_call, onnx_call, list(texts)) for texts in _PROBES)
    timings = []
    for rows in SHAPES:
        texts = [_SENTENCES[i % len(_SENTENCES)] for i in range(rows)]
        max_diff = max(max_diff, _max_diff(model, torch_call, onnx_call, texts))  # also the untimed first run
        features = model.preprocess(texts)
        torch_s, onnx_s = best_pair_s(lambda f=features: torch_call(f), lambda f=features: onnx_call(f),
                                      BUDGET_S / len(SHAPES))  # fmt: skip
        timings.append(Timing(rows, torch_s, onnx_s))
    return timings, max_diff
