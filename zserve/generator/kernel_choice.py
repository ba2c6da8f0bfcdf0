"""Which kernel runs each linear product, decided from timings (``kernel_tune.py`` measures them when an
engine starts): the pure part, with no clock of its own, so that what it decides can be tested with made-up
timings.

A candidate is ``"onednn"`` (the weight reordered for oneDNN, what vLLM's CPU build runs), ``"torch"``
(``nn.Linear``: MKL on the plain weight) or one of our kernel's schedules, ``"native:<isa>/<variant>"``. For
each layer shape and each row bucket (1, a few, ``max_running``, a prefill chunk) the fastest measured one
runs; oneDNN is the reference every other must beat to be chosen, so the choice is never slower than oneDNN
as measured, and a candidate that failed (None: did not build, raised, gave wrong results) is never chosen.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

ONEDNN, TORCH = "onednn", "torch"
NATIVE = "native:"  # + "<isa>/<variant name>"
MARGIN = 0.97  # another candidate replaces oneDNN where it measured at least 3% faster
# the int8 layout's split moves to a bucket only where fp32 activations measured at least 10% faster there: the
# layout is int8's already, and a 4-bit shape's ratio at 8 rows was 0.92 or 1.06 from one allocation of the same
# weights to the next (timed again, the same: AVX2 kernels, issue 36's review), the split moving with it
SPLIT_MARGIN = 0.90


# the activations of a quantised product (native_quant: fp32, the weights converted in registers;
# native_quant_i8: quantised to two terms of int8, integer dot products; INT8_ONE: one term, never chosen by
# measurement, less exact: forced only, to measure what the second term buys)
FP32, INT8, INT8_ONE = "fp32", "int8", "int8x1"
# a timing's key: the int8 kernel's layout run with fp32 activations (its weights dequantised a group of panels
# at a time): what a call of many rows runs where the integer products cost more than FMAs (AVX2)
INT8_LAYOUT_FP32 = "int8-layout-fp32"
NEVER = 2**31 - 1  # rows from which the int8 layout runs fp32 activations: never


def _ok(t: float | None) -> bool:
    return t is not None and math.isfinite(t)


def split_rows(timings: Mapping[int, Mapping[str, float | None]], many: int = 1) -> int:
    """For one quantised layer shape, {rows: {INT8 / INT8_LAYOUT_FP32: seconds}} -> the row count from which a
    call on the int8 layout keeps its activations fp32: the first of the largest buckets that fp32 activations
    won each by ``SPLIT_MARGIN``, from past the geometric mean of it and the bucket below (as ``Route``); ``NEVER``
    where int8 won (or fp32's failed) at the largest bucket. ``many``: the row count from which fp32 activations
    run another path (a group of panels dequantised once) than below it (in registers): where that bucket was
    timed on the path of ``many`` rows, the split is not put below ``many``, at rows of a path no timing measured
    (4-bit weights on AVX2: 8 rows won at fp32 put the split at 3, and 3-5 rows ran 1.3-2.1x int8's time)."""

    def fp32_won(t: Mapping[str, float | None]) -> bool:
        fp32, int8 = t.get(INT8_LAYOUT_FP32), t.get(INT8)
        return _ok(fp32) and (not _ok(int8) or fp32 < int8 * SPLIT_MARGIN)

    rows = sorted(timings)
    first = len(rows)
    while first and fp32_won(timings[rows[first - 1]]):
        first -= 1
    if first == len(rows):
        return NEVER
    split = 1 if first == 0 else math.isqrt(rows[first - 1] * rows[first]) + 1
    return max(split, many) if rows[first] >= many else split


def choose_activations(timings: Mapping[int, Mapping[str, float | None]], many: int = 1) -> str:
    """For one quantised layer shape, {rows: {FP32 / INT8 (/ INT8_LAYOUT_FP32): seconds}} -> the layout its
    weights are kept in (one, not two): int8's where the geometric mean over the row counts of its time over
    fp32's is below ``MARGIN``; fp32 otherwise, or where int8 failed (None) at any row count (a kernel that gave
    a wrong result once is not trusted at others). Where INT8_LAYOUT_FP32 was timed, the int8 layout's time at a
    bucket is that of the path it runs there (``split_rows``, with ``many``)."""
    ratios = []
    many = split_rows(timings, many)
    for rows, t in timings.items():
        if not _ok(t.get(INT8)):
            return FP32
        fp32, int8 = t.get(FP32), t.get(INT8_LAYOUT_FP32) if rows >= many else t.get(INT8)
        if int8 is None or not math.isfinite(int8):
            return FP32
        if fp32 is None or not math.isfinite(fp32):
            continue
        ratios.append(int8 / fp32)
    if not ratios:
        return INT8 if timings else FP32
    return INT8 if math.exp(sum(map(math.log, ratios)) / len(ratios)) < MARGIN else FP32


def native(isa: str, variant: str) -> str:
    return f"{NATIVE}{isa}/{variant}"


def buckets(*rows: int) -> tuple[int, ...]:
    """The row counts to measure at, sorted, each once (1 always among them)."""
    return tuple(sorted({1, *(int(r) for r in rows if r >= 1)}))


def choose(timings: Mapping[str, float | None]) -> str:
    """The fastest measured candidate, where it beats oneDNN by ``MARGIN`` (a timing on a busy machine is
    noisy, and oneDNN is the reference); oneDNN otherwise, or where nothing else was measured (None: failed)."""
    measured = {name: t for name, t in timings.items() if t is not None and math.isfinite(t)}
    if not measured:
        return ONEDNN
    best = min(sorted(measured), key=measured.__getitem__)
    reference = measured.get(ONEDNN, math.inf)
    return best if best != ONEDNN and measured[best] < reference * MARGIN else ONEDNN


@dataclass(frozen=True)
class Route:
    """The candidate for each row count of one layer shape: ``kinds[i]`` measured at ``rows[i]`` rows, run
    for every row count nearer to it than to its neighbours (the limit between two buckets is their geometric
    mean)."""

    rows: tuple[int, ...]
    kinds: tuple[str, ...]

    @classmethod
    def of(cls, chosen: Mapping[int, str]) -> Route:
        rows = tuple(sorted(chosen))
        return cls(rows, tuple(chosen[r] for r in rows))

    @property
    def limits(self) -> tuple[float, ...]:
        return tuple(math.sqrt(a * b) for a, b in zip(self.rows, self.rows[1:], strict=False))

    def kind(self, rows: int) -> str:
        return self.kinds[bisect.bisect_left(self.limits, rows)]

    def needs(self) -> set[str]:
        return set(self.kinds)


def fastest_routes(timings: Mapping[str, Mapping[int, Mapping[str, float | None]]]) -> dict[str, Route]:
    """For each shape (its key in ``timings``), the route choosing the fastest per bucket."""
    return {shape: Route.of({rows: choose(t) for rows, t in by_rows.items()}) for shape, by_rows in timings.items()}


def speedup(timings: Mapping[str, Mapping[int, Mapping[str, float | None]]], routes: Mapping[str, Route]):
    """Per bucket: oneDNN's time over the chosen path's, summed over the shapes measured at that bucket."""
    out = {}
    for rows in sorted({r for by_rows in timings.values() for r in by_rows}):
        onednn = chosen = 0.0
        for shape, by_rows in timings.items():
            t = by_rows.get(rows)
            if t is None or t.get(ONEDNN) is None:
                continue
            onednn += t[ONEDNN]
            chosen += t[routes[shape].kind(rows)]
        if chosen:
            out[rows] = onednn / chosen
    return out


def summary(routes: Mapping[str, Route], ratios: Mapping[int, float], cached: bool) -> str:
    """The one log line: what runs each shape at each bucket, and the measured speedup over oneDNN."""
    shapes = "; ".join(
        f"{shape}: " + ", ".join(f"{r}:{k.removeprefix(NATIVE)}" for r, k in zip(route.rows, route.kinds, strict=True))
        for shape, route in routes.items()
    )
    speed = ", ".join(f"{rows} rows {x:.2f}x" for rows, x in ratios.items())
    return f"CPU linear products{' (choice cached)' if cached else ''}: {shapes}; time vs oneDNN's: {speed}"


def cache_key(cpu: str, source: str, threads: int, shapes: Iterable[str], rows: Iterable[int], versions: str) -> str:
    """The file name a choice is cached under: the CPU (its model and flags), our kernels' source, the thread
    count, the shapes and buckets, and the library versions; any change measures again."""
    text = json.dumps([cpu, hashlib.sha256(source.encode()).hexdigest(), threads, sorted(shapes), sorted(rows),
                       versions])  # fmt: skip
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def to_json(routes: Mapping[str, Route], ratios: Mapping[int, float]) -> str:
    return json.dumps({"routes": {s: [list(r.rows), list(r.kinds)] for s, r in routes.items()},
                       "ratios": {str(k): v for k, v in ratios.items()}})  # fmt: skip


def from_json(text: str) -> tuple[dict[str, Route], dict[int, float]]:
    data = json.loads(text)
    routes = {s: Route(tuple(rows), tuple(kinds)) for s, (rows, kinds) in data["routes"].items()}
    return routes, {int(k): v for k, v in data["ratios"].items()}
