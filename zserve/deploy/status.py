"""``zserve status``: one look at a running deployment, and an exit code for scripts and health checks.

Processes come from the supervisor's RUN_DIR/state.json (`zserve up`); models from the broker's health
report (``Client.health()``). Exit 0 when the broker answers, is not draining, and every model has a ready
engine (and a stage, for a model with a preprocess stage); 1 otherwise.
"""

from __future__ import annotations

import os
import time
from typing import IO

from zserve.client import Client
from zserve.config import Config, endpoints_for, run_dir_for
from zserve.errors import BrokerUnavailable
from zserve.protocol import HealthReport, ModelHealth
from zserve.state import SupervisorState, read_state


def _uptime(seconds: float) -> str:
    s = int(max(0.0, seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]


def process_lines(state: SupervisorState, now: float) -> list[str]:
    rows = [["PROCESS", "ROLE", "PID", "STATE", "UPTIME", "RESTARTS"]]
    for p in state.processes:
        rows.append([p.name, p.role, str(p.pid), p.state, _uptime(now - p.started_at), str(p.restarts)])
    return _table(rows)


def version_lines(report: HealthReport) -> list[str]:
    """The libraries each model's engines run on, as they said in their Hello (a bug report names them); a model
    whose engines disagree (a rolling upgrade, hosts installed apart) gets one line per version set."""
    return [f"engines of {m.name}: {line}" for m in report.models for line in m.versions]


def _ms(value: float) -> str:
    return f"{value:.1f}"


def model_lines(report: HealthReport) -> list[str]:
    rows = [["MODEL", "ENGINES", "BUSY", "STAGES", "QUEUE", "IN_FLIGHT", "CREDITS", "BATCH", "P50_MS", "P90_MS",
             "P99_MS", "RUNNING", "KV_USED", "ROUTE_HIT"]]  # fmt: skip
    for m in report.models:
        credits = f"{m.credits - m.free_credits}/{m.credits}" if m.credits else "-"
        stats = m.batches > 0
        kv = f"{m.kv_blocks - m.free_kv_blocks}/{m.kv_blocks}" if m.generative and m.kv_blocks else "-"
        rows.append([
            m.name, str(m.ready_workers), str(m.busy_workers), str(m.preprocess_workers), str(m.queue_depth),
            str(m.in_flight), credits, f"{m.mean_batch_size:.1f}" if stats else "-",
            _ms(m.latency_p50_ms) if stats else "-", _ms(m.latency_p90_ms) if stats else "-",
            _ms(m.latency_p99_ms) if stats else "-",
            str(m.running_sequences) if m.generative else "-", kv, _route_hit(m),
        ])  # fmt: skip
    return _table(rows)


def tenant_lines(report: HealthReport) -> list[str]:
    """Per tenant since the broker started (none without tenants): requests admitted past its quotas, refused
    429 (a quota) and 503 (a full queue, or a deadline out of reach), in the broker now, and the cost served from
    each model's queue (compare two tenants' to see their shares)."""
    if not report.tenants:
        return []
    rows = [["TENANT", "ADMITTED", "REFUSED_429", "REFUSED_503", "PENDING", "SERVED_COST"]]
    for t in report.tenants:
        served = " ".join(f"{model}={cost}" for model, cost in sorted(t.served_cost.items())) or "-"
        rows.append([t.name, str(t.admitted), str(t.rate_limited), str(t.overloaded), str(t.pending), served])
    return ["", *_table(rows)]


def _route_hit(m: ModelHealth) -> str:
    """Cache-aware routing's hit rate: prompt blocks found in the chosen engine's cache / prompt blocks routed."""
    requested = sum(r.prompt_blocks for r in m.routing)
    return f"{100.0 * sum(r.cached_blocks for r in m.routing) / requested:.0f}%" if requested else "-"


def not_ready(config: Config, report: HealthReport, staged: list[str]) -> list[str]:
    """Why the deployment is not ready (empty: ready)."""
    if report.draining:
        return ["the broker is draining (stopping)"]
    health: dict[str, ModelHealth] = {m.name: m for m in report.models}
    reasons = []
    for m in config.models:
        h = health.get(m.name)
        if h is None or h.ready_workers < 1:
            reasons.append(f"{m.name}: no ready engine")
        elif m.name in staged and h.preprocess_workers < 1:
            reasons.append(f"{m.name}: no ready preprocess stage")
    return reasons


def status(config: Config, config_path: str | os.PathLike[str], out: IO[str], timeout_s: float = 2.0) -> int:
    run_dir = run_dir_for(config, config_path)
    endpoint = endpoints_for(config, run_dir).client
    state = read_state(run_dir)
    lines = [f"run dir {run_dir}; broker {endpoint}"]
    if state is not None:
        lines += [f"supervisor pid {state.pid}, serving {state.url}", "", *process_lines(state, time.time())]
        staged = state.staged
    else:
        lines.append("no `zserve up` supervisor for this file (under supervisord: supervisorctl status)")
        from zserve.deploy.plan import model_kinds  # loads the handler classes, constructors only

        staged = model_kinds(config)[0]
    with Client(endpoint) as client:
        try:
            report = client.health(timeout_s=timeout_s)
        except BrokerUnavailable as exc:
            report = None
            reasons = [str(exc)]
    if report is not None:
        lines += ["", *model_lines(report), *version_lines(report), *tenant_lines(report)]
        reasons = not_ready(config, report, staged)
    lines += ["", "NOT READY: " + "; ".join(reasons) if reasons else "ready"]
    out.write("\n".join(lines) + "\n")
    return 1 if reasons else 0
