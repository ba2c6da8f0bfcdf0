"""One entry point per suite: ``python -m bench.SUITE [SCENARIO] [options]``. The scenario is a subcommand (the
suite's first one when left out); the options are that scenario's own, as its module's ``main`` parses them."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import NamedTuple


class Scenario(NamedTuple):
    module: str  # its ``main(argv)`` runs it; the module also runs alone as ``python -m MODULE``
    summary: str


def dispatch(suite: str, scenarios: dict[str, Scenario], argv: list[str] | None = None) -> int | None:
    """Run the scenario named first in ``argv`` (else the first of ``scenarios``) with the rest of ``argv``."""
    argv = sys.argv[1:] if argv is None else argv
    default = next(iter(scenarios))
    if argv and argv[0] in ("-h", "--help"):
        print(f"python -m bench.{suite} [SCENARIO] [options]; SCENARIO (default {default}):")
        for name, scenario in scenarios.items():
            print(f"  {name:<14} {scenario.summary}")
        print(f"`python -m bench.{suite} SCENARIO --help` lists a scenario's options; those of {default}:\n")
    name = argv[0] if argv and argv[0] in scenarios else default
    rest = argv[1:] if argv and argv[0] == name else argv
    sys.argv[0] = f"python -m bench.{suite}" + ("" if name == default else f" {name}")  # argparse's usage line
    main: Callable[[list[str]], int | None] = importlib.import_module(scenarios[name].module).main
    return main(rest)
