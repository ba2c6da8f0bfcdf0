"""Measures, when an engine starts, which kernel runs each of its model's linear products fastest on this CPU
(``cpu_linear = "auto"``): for every layer shape and row bucket (1, a few, ``max_running``, a prefill chunk)
it times our kernel's schedules for this CPU's ISA (``native_linear.variants``), oneDNN's prepacked product
and ``nn.Linear``, best of a few within a budget of ~2 s in all, and ``kernel_choice`` keeps the fastest of
each, oneDNN unless another beat it. The choice is cached under the zserve cache folder, keyed by the CPU
(its model name and flags), our kernels' source, the thread count, the shapes and the library versions, so a
second start on the same machine measures nothing; one log line says what was chosen and the ratio.

Why measure: the same kernel was 0.65x oneDNN's time at 8 rows on an AVX-512 core and 12x at 8 rows on an
AVX2 one (issue 33), and which product wins at 256 rows differs from core to core; a table of rules would be
wrong somewhere, a measurement on the machine is not.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from zserve.generator import c_build, cpu_linear, kernel_choice, native_linear, native_quant, native_quant_i8
from zserve.gguf_cache import zserve_cache

log = logging.getLogger("zserve.engine")

BUDGET_S = 1.2  # measuring; packing the samples and the first runs take the rest of ~2 s
# A decode step streams every layer's weights from memory, so a product of a few rows is timed on more distinct
# weights than the last-level cache holds, each pass starting with them out of it. Timed on 16 MiB (within a 32 MiB
# L3), a schedule that reads the weights more than once looked best and was 7-10% slower in real steps at 8-32
# decodes (AVX-512, issue 33).
_STREAM_L3 = 1.5  # the weights of a timed pass, in last-level caches
_STREAM_MAX_BYTES = 128 << 20  # at most: a pass of 128 MiB takes ~10 ms on one core
_L3_DEFAULT_BYTES = 32 << 20  # where the size cannot be read
_FEW_ROWS = 64  # up to here a product reads its weights from memory (at 32 rows, 16 flops a byte of weight)
_MANY_FLOP = 200_000_000  # many rows: time a slice of outputs of about this many flops (~2-4 ms on one core)
_GROUP = 96  # outputs in whole groups of panels of every variant (16 x 6, 8 x 12)
_REPEATS = 3
_GRACE_S = 1.0  # past the budget by this much (a machine far busier than its cores), the rest is not measured
_VERSION = 3  # of how it measures: a cached choice made another way is measured again


def candidates(weight: torch.Tensor) -> list[str]:
    """What can run a layer with ``weight``: oneDNN, torch, and our kernel's schedules where it applies."""
    isa = c_build.isa().name
    out = [kernel_choice.ONEDNN, kernel_choice.TORCH]
    if native_linear.applies(weight, native_linear.default(isa)):
        out += [kernel_choice.native(isa, v.name) for v in native_linear.variants(isa)]
    return out


def shape(linear: nn.Linear) -> str:
    """The key its choice is made and cached under: inputs, outputs, and whether it has a bias."""
    return f"{linear.in_features}->{linear.out_features}{'+b' if linear.bias is not None else ''}"


def prepack(model: nn.Module, rows: tuple[int, ...], head_rows: int = 0, budget_s: float = BUDGET_S) -> int:
    """``cpu_linear.prepack(model, "auto")``: every fp32 ``nn.Linear`` packed for what measured fastest for
    its shape at each of ``rows`` (the output layer: those up to ``head_rows``, the most it computes logits
    for, when given); the number replaced."""
    # the output layer: Hugging Face's models name it, ours (llama.py) call it lm_head
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else getattr(model, "lm_head", None)
    places = [(parent, name, child) for parent in list(model.modules()) for name, child in parent.named_children()
              if type(child) is nn.Linear]  # fmt: skip
    routes = choose([child for _, _, child in places], rows, head, head_rows, budget_s)
    for parent, name, child in places:
        route = routes.get(shape(child))
        setattr(parent, name, cpu_linear.PackedLinear(child, route=route) if route else cpu_linear.PackedLinear(child))
    return len(places)


