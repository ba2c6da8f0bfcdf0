"""The table, the JSON file (and the git revision it records) and, when matplotlib is installed, the plot."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from bench.common.measure import BROKER, INPROCESS, SCENARIOS, Measurement
from bench.common.paths import REPO


def git_revision() -> str:
    def git(*args: str) -> str:
        out = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, check=False)
        return out.stdout.strip()

    rev = git("rev-parse", "--short", "HEAD") or "unknown"
    return rev + ("+dirty" if git("status", "--porcelain") else "")


def _ratio(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.2f}" if value >= 0.01 else f"{value:.1e}"


def _number(value: float) -> str:
    if value >= 100:
        return f"{value:,.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}" if value >= 0.01 or value == 0 else f"{value:.1e}"


def format_table(results: list[Measurement]) -> str:
    header = ("scenario", "model", "conc", "QPS", "p50 ms", "p99 ms", "x naive", "x mosec", "x limit", "errors", "note")
    rows = []
    order = {s: i for i, s in enumerate(SCENARIOS)}
    for m in sorted(results, key=lambda m: (m.model, order.get(m.scenario, 99), m.concurrency or 0)):
        if m.scenario == INPROCESS:
            conc = f"b{m.batch}"
            note = f"items/s; p50/p99 = call time of a batch of {m.batch}"
        else:
            conc = str(m.concurrency)
            batch = m.detail.get("mean_batch_size")
            note = f"mean batch {batch:.1f}" if batch else ""
            if (per_item := m.detail.get("broker_cpu_us_per_item")) is not None:
                note = f"broker {per_item:.1f} us CPU/item"
        rows.append(
            (
                m.scenario,
                m.model,
                conc,
                _number(m.qps),
                _number(m.p50_ms),
                _number(m.p99_ms),
                _ratio(m.vs_naive),
                _ratio(m.vs_mosec),
                _ratio(m.vs_limit),
                str(m.errors),
                note,
            )
        )
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    numeric = {2, 3, 4, 5, 6, 7, 8, 9}

    def line(cells: tuple[str, ...]) -> str:
        return "  ".join(
            c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), rule, *(line(r) for r in rows)]).rstrip()


def write_json(path: Path, document: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2) + "\n")


def write_plot(path: Path, results: list[Measurement]) -> bool:
    """Per model, QPS (top row) and p99 latency (bottom row) against concurrency, one line per target; the
    in-process limit as a dashed line on the QPS panel. False (quietly) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    served = [m for m in results if m.scenario not in (INPROCESS, BROKER)]
    models = sorted({m.model for m in served})
    if not models:
        return False
    fig, axes = plt.subplots(2, len(models), figsize=(6 * len(models), 9), squeeze=False)
    for col, model in enumerate(models):
        qps_ax, p99_ax = axes[0][col], axes[1][col]
        title, top = model, 0.0
        for scenario in SCENARIOS:
            mine = [m for m in served if m.model == model and m.scenario == scenario]
            points = sorted((m.concurrency, m.qps, m.p99_ms) for m in mine)
            if points:
                xs = [c for c, _, _ in points]
                qps_ax.plot(xs, [q for _, q, _ in points], marker="o", label=scenario)
                p99_ax.plot(xs, [p for _, _, p in points], marker="o", label=scenario)
                top = max([top, *(q for _, q, _ in points)])
        limit = next((m for m in results if m.model == model and m.scenario == INPROCESS), None)
        if limit is not None and top and limit.qps > 50 * top:  # echo's limit would flatten every other line
            title += f"  (in-process b{limit.batch}: {limit.qps:.2g}/s, off the scale)"
        elif limit is not None:
            qps_ax.axhline(limit.qps, linestyle="--", color="grey", label=f"in-process b{limit.batch}")
        concurrency = sorted({m.concurrency for m in served if m.model == model and m.concurrency})
        for ax, ylabel, heading in ((qps_ax, "requests/s", title), (p99_ax, "p99 latency (ms)", f"{model}: p99")):
            ax.set_xticks(concurrency, [str(c) for c in concurrency])
            ax.set_title(heading)
            style_concurrency_axes(ax, ylabel)
    save_figure(fig, path)
    return True


def style_concurrency_axes(ax: Any, ylabel: str) -> None:
    """Log-log axes against closed-loop concurrency, as every bench plot draws them."""
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("concurrency (closed loop)")
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()


def save_figure(fig: Any, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
