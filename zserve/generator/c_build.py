"""Our small C kernels (``native.py``'s decode attention, ``native_linear.py``'s products): plain C with no
torch headers, compiled on first use with the system's C compiler (``$CC`` or ``cc``) for this CPU
(``-march=native``), cached under the zserve cache folder by the hash of the source, the flags and the CPU,
and called through ctypes, which releases the GIL for the call. Without a compiler, or when the build
fails, ``build`` warns once and returns None, and the caller runs its torch path instead.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from zserve.gguf_cache import zserve_cache

log = logging.getLogger("zserve.engine")

FLAGS = ["-O3", "-march=native", "-shared", "-fPIC"]


def _cpu_id() -> str:
    """What -march=native compiles for: the machine and its CPU feature flags."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = line
                break
    except OSError:
        pass
    return f"{platform.machine()} {flags}"


def _compile(compiler: str, name: str, source: str, flags: list[str], target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        path = Path(tmp) / f"{name}.c"
        path.write_text(source)
        built = Path(tmp) / target.name
        subprocess.run(
            [compiler, *flags, "-o", str(built), str(path), "-lm"], check=True, capture_output=True, text=True,
            timeout=120,
        )  # fmt: skip
        os.replace(built, target)  # atomic: engines starting together each build, the last one wins


def build(name: str, source: str, flags: list[str], what: str) -> ctypes.CDLL | None:
    """``source`` compiled with ``flags`` and loaded, or None (with a warning naming ``what`` runs slower)."""
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        log.warning("no C compiler (%s) found: %s runs on torch (slower)", compiler, what)
        return None
    key = hashlib.sha256("\0".join([source, compiler, *flags, _cpu_id()]).encode()).hexdigest()[:16]
    target = zserve_cache() / "kernels" / f"{name}-{key}.so"
    try:
        if not target.exists():
            _compile(compiler, name, source, flags, target)
            log.info("compiled %s's kernel into %s", what, target)
        return ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or e
        log.warning("could not build %s's kernel (%s): it runs on torch (slower)", what, detail)
        return None