def choose(
    linears: list[nn.Linear], rows: tuple[int, ...], head: nn.Module | None = None, head_rows: int = 0,
    budget_s: float = BUDGET_S,
) -> dict[str, kernel_choice.Route]:  # fmt: skip
    """The route of every fp32 CPU shape among ``linears`` (``head`` measured up to ``head_rows`` only), from
    the cache or measured, logged in one line; {} where none is fp32 on a CPU."""
    groups: dict[str, list[nn.Linear]] = defaultdict(list)
    buckets: dict[str, tuple[int, ...]] = {}
    for child in linears:
        if child.weight.dtype != torch.float32 or child.weight.device.type != "cpu":
            continue
        key = shape(child)
        groups[key].append(child)
        cap = head_rows if child is head and head_rows else max(rows, default=1)
        buckets[key] = kernel_choice.buckets(*buckets.get(key, ()), *(r for r in rows if r <= cap))
    return _routes(groups, buckets, budget_s) if groups else {}


def _routes(groups: dict[str, list[nn.Linear]], buckets: dict[str, tuple[int, ...]], budget_s: float):
    isa = c_build.isa()
    key = kernel_choice.cache_key(
        # the variants too: a route names one, and renaming or reshaping it need not change the tiles' source
        c_build._cpu_id(), native_linear.source(isa.name) + repr(native_linear.variants(isa.name)),
        torch.get_num_threads(),
        [f"{s}@{buckets[s]}" for s in groups], [], f"{torch.__version__} {isa} {c_build.has_compiler()} {_VERSION}",
    )  # fmt: skip
    path = zserve_cache() / "kernels" / f"linear-choice-{key}.json"
    try:
        routes, ratios = kernel_choice.from_json(path.read_text())
        log.info(kernel_choice.summary(routes, ratios, cached=True))
        return routes
    except (OSError, ValueError, KeyError):
        pass
    started = time.perf_counter()
    timings = measure(groups, buckets, budget_s)
    routes = kernel_choice.fastest_routes(timings)
    ratios = kernel_choice.speedup(timings, routes)
    took = time.perf_counter() - started
    unmeasured = sum(all(t is None for t in cell.values()) for by_rows in timings.values() for cell in by_rows.values())
    note = f"; out of time: {unmeasured} on oneDNN unmeasured, not cached" if unmeasured else ""
    log.info("%s (measured in %.1f s%s)", kernel_choice.summary(routes, ratios, cached=False), took, note)
    if unmeasured:
        return routes  # the next start measures again
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{id(routes)}.tmp")
        tmp.write_text(kernel_choice.to_json(routes, ratios))
        tmp.replace(path)  # atomic: engines starting together each write, the last one wins
    except OSError as e:
        log.warning("could not cache the CPU linear kernels' choice in %s: %s", path, e)
    return routes


