"""The deployment plan (zserve.deploy.plan): which children a config yields, their command lines, environment,
readiness and order; no process is started."""

from __future__ import annotations

import signal
import sys

import pytest

from zserve.config import ConfigError, parse_config, to_toml
from zserve.deploy.plan import CHILD_ENV, plan

TOML = """
[supervisor]
run_dir = "/tmp/zs-plan-test"
shutdown_timeout_s = 7

[broker]
drain_timeout_s = 4
heartbeat_interval_ms = 100

[frontends]
workers = 3
port = 8123
graceful_timeout_s = 6

[[models]]
name = "echo"
handler = "zserve.models.echo:Echo"
engines = 2
threads = 3
devices = ["cpu", "cuda:1"]

[[models]]
name = "staged"
handler = "testmodels:Staged"
preprocess_workers = 2
"""


@pytest.fixture
def deployment(tmp_path):
    return plan(parse_config(TOML), tmp_path / "supervisor.toml")


def arg(argv, flag):
    return argv[argv.index(flag) + 1]


def test_children_in_start_order_with_roles_readiness_and_stop_order(deployment):
    children = deployment.children()
    assert [(c.name, c.role, c.ready) for c in children] == [
        ("broker", "broker", "broker"),
        ("engine-echo-0", "engine", "registered"),
        ("engine-echo-1", "engine", "registered"),
        ("engine-staged-0", "engine", "registered"),
        ("stage-staged-0", "stage", "registered"),
        ("stage-staged-1", "stage", "registered"),
        ("frontend", "frontend", "http"),
    ]
    assert [c.start_order for c in children] == sorted(c.start_order for c in children)
    order = {c.role: c.stop_order for c in children}
    assert order["frontend"] < order["broker"] < order["engine"] < order["stage"]  # the broker drains first
    assert {c.role: c.stop_timeout_s for c in children} == {"broker": 9, "engine": 7, "stage": 7, "frontend": 11}
    assert deployment.staged == ("staged",) and deployment.generative == ()
    assert deployment.url == "http://127.0.0.1:8123"


def test_command_lines_and_environment(deployment):
    broker, echo0, echo1, _, stage0, _, frontend = deployment.children()
    e = deployment.endpoints
    assert broker.argv[:3] == (sys.executable, "-m", "zserve.broker.broker")
    assert arg(broker.argv, "--client") == e.client and arg(broker.argv, "--staged-models") == "staged"
    assert echo0.argv[:3] == (sys.executable, "-m", "zserve.workers.engine")
    assert arg(echo0.argv, "--name") == "engine-echo-0" and arg(echo0.argv, "--device") == "cpu"
    assert arg(echo0.argv, "--work-endpoint") == e.work and arg(echo0.argv, "--heartbeat-interval-ms") == "100"
    assert arg(echo0.argv, "--priority-aging-ms") == "1000.0"  # [broker]'s, so that engines age sequences alike
    assert echo0.env == {"OMP_NUM_THREADS": "3"}
    assert (
        echo1.env == {"OMP_NUM_THREADS": "3", "CUDA_VISIBLE_DEVICES": "1"} and arg(echo1.argv, "--device") == "cuda:0"
    )
    assert stage0.argv[:3] == (sys.executable, "-m", "zserve.workers.preprocess") and stage0.argv[-2:] == (
        "--credits",
        "1",
    )
    assert stage0.env["CUDA_VISIBLE_DEVICES"] == ""
    assert frontend.argv[:3] == (sys.executable, "-m", "gunicorn") and arg(frontend.argv, "--bind") == "127.0.0.1:8123"
    assert arg(frontend.argv, "--workers") == "3" and frontend.pass_fds == ()
    assert frontend.leftover_signal == signal.SIGTERM and echo0.leftover_signal == signal.SIGKILL
    assert echo0.environ({"PATH": "/bin", "OMP_NUM_THREADS": "9"}) == {"PATH": "/bin", **CHILD_ENV, **echo0.env}


def test_the_frontend_serves_a_socket_the_runner_owns_and_gets_its_settings_at_start(deployment):
    served = deployment.frontend(listen_fd=7)
    assert arg(served.argv, "--bind") == "fd://7" and served.pass_fds == (7,)
    env = deployment.frontend_env("k")
    assert env["PROMETHEUS_MULTIPROC_DIR"] == str(deployment.metrics_dir)
    assert '"probe_key":"k"' in env["ZSERVE_FRONTEND"] and '"preprocess":true' in env["ZSERVE_FRONTEND"]


def test_a_child_by_name_any_index_and_unknown_names(deployment):
    assert deployment.child("stage-staged-5").argv == deployment.stage(deployment.config.model("staged"), 5).argv
    assert deployment.child("broker") == deployment.broker()
    for name in ("engine-nope-0", "engine-echo-x", "worker-echo-0"):
        with pytest.raises(ConfigError, match="no process named"):
            deployment.child(name)


def test_a_worker_host_runs_only_its_workers_named_for_the_host_with_nothing_to_wait_for(deployment):
    from dataclasses import replace

    host = replace(deployment, worker_host="gpu7", worker_args=("--curve-key", "k"))
    children = host.children()
    assert {c.role for c in children} == {"engine", "stage"} and {c.ready for c in children} == {""}
    assert children[0].name == "engine-echo-0@gpu7" and arg(children[0].argv, "--name") == "engine-echo-0@gpu7"
    assert children[0].argv[-2:] == ("--curve-key", "k")


def test_a_worker_hosts_engines_age_sequences_as_its_broker_section_says(tmp_path):
    from zserve.deploy.worker_host import load_workers_config, worker_host_plan

    path = tmp_path / "workers.toml"
    path.write_text(
        '[broker]\nwork_endpoint = "tcp://10.0.0.1:5556"\nout_endpoint = "tcp://10.0.0.1:5557"\ninsecure = true\n'
        'priority_aging_ms = 250\n\n[[models]]\nname = "echo"\nhandler = "zserve.models.echo:Echo"\n'
    )
    [engine] = worker_host_plan(load_workers_config(path), path).children()
    assert arg(engine.argv, "--priority-aging-ms") == "250.0"


def test_a_broken_handler_fails_the_plan_by_name(tmp_path):
    with pytest.raises(ConfigError, match=r"models\[bad\]"):
        plan(parse_config('[[models]]\nname = "bad"\nhandler = "nowhere.at_all:Model"\n'), tmp_path / "s.toml")


def test_granian_was_removed_with_a_message_naming_the_field():
    with pytest.raises(ConfigError, match=r"frontends.server = 'granian': the granian frontend server was removed"):
        parse_config('[frontends]\nserver = "granian"\n[[models]]\nname = "m"\nhandler = "a:B"\n')
    # Files that `zserve serve --print-config` wrote before say server = "gunicorn": still loaded, with a warning.
    with pytest.warns(FutureWarning, match=r"s.toml: frontends.server is deprecated and ignored"):
        config = parse_config('[frontends]\nserver = "gunicorn"\n[[models]]\nname = "m"\nhandler = "a:B"\n', "s.toml")
    assert not hasattr(config.frontends, "server") and "server" not in to_toml(config)
