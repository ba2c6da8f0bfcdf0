"""The bench's pure parts: ratios, the issue 9 targets, the py-spy summary, process roles."""

from __future__ import annotations

from pathlib import Path

from bench.common.measure import (
    BROKER,
    BROKER_ALONE,
    DIRECT,
    HTTP,
    INPROCESS,
    MOSEC,
    NAIVE,
    STREAMER,
    Measurement,
    add_ratios,
)
from bench.common.procs import role_of
from bench.serving import hops, targets


def row(scenario: str, model: str, c: int | None, qps: float, p50: float = 1.0, p99: float = 2.0) -> Measurement:
    return Measurement(scenario, model, c, qps, p50, p99, requests=100, errors=0, duration_s=1.0)


def by_name(checked: list[targets.Target]) -> dict[str, targets.Target]:
    return {t.name: t for t in checked}


def test_ratios_against_naive_mosec_and_the_limit() -> None:
    results = [row(HTTP, "echo", 64, 500.0), row(NAIVE, "echo", 64, 250.0), row(MOSEC, "echo", 64, 1000.0),
               row(INPROCESS, "echo", None, 5000.0)]  # fmt: skip
    add_ratios(results)
    assert (results[0].vs_naive, results[0].vs_mosec, results[0].vs_limit) == (2.0, 0.5, 0.1)


def test_issue9_targets_met_missed_and_not_measured() -> None:
    results = [
        row(HTTP, "echo", 64, 6000.0, p99=9.0),
        row(MOSEC, "echo", 64, 10000.0, p99=4.0),
        row(HTTP, "echo", 1, 900.0, p50=1.2),
        row(DIRECT, "echo", 64, 16000.0),
        row(HTTP, "minilm", 64, 100.0),
        row(STREAMER, "minilm", 64, 110.0),
        row(NAIVE, "minilm", 64, 60.0),
        row(INPROCESS, "minilm", None, 104.0),
    ]
    checked = by_name(targets.evaluate(results, None, echo="echo", embed="minilm"))
    assert checked["i9-echo-vs-mosec"].met is True  # 0.6x >= 0.5x
    assert checked["i9-echo-p99-vs-mosec"].met is False  # 2.25x > 2x
    assert checked["i9-echo-c1-p50"].met is False
    assert checked["i9-direct-vs-mosec"].met is True
    assert checked["i9-embed-vs-limit"].met is True  # 100/104 = 0.96
    best = checked["i9-embed-vs-best-peer"]
    assert best.met is False and STREAMER in best.measured  # the best peer is named
    assert checked["i9-broker-capacity"].met is None  # no broker-alone row in this run
    assert "broker-alone" in checked["i9-broker-capacity"].measured


def test_broker_capacity_targets() -> None:
    alone = row(BROKER_ALONE, "echo", 2048, 160_000.0)
    alone.detail = {"workers": 4, "clients": 2, "window": 4, "items_per_message": 256, "broker_us_per_item": 5.0,
                    "broker_cores": 0.8}  # fmt: skip
    capacity = row(BROKER, "noop", 1024, 140_000.0)  # Client.submit: judged against mosec, not the 150k
    checked = by_name(targets.evaluate([alone, capacity, row(MOSEC, "echo", 64, 90_000.0)], None, "echo", "minilm"))
    assert checked["i9-broker-capacity"].met is True
    assert "5.00 us CPU/item" in checked["i9-broker-capacity"].measured
    assert checked["i9-capacity-vs-mosec"].met is True  # 1.56x
    alone.qps = 149_000.0
    assert by_name(targets.evaluate([alone], None, "echo", "minilm"))["i9-broker-capacity"].met is False


def test_py_spy_raw_summary(tmp_path: Path) -> None:
    raw = tmp_path / "raw.txt"
    raw.write_text(
        "process 1:main;thread (0x1);main (a.py:1);serve (a.py:2);parse (b.py:3) 60\n"
        "process 1:main;thread (0x1);main (a.py:1);serve (a.py:2);send (c.py:4) 40\n"
        "garbage line\n"
    )
    summary = hops.summarise_raw(raw, top=5)
    assert summary["samples"] == 100
    assert summary["own_pct"] == [("parse (b.py:3)", 60.0), ("send (c.py:4)", 40.0)]
    # main and serve are under every sample: the entry chain is left out of the inclusive list
    assert [frame for frame, _ in summary["inclusive_pct"]] == ["parse (b.py:3)", "send (c.py:4)"]
    assert hops.summarise_raw(tmp_path / "missing.txt", top=5)["samples"] == 0


def test_roles_of_zserve_and_peer_processes() -> None:
    assert role_of(["python", "-m", "zserve.broker.broker", "--config-json", "{}"]) == "broker"
    assert role_of(["python", "-m", "zserve.workers.engine", "--name", "engine-minilm-0"]) == "engine-minilm"
    assert role_of(["python", "-m", "zserve.workers.preprocess", "--name", "stage-minilm-0"]) == "stage-minilm"
    assert role_of(["/venv/bin/mosec", "/tmp/mosec_x/config.json"]) == "mosec"
    assert role_of(["python", "-m", "bench.serving.peer_mosec", "--port", "1"]) == "mosec-main"
    assert role_of(["python", "-m", "bench.serving.peer_streamer", "--port", "1"]) == "web"
    assert role_of(["python", "-c", "from multiprocessing.spawn import spawn_main; spawn_main()"]) == "worker"


def test_peer_backend_sets_the_embedders_backend_only():
    from bench.serving.run import peer_backend
    from zserve.config import load_config

    config = load_config("supervisor.toml")
    peers = peer_backend(config, "torch")
    by_name = {m.name: m for m in peers.models}
    assert by_name["minilm"].options["backend"] == "torch"
    assert by_name["minilm"].options["max_length"] == config.model("minilm").options["max_length"]
    assert "backend" not in by_name["echo"].options and "backend" not in config.model("minilm").options