def measure(groups: dict[str, list[nn.Linear]], buckets: dict[str, tuple[int, ...]], budget_s: float = BUDGET_S):
    """{shape: {rows: {candidate: seconds per product, or None where it failed}}}. A few rows (up to 64) are
    timed on a pass over 1.5x the last-level cache of the shape's own layers (or columns of one), so that their
    weights are read from memory as in a real step (fewer layers than that: all, after flushing the cache);
    many rows on a slice of one layer's outputs small enough to time in a few ms (the product is compute-bound
    there, and its time per output the same). Each candidate gets an equal share of
    what is left of ``budget_s`` (and one timed pass at least, however long)."""
    timings: dict[str, dict[int, dict[str, float | None]]] = {}
    deadline = time.perf_counter() + budget_s  # past it (and the grace), what is left is not measured: None
    names = {shape: candidates(layers[0].weight) for shape, layers in groups.items()}
    slots = sum(len(buckets[s]) * len(names[s]) for s in groups)
    stream_bytes = min(_STREAM_MAX_BYTES, int(_STREAM_L3 * last_level_cache_bytes()))
    flush = _Flush(stream_bytes)
    with torch.inference_mode():
        for shape, layers in groups.items():
            few = _streamed(layers, stream_bytes)
            packed_few = _packed(few, names[shape])
            timings[shape] = {}
            for rows in buckets[shape]:
                sample, packed = few, packed_few
                if rows > _FEW_ROWS:
                    sample = [_columns(layers[0], _MANY_FLOP // (2 * rows * layers[0].in_features))]
                    packed = _packed(sample, names[shape])
                x = torch.randn(rows, layers[0].in_features, dtype=layers[0].weight.dtype)
                want = sample[0](x)
                timings[shape][rows] = {}
                # a pass over fewer weights than the cache holds is timed after flushing them out of it
                cold = flush if sample is few and _bytes(few) < stream_bytes else None
                for name in names[shape]:
                    share = max(0.0, deadline - time.perf_counter()) / slots
                    slots -= 1
                    runs = packed[name]
                    late = time.perf_counter() > deadline + _GRACE_S
                    timed = _time(runs, x, want, share, deadline, cold) if runs and not late else None
                    timings[shape][rows][name] = timed
    return timings


def last_level_cache_bytes(root: str = "/sys/devices/system/cpu/cpu0/cache") -> int:
    """The size of this CPU's last-level cache (the highest level of cpu0's caches, Linux's sysfs), or
    ``_L3_DEFAULT_BYTES`` where it cannot be read."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    found: dict[int, int] = {}
    for index in Path(root).glob("index[0-9]*"):
        try:
            level, size = int((index / "level").read_text()), (index / "size").read_text().strip()
            found[level] = int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
        except (OSError, ValueError):
            continue
    return found[max(found)] if found and found[max(found)] > 0 else _L3_DEFAULT_BYTES


def _bytes(layers: list[nn.Linear]) -> int:
    return sum(m.weight.numel() * m.weight.element_size() for m in layers)


class _Flush:
    """Reading ``size`` bytes of its own evicts what a pass read before from the caches; made on first use."""

    def __init__(self, size: int) -> None:
        self.size, self.buffer = size, None

    def __call__(self) -> None:
        if self.buffer is None:
            self.buffer = torch.ones(self.size // 4, dtype=torch.float32)
        self.buffer.sum()


def _streamed(layers: list[nn.Linear], stream_bytes: int) -> list[nn.Linear]:
    """About ``stream_bytes`` of the layers' weights: enough whole layers (all of them where they hold fewer), or
    the leading outputs of one."""
    bytes_per = layers[0].weight.numel() * layers[0].weight.element_size()
    if bytes_per > stream_bytes:
        return [_columns(layers[0], stream_bytes // (layers[0].in_features * layers[0].weight.element_size()))]
    return layers[: max(1, min(len(layers), stream_bytes // bytes_per))]


def _columns(linear: nn.Linear, outputs: int) -> nn.Linear:
    """``linear`` cut to its first ``outputs`` (rounded down to whole groups of panels, at least one)."""
    outputs = min(linear.out_features, max(_GROUP, outputs // _GROUP * _GROUP))
    if outputs == linear.out_features:
        return linear
    cut = nn.Linear(linear.in_features, outputs, bias=linear.bias is not None, dtype=linear.weight.dtype)
    cut.weight = nn.Parameter(linear.weight.detach()[:outputs], requires_grad=False)
    if linear.bias is not None:
        cut.bias = nn.Parameter(linear.bias.detach()[:outputs], requires_grad=False)
    return cut


def _packed(layers: list[nn.Linear], names: list[str]) -> dict[str, list[Callable] | None]:
    """Each candidate's runner for each layer, the candidates of one weight form sharing its packing."""
    out: dict[str, list[Callable] | None] = {}
    shared: list[dict[str, torch.Tensor]] = [{} for _ in layers]
    for kind in names:
        try:
            runs = [cpu_linear.PackedLinear(m, route=kernel_choice.Route((1,), (kind,)), forms=forms)
                    for m, forms in zip(layers, shared, strict=True)]  # fmt: skip
        except (RuntimeError, ValueError, StopIteration) as e:
            log.info("CPU linear candidate %s unavailable: %s", kind, e)
            runs = None
        for run, forms in zip(runs or [], shared, strict=False):
            forms.update(run.forms)
        out[kind] = runs
    return out


def _clock() -> Callable[[], float]:
    """At one thread the thread's CPU time: all the work runs on it, and what other processes of a busy
    machine take from it does not count (measured here with 6x more runnable threads than cores, the wall
    clock ranked the candidates at random); with more, the wall clock."""
    return time.thread_time if torch.get_num_threads() == 1 else time.perf_counter


def _time(
    layers: list[Callable], x: torch.Tensor, want: torch.Tensor, share: float, deadline: float,
    flush: Callable[[], None] | None = None,
) -> float | None:  # fmt: skip
    """Seconds per product: best of 1 to ``_REPEATS`` passes within ``share`` (and the wall clock's
    ``deadline``) after a first run that checks the result, ``flush`` (untimed) before each pass where given;
    None where it raised or was wrong."""
    kind, clock = layers[0].route.kinds[0], _clock()
    try:
        t0 = clock()
        got = layers[0](x)
        first = clock() - t0
        if not torch.allclose(got, want, rtol=1e-3, atol=1e-3):
            log.warning("CPU linear candidate %s gave wrong results: not chosen", kind)
            return None
        best, spent = math.inf, first
        for _ in range(_REPEATS):
            # at least one pass after the first run (oneDNN makes its primitive for a new shape there)
            if best < math.inf and (spent >= share or time.perf_counter() >= deadline):
                break
            if flush is not None:
                flush()
            t0 = clock()
            for layer in layers:
                layer(x)
            took = clock() - t0
            best, spent = min(best, took / len(layers)), spent + took
        return best
    except RuntimeError as e:
        log.warning("CPU linear candidate %s failed: %s", kind, e)
        return None


# a quantised layer's kernel, forced: "int8" (activations quantised in two terms of int8, integer dot products, at
# every row count), "int8x1" (in one term: less exact) or "fp32" (the weights converted in registers); unset or
# "auto": measured per shape, and where int8 runs, the row count from which its layout runs fp32 activations
# (quant_choice)
QUANT_ACTIVATIONS_ENV = "ZSERVE_QUANT_ACTIVATIONS"
# a decode of one, a few and many sequences, and a prefill chunk's share: AVX2's integer products lose to FMAs
# from ~16-64 rows on (issue 36), AVX-512 VNNI's at none of these
_QUANT_ROWS = (1, 8, 32, 128)
_QUANT_SAMPLE_OUTPUTS = 1536  # outputs timed of a wider layer: the time per output is the same
# and at most this many weights (outputs x inputs) unless that leaves fewer outputs than _QUANT_MIN_OUTPUTS: a
# timing's work bounded as K grows (128 rows x 1536 x 8192 was 3.2 GFLOP a pass)
_QUANT_SAMPLE_WEIGHTS = 1536 * 1536
_QUANT_MIN_OUTPUTS = 256  # fewer would weigh quantising x (once a call, K a row) more than a layer's call does


def quant_sample_outputs(out_features: int, in_features: int, isa: str) -> int:
    """The outputs a quantised layer of this shape is timed on (``_measured_quant`` is keyed on them, so that
    wider layers of the same inputs share one measurement): whole panels of ``isa``'s width."""
    width = c_build.ISAS[isa].width
    cap = min(_QUANT_SAMPLE_OUTPUTS, max(_QUANT_MIN_OUTPUTS, _QUANT_SAMPLE_WEIGHTS // max(1, in_features)))
    return min(out_features, max(width, cap // width * width))


def quant_path(out_features: int, in_features: int, bits: int, minimums: bool, half: bool, isa: str) -> str:
    """The kernel a quantised layer of this shape and format runs here (``kernel_choice.INT8`` or ``FP32``):
    ``quant_choice``'s first half."""
    return quant_choice(out_features, in_features, bits, minimums, half, isa)[0]


def quant_choice(out_features: int, in_features: int, bits: int, minimums: bool, half: bool,
                 isa: str) -> tuple[str, int]:  # fmt: skip
    """(the layout a quantised layer of this shape and format keeps here, ``kernel_choice.INT8`` or ``FP32``;
    where INT8, the row count from which a call runs fp32 activations on it, ``kernel_choice.NEVER`` for none):
    ``$ZSERVE_QUANT_ACTIVATIONS`` where it names one (no split), else measured on random weights of the same
    form at 1, 8, 32 and 128 rows (the thread's CPU time, best of 3), on ``quant_sample_outputs`` of its outputs:
    once a process for each sample, K and format; on one thread of an AMD EPYC, 45-60 ms a shape at K = 576-1536,
    100-160 ms at K = 2048, 140-320 ms at K = 8192-14336 (AVX2 and AVX-512 kernels, issue 36's review)."""
    forced = os.environ.get(QUANT_ACTIVATIONS_ENV, "auto").lower()
    if forced in (kernel_choice.INT8, kernel_choice.INT8_ONE, kernel_choice.FP32):
        return forced, kernel_choice.NEVER
    if forced != "auto":
        log.warning("%s=%s is not int8, int8x1, fp32 or auto: measuring", QUANT_ACTIVATIONS_ENV, forced)
    n = quant_sample_outputs(out_features, in_features, isa)
    return _measured_quant(n, in_features, bits, minimums, half, isa, torch.get_num_threads())


@functools.cache
def _measured_quant(n: int, k: int, bits: int, minimums: bool, half: bool, isa: str, threads: int) -> tuple[str, int]:
    """``quant_choice`` measured on ``n`` outputs (``quant_sample_outputs``) of ``k`` inputs."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0 if bits == 4 else -127, 16 if bits == 4 else 128, (n, k), dtype=torch.int8, generator=gen)
    s = torch.rand(n, k // native_quant.BLOCK, generator=gen) * 0.02 + 1e-3
    m = torch.randn(n, k // native_quant.BLOCK, generator=gen) * 0.05 if minimums else None
    if half:
        s, m = s.half().float(), None if m is None else m.half().float()
    runs = {kernel_choice.FP32: (native_quant.linear, native_quant.pack(q, s, m, isa, bits))}
    if native_quant_i8.applies(q, n, k, isa):
        packed = native_quant_i8.pack(q, s, m, isa, bits)
        runs[kernel_choice.INT8] = (native_quant_i8.linear, packed)
        runs[kernel_choice.INT8_LAYOUT_FP32] = (native_quant_i8.linear, dataclasses.replace(packed, many=1))
    clock = _clock()
    timings: dict[int, dict[str, float | None]] = {}
    with torch.inference_mode():
        for rows in _QUANT_ROWS:
            # all the sample's outputs at every row count: the int8 kernel quantises x once a call, so a timing
            # of fewer outputs would weigh that more than a layer's call does (0.9x against 1.3x at 32 rows)
            x = torch.randn(rows, k, generator=gen)
            timings[rows] = {kernel_choice.INT8: None}
            for name, (run, packed) in runs.items():
                run(x, packed, None)  # the first call: the library loaded, the caches warm
                best = math.inf
                for _ in range(_REPEATS):
                    t0 = clock()
                    run(x, packed, None)
                    best = min(best, clock() - t0)
                timings[rows][name] = best
    # from this many rows the int8 layout's fp32 activations run a group of panels dequantised once, below it
    # the weights converted in registers: the split is not put below it from a timing of the former
    paths = native_quant_i8.MANY_ROWS[isa][bits == 4]
    chosen = kernel_choice.choose_activations(timings, paths)
    many = kernel_choice.split_rows(timings, paths) if chosen == kernel_choice.INT8 else kernel_choice.NEVER
    ratios = ", ".join(
        f"{r} rows {t[kernel_choice.FP32] / t[kernel_choice.INT8]:.2f}x" for r, t in timings.items()
        if t.get(kernel_choice.INT8)
    )  # fmt: skip
    form = f"{bits}-bit{' with minimums' if minimums else ''}"
    split = f", fp32 activations from {many} rows" if many != kernel_choice.NEVER else ""
    log.info("quantised %dx%d %s products on %s: %s activations%s (int8 against fp32: %s)", k, n, form, isa,
             chosen, split, ratios or "int8 unavailable")  # fmt: skip
    return chosen, many
