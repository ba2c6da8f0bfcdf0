"""Where things are: the repo, the virtualenv the bench runs in, and the bench folder itself."""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
VENV_BIN = Path(sys.executable).parent  # `zserve` and `gunicorn` are installed next to this interpreter
RESULTS = BENCH / "results"
