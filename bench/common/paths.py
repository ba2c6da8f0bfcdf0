"""Where things are: the repo, the virtualenv the bench runs in, and the bench folder itself."""

from __future__ import annotations

import os
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent
REPO = BENCH.parent
VENV_BIN = Path(sys.executable).parent  # `zserve` and `gunicorn` are installed next to this interpreter
RESULTS = BENCH / "results"


def with_repo_path(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) with the repo root first on PYTHONPATH, so that a child started as
    ``python -m bench.SUITE.MODULE``, or an engine whose handler lives in bench/, imports the bench package whatever
    its working directory."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env
