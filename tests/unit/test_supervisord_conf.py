"""`zserve supervisord-conf`, read back by supervisord's own config parser (the pip `supervisor` package)."""

from __future__ import annotations

import sys

from supervisor.datatypes import RestartUnconditionally
from supervisor.options import ServerOptions

from zserve.config import parse_config
from zserve.deploy.supervisord import render

TOML = """
[supervisor]
max_restarts = 3
shutdown_timeout_s = 7

[broker]
drain_timeout_s = 4

[frontends]
graceful_timeout_s = 6

[[models]]
name = "m"
handler = "zserve.models.echo:Echo"
engines = 2
threads = 3
devices = ["cpu", "cuda:1"]
"""


def parse(text: str, tmp_path):
    path = tmp_path / "supervisord.conf"
    path.write_text(text)
    options = ServerOptions()
    options.configfile = str(path)
    options.process_config(do_usage=False)
    [group] = options.process_group_configs
    return group


def test_one_group_with_priorities_stop_times_logs_and_environment(tmp_path):
    (tmp_path / "a%b").mkdir()
    config_path = tmp_path / "a%b" / "supervisor.toml"  # supervisord expands %(x)s: the % must survive
    config_path.write_text(TOML)
    (tmp_path / "state").mkdir()
    group = parse(render(parse_config(TOML), config_path, tmp_path / "state", group="zs"), tmp_path)
    assert group.name == "zs"
    programs = {p.name: p for p in group.process_configs}
    assert set(programs) == {"broker", "engine-m-0", "engine-m-1", "frontend"}
    order = sorted(programs.values(), key=lambda p: p.priority)
    assert order[0].name == "broker" and order[-1].name == "frontend"
    assert {p.name: p.stopwaitsecs for p in order} == {
        "broker": 9, "engine-m-0": 7, "engine-m-1": 7, "frontend": 11,
    }  # fmt: skip
    for p in order:
        assert p.autorestart is RestartUnconditionally and p.stopasgroup and p.killasgroup and p.startretries == 3
        assert p.stdout_logfile == str(tmp_path / "state" / f"{p.name}.log")
        assert p.command.split() == [
            sys.executable, "-m", "zserve.cli", "child", "-c", str(config_path), p.name,
        ]  # fmt: skip
        assert p.environment["ZSERVE_SUPERVISED"] == "1" and p.directory == str(config_path.parent)
    engine1 = programs["engine-m-1"].environment
    assert engine1["CUDA_VISIBLE_DEVICES"] == "1" and engine1["OMP_NUM_THREADS"] == "3"
    assert "CUDA_VISIBLE_DEVICES" not in programs["engine-m-0"].environment
