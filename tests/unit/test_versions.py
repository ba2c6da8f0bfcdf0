"""The library versions every worker logs at start and sends in its Hello, and `zserve status` shows."""

from __future__ import annotations

import sentence_transformers
import torch
import transformers

from zserve.broker.core import BrokerCore
from zserve.config import parse_config
from zserve.deploy.status import version_lines
from zserve.protocol import HealthQuery, HealthReport, Hello, ModelHealth
from zserve.versions import library_versions

CONFIG = """
[[models]]
name = "m"
handler = "x:Y"
"""


def test_the_line_names_the_versions_the_libraries_report_of_themselves():
    assert library_versions() == (f"torch {torch.__version__}, transformers {transformers.__version__}, "
                                  f"sentence-transformers {sentence_transformers.__version__}")  # fmt: skip


def test_the_broker_reports_its_engines_versions_each_distinct_line_once():
    core = BrokerCore(parse_config(CONFIG), epoch=1, first_batch_id=1)
    for worker, versions in ((b"a", "torch 2.13.0"), (b"b", "torch 2.13.0"), (b"c", "torch 2.14.1"), (b"d", "")):
        core.on_work(worker, Hello(worker.decode(), 1, "engine", ["m"], 2, versions=versions), 0.0)
    core.on_work(b"s", Hello("s", 1, "preprocess", ["m"], 2, versions="torch 9"), 0.0)  # a stage: not an engine
    core.flush()
    core.on_client(b"h", HealthQuery(1), [], 0.0)
    clients, _ = core.flush()
    [report] = [c.header for c in clients if isinstance(c.header, HealthReport)]
    [health] = report.models
    assert health.versions == ["torch 2.13.0", "torch 2.14.1"]  # an engine from before this field sends ""
    assert version_lines(report) == ["engines of m: torch 2.13.0", "engines of m: torch 2.14.1"]


def test_status_shows_no_line_for_a_model_without_engines():
    assert version_lines(HealthReport(1, 1, False, [ModelHealth("m", 0, 0, 0)])) == []
