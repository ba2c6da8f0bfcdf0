"""The generation benchmark's table, targets and (when matplotlib is installed) plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.common.report import save_figure, style_concurrency_axes
from bench.generation.workload import GenRow
from bench.serving.targets import Target

LEGS = ("zserve", "static", "single")
TARGET_CONCURRENCY = 32
THROUGHPUT_VS_STATIC = 1.5
TTFT_P99_VS_STATIC = 0.5
UNIFORM_VS_GENERATE = 0.85


def add_ratios(rows: list[GenRow]) -> None:
    """vs_static: output tok/s over the static-batching leg's at the same concurrency."""
    for r in rows:
        static = next((s for s in rows if s.leg == "static" and s.concurrency == r.concurrency), None)
        r.vs_static = r.tok_s / static.tok_s if static and static.tok_s else None


def evaluate(rows: list[GenRow], uniform: dict[str, Any] | None, shape: str) -> list[Target]:
    c = TARGET_CONCURRENCY
    z = next((r for r in rows if r.leg == "zserve" and r.concurrency == c), None)
    s = next((r for r in rows if r.leg == "static" and r.concurrency == c), None)
    goals = {
        "throughput-vs-static": f"zserve output tok/s at c{c} >= {THROUGHPUT_VS_STATIC}x static batching",
        "ttft-p99-vs-static": f"zserve p99 TTFT at c{c} <= {TTFT_P99_VS_STATIC}x static batching's",
        "uniform-vs-generate": f"engine core on a uniform batch ({shape}) >= {UNIFORM_VS_GENERATE}x model.generate",
    }
    out = []
    if z and s:
        ratio = z.tok_s / s.tok_s if s.tok_s else 0.0
        measured = f"{ratio:.2f}x ({z.tok_s:.1f} vs {s.tok_s:.1f} tok/s)"
        out.append(
            Target("throughput-vs-static", goals["throughput-vs-static"], measured, ratio >= THROUGHPUT_VS_STATIC)
        )
        ratio = z.ttft_p99_ms / s.ttft_p99_ms if s.ttft_p99_ms else float("inf")
        measured = f"{ratio:.2f}x ({z.ttft_p99_ms:.0f} vs {s.ttft_p99_ms:.0f} ms)"
        out.append(Target("ttft-p99-vs-static", goals["ttft-p99-vs-static"], measured, ratio <= TTFT_P99_VS_STATIC))
    else:
        for name in ("throughput-vs-static", "ttft-p99-vs-static"):
            out.append(Target(name, goals[name], f"not measured: needs zserve and static at c{c}", None))
    if uniform and "ratio" in uniform:
        measured = (
            f"{uniform['ratio']:.2f}x ({uniform['zserve_core']['tok_s']:.1f} vs "
            f"{uniform['hf_generate']['tok_s']:.1f} tok/s)"
        )
        met: bool | None = uniform["ratio"] >= UNIFORM_VS_GENERATE
    else:
        measured, met = "not measured", None
    out.append(Target("uniform-vs-generate", goals["uniform-vs-generate"], measured, met))
    return out


def format_table(rows: list[GenRow]) -> str:
    header = ("scenario", "leg", "conc", "requests", "out tok/s", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms",
              "TPOT p99 ms", "x static", "note")  # fmt: skip
    order = {leg: i for i, leg in enumerate(LEGS)}
    cells = []
    for r in sorted(rows, key=lambda r: (order.get(r.leg, 99), r.concurrency)):
        note = f"mean group {r.detail['mean_group']:.1f}" if "mean_group" in r.detail else ""
        if r.detail.get("length_mismatches"):
            note = f"{len(r.detail['length_mismatches'])} answers of the wrong length"
        ratio = "-" if r.vs_static is None else f"{r.vs_static:.2f}"
        cells.append((r.scenario, r.leg, str(r.concurrency), str(r.requests), f"{r.tok_s:.1f}", f"{r.ttft_p50_ms:.0f}",
                      f"{r.ttft_p99_ms:.0f}", f"{r.tpot_p50_ms:.1f}", f"{r.tpot_p99_ms:.1f}", ratio, note))  # fmt: skip
    widths = [max(len(row[i]) for row in [header, *cells]) for i in range(len(header))]

    def line(row: tuple[str, ...]) -> str:
        return "  ".join(
            c.rjust(w) if 2 <= i <= 9 else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))
        )

    return "\n".join([line(header), "  ".join("-" * w for w in widths), *map(line, cells)]).rstrip()


def write_plot(path: Path, rows: list[GenRow], legs: tuple[str, ...] = LEGS) -> bool:
    """Output tok/s and p99 TTFT against concurrency, one line per leg. False (quietly) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (tput, ttft) = plt.subplots(1, 2, figsize=(11, 4.5))
    for leg in legs:
        mine = sorted((r for r in rows if r.leg == leg), key=lambda r: r.concurrency)
        if mine:
            conc = [r.concurrency for r in mine]
            tput.plot(conc, [r.tok_s for r in mine], marker="o", label=leg)
            ttft.plot(conc, [r.ttft_p99_ms for r in mine], marker="o", label=leg)
    for ax, label in ((tput, "output tokens/s"), (ttft, "TTFT p99 (ms)")):
        style_concurrency_axes(ax, label)
    save_figure(fig, path)
    return True
