"""Run a deployment under supervisord instead of `zserve up`.

``zserve supervisord-conf -c supervisor.toml`` renders a supervisord configuration with one program per
process `zserve up` would start (broker, engines, stages, the frontend server), in one group. Each program
runs ``zserve child -c supervisor.toml NAME``, which builds that process's command line exactly as `zserve
up` does and execs it (so supervisord watches the real pid, and an edit of supervisor.toml takes effect on
the next restart). What supervisord cannot express, the processes do themselves:

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
import sys
from pathlib import Path

from zserve.client import Client
from zserve.config import Config, ConfigError
from zserve.supervisor import CHILD_ENV, Child, StartupError, Supervisor

# Start order; supervisord stops in the reverse order.
PRIORITY = {"broker": 10, "stage": 20, "engine": 20, "frontend": 30}


def _escape(text: str) -> str:
    """supervisord expands %(name)s in values; a literal % is spelled %%."""
    return text.replace("%", "%%")


def _environment(env: dict[str, str]) -> str:
    """KEY="value",... as supervisord parses it (shell-like quoting)."""

    def quoted(value: str) -> str:
        return '"' + _escape(value).replace("\\", "\\\\").replace('"', '\\"') + '"'

    return ",".join(f"{key}={quoted(value)}" for key, value in sorted(env.items()))


def planned_children(sup: Supervisor) -> list[Child]:
    return [sup.broker_child(), *sup.worker_children(), sup.frontend_child()]


def stop_wait_s(config: Config, role: str) -> int:
    """How long supervisord waits after SIGTERM before SIGKILL: what `zserve up` allows each role."""
    if role == "frontend":
        return int(config.frontends.graceful_timeout_s) + 5
    if role == "broker":
        return int(config.broker.drain_timeout_s) + 5
    return int(config.supervisor.shutdown_timeout_s)


def render(config: Config, config_path: str | os.PathLike[str], state_dir: Path, group: str = "zserve") -> str:
    """The supervisord configuration. ``state_dir`` holds supervisord's socket, pid file and every log."""
    config_path = Path(config_path).resolve()
    state_dir = state_dir.resolve()
    sup = Supervisor(config, config_path)  # raises ConfigError for a broken handler, as `zserve up` does
    children = planned_children(sup)
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
            f"priority={PRIORITY[child.role]}",
            "autostart=true",
            "autorestart=true",
            "startsecs=1",
            f"startretries={config.supervisor.max_restarts}",
            "stopsignal=TERM",
            f"stopwaitsecs={stop_wait_s(config, child.role)}",
            "stopasgroup=true",  # gunicorn/granian workers, anything a child started, go with it
            "killasgroup=true",
            "redirect_stderr=true",
            f"stdout_logfile={d}/{_escape(child.name)}.log",
            "stdout_logfile_maxbytes=50MB",
            "stdout_logfile_backups=5",
            f"environment={_environment({**CHILD_ENV, **child.extra_env})}",
            "",
        ]
    return "\n".join(lines)


def _worker(sup: Supervisor, name: str) -> Child:
    """engine-MODEL-I or stage-MODEL-I, built from the name (the stage count may differ from render time)."""
    role, _, rest = name.partition("-")
    model_name, _, index = rest.rpartition("-")
    if role not in ("engine", "stage") or not index.isdigit() or model_name not in {m.name for m in sup.config.models}:
        raise ConfigError(f"no process named {name!r} in this deployment")
    model = sup.config.model(model_name)
    return sup.engine_child(model, int(index)) if role == "engine" else sup.stage_child(model, int(index))


def exec_child(config: Config, config_path: str | os.PathLike[str], name: str) -> int:
    """Become process ``name`` of the deployment (exec); returns only on failure, with an exit code."""
    sup = Supervisor(config, config_path)
    try:
        if name == "broker":
            child = sup.broker_child()
            sup.prepare_run_dir()
            os.set_inheritable(sup.lock_fd, True)  # the broker holds the run dir's lock for as long as it lives
        elif name == "frontend":
            sup.run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            with Client(sup.endpoints.client) as client:
                sup.wait_until("the broker, engines and stages", lambda: sup.engines_registered(client))
            child = sup.frontend_child()
            child.extra_env.update(sup.frontend_env())
        else:
            child = _worker(sup, name)
    except (StartupError, ConfigError) as exc:
        print(f"zserve child {name}: {exc}", file=sys.stderr, flush=True)
        return 1
    print(f"zserve child {name}: exec {child.argv[0]} {' '.join(child.argv[1:3])} ...", flush=True)
    os.execve(child.argv[0], child.argv, child.env)
    return 1  # not reached
