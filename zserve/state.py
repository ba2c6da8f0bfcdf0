"""The supervisor's published state: RUN_DIR/state.json, rewritten atomically on every start, exit and
restart of a child, read by `zserve status`. Only `zserve up` writes it (under supervisord, supervisord
owns the process table: `supervisorctl status`)."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec

STATE_FILE = "state.json"


class ProcessState(msgspec.Struct, kw_only=True):
    name: str
    role: str  # broker | engine | stage | frontend
    pid: int
    state: str  # running | restarting
    started_at: float  # wall-clock seconds (time.time()) of the last start
    restarts: int  # since the supervisor started


class SupervisorState(msgspec.Struct, kw_only=True):
    pid: int
    url: str
    staged: list[str]  # models with preprocess stages (their readiness needs one)
    processes: list[ProcessState]


def write_state(run_dir: Path, state: SupervisorState) -> None:
    tmp = run_dir / f".{STATE_FILE}.{os.getpid()}"
    tmp.write_bytes(msgspec.json.encode(state))
    os.replace(tmp, run_dir / STATE_FILE)  # readers see the old file or the new one, never half of one


def read_state(run_dir: Path) -> SupervisorState | None:
    """The state a live supervisor published, or None (not running, or not under `zserve up`)."""
    try:
        state = msgspec.json.decode((run_dir / STATE_FILE).read_bytes(), type=SupervisorState)
    except (OSError, msgspec.DecodeError):
        return None
    try:
        os.kill(state.pid, 0)
    except ProcessLookupError:
        return None  # a supervisor killed with SIGKILL left it behind
    except PermissionError:
        pass
    return state
