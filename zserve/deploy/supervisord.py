"""Run a deployment under supervisord instead of `zserve up`.

``zserve supervisord-conf -c supervisor.toml`` renders a supervisord configuration with one program per
process `zserve up` would start (broker, engines, stages, the frontend server), in one group. Each program
runs ``zserve child -c supervisor.toml NAME``, which takes that process from the plan `zserve up` runs
(``zserve.deploy.plan``) and execs it (so supervisord watches the real pid, and an edit of supervisor.toml takes
effect on the next restart). What supervisord cannot express, the processes do themselves:

- start order: priorities start broker (10), then stages and engines (20), then the frontend (30); stops
  go the other way;
- readiness: the frontend's ``zserve child`` waits, before it execs the HTTP server, until the broker
  answers and every engine and stage has registered (the same probe `zserve up` uses), never a sleep;
- the run dir: the broker's ``zserve child`` creates it (0700) and takes the same lock `zserve up` takes,
  handing it to the broker across exec, so the two never run from one run dir at once.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path

from zserve.client import Client
from zserve.config import Config, ConfigError
from zserve.deploy.plan import ChildSpec, plan
from zserve.deploy.supervisor import StartupError, lock_run_dir, wait_for, workers_registered


def priority(spec: ChildSpec) -> int:
    """supervisord's priority: the plan's start order (broker 10, stages and engines 20, frontend 30);
    supervisord stops in the reverse order."""
    return 10 * (spec.start_order + 1)


def _escape(text: str) -> str:
    """supervisord expands %(name)s in values; a literal % is spelled %%."""
    return text.replace("%", "%%")


def _environment(env: dict[str, str]) -> str:
    """KEY="value",... as supervisord parses it (shell-like quoting)."""

    def quoted(value: str) -> str:
        return '"' + _escape(value).replace("\\", "\\\\").replace('"', '\\"') + '"'

    return ",".join(f"{key}={quoted(value)}" for key, value in sorted(env.items()))


def render(config: Config, config_path: str | os.PathLike[str], state_dir: Path, group: str = "zserve") -> str:
    """The supervisord configuration. ``state_dir`` holds supervisord's socket, pid file and every log."""
    config_path = Path(config_path).resolve()
    state_dir = state_dir.resolve()
    children = plan(config, config_path).children()  # raises ConfigError for a broken handler, as `zserve up` does
    d = _escape(str(state_dir))
    lines = [
        f"; supervisord configuration for {config_path}, rendered by `zserve supervisord-conf`.",
        f"; start: supervisord -c THIS_FILE; control: supervisorctl -c THIS_FILE status|restart {group}:NAME",
        "; Render again after changing the models or the number of engines; other edits of supervisor.toml",
        "; take effect when the process restarts (each program reads supervisor.toml when it starts).",
        "",
        "[unix_http_server]",
        f"file={d}/supervisord.sock",
        "chmod=0700",
        "",
        "[supervisord]",
        f"logfile={d}/supervisord.log",
        f"pidfile={d}/supervisord.pid",
        f"childlogdir={d}",
        "",
        "[rpcinterface:supervisor]",
        "supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface",
        "",
        "[supervisorctl]",
        f"serverurl=unix://{d}/supervisord.sock",
        "",
        f"[group:{group}]",
        f"programs={','.join(c.name for c in children)}",
        "",
    ]
    for child in children:
        command = [sys.executable, "-m", "zserve.cli", "child", "-c", str(config_path), child.name]
        lines += [
            f"[program:{child.name}]",
            f"command={_escape(shlex.join(command))}",
            f"directory={_escape(str(config_path.parent))}",  # handler modules next to the config import
            f"priority={priority(child)}",
            "autostart=true",
            "autorestart=true",
            "startsecs=1",
            f"startretries={config.supervisor.max_restarts}",
            "stopsignal=TERM",
            f"stopwaitsecs={int(child.stop_timeout_s)}",  # what `zserve up` allows each role
            "stopasgroup=true",  # gunicorn's workers, anything a child started, go with it
            "killasgroup=true",
            "redirect_stderr=true",
            f"stdout_logfile={d}/{_escape(child.name)}.log",
            "stdout_logfile_maxbytes=50MB",
            "stdout_logfile_backups=5",
            f"environment={_environment(child.environ({}))}",
            "",
        ]
    return "\n".join(lines)


def exec_child(config: Config, config_path: str | os.PathLike[str], name: str) -> int:
    """Become process ``name`` of the deployment (exec); returns only on failure, with an exit code."""
    deployment = plan(config, config_path)
    env = dict(os.environ)
    try:
        child = deployment.child(name)
        if name == "broker":
            lock = lock_run_dir(deployment.run_dir)
            os.set_inheritable(lock.fileno(), True)  # the broker holds the run dir's lock for as long as it lives
        elif name == "frontend":
            deployment.run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            with Client(deployment.endpoints.client) as client:
                ready = lambda: workers_registered(client, deployment)  # noqa: E731
                wait_for("the broker, engines and stages", ready, config.supervisor.startup_timeout_s)
            env.update(deployment.frontend_env(probe_key=""))
            metrics_dir = deployment.metrics_dir
            shutil.rmtree(metrics_dir, ignore_errors=True)
            metrics_dir.mkdir(mode=0o700)
    except (StartupError, ConfigError) as exc:
        print(f"zserve child {name}: {exc}", file=sys.stderr, flush=True)
        return 1
    print(f"zserve child {name}: exec {child.argv[0]} {' '.join(child.argv[1:3])} ...", flush=True)
    os.execve(child.argv[0], child.argv, child.environ(env))
    return 1  # not reached
