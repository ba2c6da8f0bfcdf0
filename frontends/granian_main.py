"""``python -m zserve.frontends.granian_main GRANIAN-ARGS``: granian's own CLI, started by the supervisor
when ``[frontends] server = "granian"``. The one thing it adds is dying with its parent (as gunicorn's
``on_starting`` hook does), so no frontend outlives ``zserve up``."""

from __future__ import annotations

from granian.cli import entrypoint

from zserve.transport import die_with_parent

if __name__ == "__main__":  # granian's spawned workers import this module as __mp_main__: only the master runs
    die_with_parent()
    entrypoint()
