"""One log line per event, prefixed with the process's name (``broker``, ``engine-echo-0``, ...)."""

from __future__ import annotations

import logging
import os
import sys


def setup_logging(process_name: str, level: str | None = None, *, always_name: bool = False) -> None:
    """Under the supervisor (ZSERVE_SUPERVISED=1) the supervisor prefixes each line with the process's
    name, so it is left out here unless ``always_name`` (gunicorn workers share one prefix)."""
    level = level or os.environ.get("ZSERVE_LOG_LEVEL", "INFO")
    name = "" if os.environ.get("ZSERVE_SUPERVISED") and not always_name else f"{process_name} "
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"%(asctime)s.%(msecs)03d {name}%(levelname)s %(message)s", "%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
