"""The versions of the libraries a model runs on, for the line every worker logs when it starts and for
``zserve status`` (engines send theirs in their Hello): a bug report then names them."""

from __future__ import annotations

import functools
from importlib.metadata import PackageNotFoundError, version

LIBRARIES = ("torch", "transformers", "sentence-transformers")


@functools.cache  # sent in every Hello; a worker's libraries do not change while it runs
def library_versions() -> str:
    """``"torch 2.13.0+cpu, transformers 5.25.0, sentence-transformers 6.3.0"``: the installed distributions'
    versions (``absent`` for one not installed), read from their metadata without importing them."""
    parts = []
    for name in LIBRARIES:
        try:
            parts.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            parts.append(f"{name} absent")
    return ", ".join(parts)
