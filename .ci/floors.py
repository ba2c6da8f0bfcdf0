"""Print pip constraints that pin each model library, and gunicorn, at its range's floor in pyproject.toml
(`make test-floors`).

The floors are read from pyproject.toml, so a range edited there is what the floors leg tests. torch is the
exception: its floor (2.11) exists here only as a multi-GB CUDA build, so every leg keeps the CPU wheel on disk.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import tomllib

# The packages whose floors are installed; the other dependencies (pyzmq, falcon, ...) resolve as pip chooses.
MODEL_LIBRARIES = ("transformers", "sentence-transformers", "accelerate", "gguf", "pillow", "onnxruntime", "onnx",
                   "xgrammar")  # fmt: skip
# gunicorn too: the fast HTTP path uses its internals (zserve/frontends/gunicorn_internals.py), and its floor once
# admitted releases that could not serve (25, 26); the leg's default deployment test starts a frontend on it
FLOORED = (*MODEL_LIBRARIES, "gunicorn")
TORCH = "torch==2.13.0"


def floors(pyproject: Path) -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    extras = project["optional-dependencies"].values()
    requirements = [*project["dependencies"], *(r for extra in extras for r in extra)]
    pins = {}
    for req in requirements:
        # "name>=floor,<cap; marker": parsed by hand, as the python running this has no `packaging`
        name = re.match(r"[A-Za-z0-9_.-]+", req).group(0).lower()
        if name in FLOORED:
            low = re.search(r">=\s*([0-9][0-9A-Za-z.]*)", req.split(";")[0])
            if low is None:
                raise SystemExit(f"pyproject.toml: {req} has no >= floor")
            pins[name] = f"{name}=={low.group(1)}"
    missing = set(FLOORED) - set(pins)
    if missing:
        raise SystemExit(f"pyproject.toml does not name {', '.join(sorted(missing))}")
    return [TORCH, *(pins[name] for name in FLOORED)]


if __name__ == "__main__":
    print("\n".join(floors(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("pyproject.toml"))))
