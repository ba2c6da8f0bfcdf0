"""``--isa`` for the kernel studies (``linear``, ``step``, ``attention``): measure as on a CPU with a smaller
instruction set than this one, from this machine. Each ISA runs in its own process, with our kernels built
for it (``ZSERVE_CPU_ISA``: AVX2 through ``-march=haswell``) and oneDNN, MKL and ATen capped to it
(``c_build.CAPPED``: ``ONEDNN_MAX_CPU_ISA=AVX2``, ``MKL_ENABLE_INSTRUCTIONS=AVX2``, ``ATEN_CPU_CAPABILITY=avx2``),
which must be set before torch loads, hence the process. ``native``: this CPU as it is.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from zserve.generator import c_build

CHOICES = ("native", *c_build.ISAS)


def add_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--isa", default="native",
                   help=f"a comma list of {', '.join(CHOICES)}: each measured in its own process, our kernels built "
                        "for it and oneDNN/MKL/ATen capped to it (default %(default)s: this CPU as is)")  # fmt: skip


def parse(value: str) -> list[str]:
    isas = [v for v in value.split(",") if v]
    for v in isas:
        if v not in CHOICES:
            raise SystemExit(f"--isa {v!r}: not one of {', '.join(CHOICES)}")
    return isas


def current() -> str:
    return os.environ.get("ZSERVE_CPU_ISA") or "native"


def describe() -> str:
    """What this process runs as: the ISA our kernels are built for, and the caps in its environment."""
    caps = {k: os.environ[k] for k in ("ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "ATEN_CPU_CAPABILITY")
            if k in os.environ}  # fmt: skip
    return f"kernels for {c_build.isa().name} ({' '.join(c_build.isa().march) or 'no -march'}), caps {caps or 'none'}"


def cpu() -> str:
    """The CPU's model name and its vector flags, for every figure's caption."""
    model, flags = "", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
            if line.startswith(("flags", "Features")) and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    vector = sorted(f for f in flags if f.startswith(("avx", "fma", "amx", "sse4", "asimd", "sve")))
    return f"{model or 'unknown CPU'}, {os.cpu_count()} cores; {' '.join(vector)}"


def delegate(module: str, argv: list[str], isas: list[str], out: Path) -> list[tuple[str, dict]] | None:
    """None when this process is the one to measure (one ISA, the one it runs as). Otherwise each ISA this CPU
    runs is measured by ``python -m module argv --isa ISA --out out-ISA.json`` in its own capped process (its
    output passes through), and the results come back as (isa, json) pairs; an ISA this CPU cannot run is
    skipped with the reason."""
    if isas == [current()]:
        return None
    results = []
    for isa in isas:
        if isa != "native" and isa not in c_build.runnable():
            print(f"--isa {isa}: skipped, this CPU runs only {', '.join(c_build.runnable())}", flush=True)
            continue
        env = dict(os.environ)
        for key in ("ZSERVE_CPU_ISA", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "ATEN_CPU_CAPABILITY"):
            env.pop(key, None)
        if isa != "native":
            env |= {"ZSERVE_CPU_ISA": isa, **c_build.CAPPED[isa]}
        target = out.with_name(f"{out.stem}-{isa}{out.suffix}")
        print(f"== --isa {isa}", flush=True)
        subprocess.run([sys.executable, "-m", module, *_without_isa(argv), "--isa", isa, "--out", str(target)],
                       env=env, check=True)  # fmt: skip
        results.append((isa, json.loads(target.read_text())))
    return results


def _without_isa(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--isa", "--out"):
            skip = True
        elif not a.startswith(("--isa=", "--out=")):
            out.append(a)
    return out
