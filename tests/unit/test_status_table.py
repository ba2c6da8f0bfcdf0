"""`zserve status`'s model table and readiness rule, from a HealthReport."""

from __future__ import annotations

from zserve.config import parse_config
from zserve.deploy.status import model_lines, not_ready, tenant_lines
from zserve.protocol import EngineRouting, HealthReport, ModelHealth, TenantHealth

CONFIG = parse_config("""
[[models]]
name = "enc"
handler = "zserve.models.echo:Echo"
[[models]]
name = "lm"
handler = "zserve.models.echo:Echo"
""")


def test_every_field_is_shown_and_missing_statistics_are_a_dash():
    enc = ModelHealth("enc", 2, 7, 3, busy_workers=1, preprocess_workers=1, credits=4, free_credits=1, batches=10,
                      mean_batch_size=12.5, latency_p50_ms=3.25, latency_p90_ms=8.0, latency_p99_ms=20.0)  # fmt: skip
    routing = [EngineRouting("e0", 30, 24), EngineRouting("e1", 10, 2)]
    lm = ModelHealth("lm", 1, 0, 5, generative=True, running_sequences=5, free_kv_blocks=30, kv_blocks=100,
                     routing=routing)  # fmt: skip
    header, enc_row, lm_row = (line.split() for line in model_lines(HealthReport(1, 1, False, [enc, lm])))
    assert dict(zip(header, enc_row, strict=True)) == {
        "MODEL": "enc", "ENGINES": "2", "BUSY": "1", "STAGES": "1", "QUEUE": "7", "IN_FLIGHT": "3", "CREDITS": "3/4",
        "BATCH": "12.5", "P50_MS": "3.2", "P90_MS": "8.0", "P99_MS": "20.0", "RUNNING": "-", "KV_USED": "-",
        "ROUTE_HIT": "-",
    }  # fmt: skip
    lm_cells = dict(zip(header, lm_row, strict=True))
    assert lm_cells["RUNNING"] == "5" and lm_cells["KV_USED"] == "70/100" and lm_cells["BATCH"] == "-"
    assert lm_cells["ROUTE_HIT"] == "65%"  # cache-aware routing: 26 of 40 prompt blocks found where routed


def test_ready_needs_an_engine_per_model_a_stage_where_staged_and_no_drain():
    ready = [ModelHealth("enc", 1, 0, 0, preprocess_workers=1), ModelHealth("lm", 1, 0, 0)]
    assert not_ready(CONFIG, HealthReport(1, 1, False, ready), staged=["enc"]) == []
    assert not_ready(CONFIG, HealthReport(1, 1, True, ready), staged=[]) == ["the broker is draining (stopping)"]
    no_stage = [ModelHealth("enc", 1, 0, 0), ModelHealth("lm", 0, 0, 0)]
    assert not_ready(CONFIG, HealthReport(1, 1, False, no_stage), staged=["enc"]) == [
        "enc: no ready preprocess stage", "lm: no ready engine",
    ]  # fmt: skip
    assert not_ready(CONFIG, HealthReport(1, 1, False, ready[:1]), staged=[]) == ["lm: no ready engine"]


def test_tenant_lines_show_each_tenants_counts_and_served_cost_and_nothing_without_tenants():
    assert tenant_lines(HealthReport(1, 1, False, [])) == []
    tenants = [TenantHealth("batch", 40, 7, {"lm": 900, "enc": 12}, overloaded=3, pending=5), TenantHealth("web")]
    _, header, batch, web = tenant_lines(HealthReport(1, 1, False, [], tenants))
    names = header.split()
    assert dict(zip(names, batch.split(maxsplit=5), strict=True)) == {
        "TENANT": "batch", "ADMITTED": "40", "REFUSED_429": "7", "REFUSED_503": "3", "PENDING": "5",
        "SERVED_COST": "enc=12 lm=900",
    }  # fmt: skip
    assert web.split() == ["web", "0", "0", "0", "0", "-"]
