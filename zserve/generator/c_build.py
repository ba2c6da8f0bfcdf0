"""Our small C kernels (``native.py``'s decode attention, ``native_linear.py``'s products): plain C with no
torch headers, compiled on first use with the system's C compiler (``$CC`` or ``cc``) for an instruction set
(``Isa``: AVX-512, AVX2 or portable; this CPU's best with ``-march=native`` unless ``$ZSERVE_CPU_ISA`` names
a lower one), cached under the zserve cache folder by the hash of the source, the flags and the CPU, and
called through ctypes, which releases the GIL for the call. Without a compiler, or when the build fails,
``build`` warns once and returns None, and the caller runs its torch path instead.

``ZSERVE_CPU_ISA=avx2`` on an AVX-512 machine builds every kernel as an AVX2-only CPU would (``-march=haswell``):
with ``ONEDNN_MAX_CPU_ISA=AVX2``, ``MKL_ENABLE_INSTRUCTIONS=AVX2`` and ``ATEN_CPU_CAPABILITY=avx2`` (``CAPPED``)
the whole engine then runs as it would there, which is how the AVX2 figures are made on one machine.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TypeVar

from zserve.gguf_cache import zserve_cache

log = logging.getLogger("zserve.engine")
T = TypeVar("T")

FLAGS = ["-O3", "-march=native", "-shared", "-fPIC"]


@dataclass(frozen=True)
class Isa:
    """An instruction set the kernels are built for: its compiler flags, the floats in one vector register
    and how many such registers there are (what a kernel's tiles must fit in, or spill)."""

    name: str
    march: tuple[str, ...]
    width: int
    registers: int

    @property
    def flags(self) -> list[str]:
        return ["-O3", *self.march, "-shared", "-fPIC"]


# AVX-512: 32 zmm of 16 floats; AVX2/FMA: 16 ymm of 8 (-march=haswell, the first CPUs with both); portable:
# 4-float vectors in 16 registers (SSE2's xmm, half of NEON's 32), for anything else, aarch64 included
ISAS = {
    "avx512": Isa("avx512", ("-march=x86-64-v4",), 16, 32),
    "avx2": Isa("avx2", ("-march=haswell",), 8, 16),
    "portable": Isa("portable", (), 4, 16),
}
# what also caps oneDNN, MKL and ATen to an ISA, so a process measures as an AVX2-only CPU would
CAPPED = {
    "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"},
    "avx512": {},
    "portable": {"ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "ATEN_CPU_CAPABILITY": "default"},
}


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def runnable() -> list[str]:
    """The instruction sets this CPU runs, best first."""
    flags, x86 = _cpu_flags(), platform.machine() in ("x86_64", "AMD64")
    names = []
    if x86 and {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"} <= flags:
        names.append("avx512")
    if x86 and {"avx2", "fma", "f16c", "bmi2"} <= flags:
        names.append("avx2")
    return [*names, "portable"]


def isa() -> Isa:
    """The instruction set the kernels are built for here: this CPU's best (tuned for it, ``-march=native``),
    or ``$ZSERVE_CPU_ISA`` where that names one this CPU runs (a lower one, to measure as on a smaller CPU)."""
    best = runnable()[0]
    name = os.environ.get("ZSERVE_CPU_ISA", "") or best
    if name not in ISAS or name not in runnable():
        log.warning("ZSERVE_CPU_ISA=%s is not one this CPU runs (%s): building for %s", name, runnable(), best)
        name = best
    return for_name(name)


def for_name(name: str) -> Isa:
    """``ISAS[name]``, built for this CPU with ``-march=native`` where it is this CPU's best."""
    chosen = ISAS[name]
    return replace(chosen, march=("-march=native",)) if name == runnable()[0] else chosen


def _cpu_id() -> str:
    """What -march=native compiles for: the machine, its CPU's model name and feature flags."""
    lines = []
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        pass
    model = next((line for line in lines if line.startswith("model name")), "")
    flags = next((line for line in lines if line.startswith(("flags", "Features"))), "")
    return f"{platform.machine()} {model} {flags}"


def _compile(compiler: str, name: str, source: str, flags: list[str], target: Path, timeout_s: float = 120.0) -> None:
    """Build ``target`` from ``source``: into a temporary name beside it, flushed to disk, then moved in place
    (atomic: processes starting together each build, the last one wins), then its seal (size and sha256) beside
    it, which ``cached`` checks before loading: a file cut short (a crash after the build, a bad copy) is never
    mapped (dlopen of a truncated file dies of SIGBUS)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        path = Path(tmp) / f"{name}.c"
        path.write_text(source)
        built = Path(tmp) / target.name
        _run([compiler, *flags, "-o", str(built), str(path), "-lm"], timeout_s)
        with open(built, "rb") as f:
            data = f.read()
            os.fsync(f.fileno())
        os.replace(built, target)
        seal = Path(tmp) / "seal"
        seal.write_text(f"{len(data)} {hashlib.sha256(data).hexdigest()}\n")
        os.replace(seal, _seal_of(target))


def _run(command: list[str], timeout_s: float) -> None:
    """``subprocess.run(check=True)``, whose timeout kills the compiler's whole process group: killing only the
    driver would leave its cc1 or as running."""
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as p:  # fmt: skip
        try:
            out, err = p.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):  # it may have ended just now
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            raise
    if p.returncode:
        raise subprocess.CalledProcessError(p.returncode, command, out, err)


def _seal_of(target: Path) -> Path:
    return target.with_name(target.name + ".sha256")


def _intact(target: Path) -> bool:
    """Whether ``target`` is what its build wrote: its size and sha256 as its seal says."""
    try:
        size, digest = _seal_of(target).read_text().split()
        data = target.read_bytes()
    except (OSError, ValueError):
        return False
    return len(data) == int(size) and hashlib.sha256(data).hexdigest() == digest


def cached(
    compiler: str, name: str, source: str, flags: list[str], target: Path, load: Callable[[Path], T],
    timeout_s: float = 120.0,
) -> T:  # fmt: skip
    """``load(target)``, built first where it is missing or damaged (no seal, or one it does not match), and
    built again once where it does not load. Raises what the build or the load raises."""
    built = not _intact(target)
    if built:
        _compile(compiler, name, source, flags, target, timeout_s)
        log.info("compiled %s into %s", name, target)
    try:
        return load(target)
    except (OSError, ImportError) as e:
        if built:
            raise
        log.warning("the cached %s (%s) would not load (%s): building it again", name, target, e)
        _compile(compiler, name, source, flags, target, timeout_s)
        return load(target)


def compiler() -> str:
    """The C compiler the kernels are built with: ``$CC``, else ``cc``."""
    return os.environ.get("CC") or "cc"


def has_compiler() -> bool:
    return shutil.which(compiler()) is not None


def build(name: str, source: str, flags: list[str], what: str) -> ctypes.CDLL | None:
    """``source`` compiled with ``flags`` and loaded, or None (with a warning naming ``what`` runs slower)."""
    cc = compiler()
    if shutil.which(cc) is None:
        log.warning("no C compiler (%s) found: %s runs on torch (slower)", cc, what)
        return None
    key = hashlib.sha256("\0".join([source, cc, *flags, _cpu_id()]).encode()).hexdigest()[:16]
    target = zserve_cache() / "kernels" / f"{name}-{key}.so"
    try:
        return cached(cc, name, source, flags, target, lambda path: ctypes.CDLL(str(path)))
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or e
        log.warning("could not build %s's kernel (%s): it runs on torch (slower)", what, detail)
        return None


def vectors(width: int) -> str:
    """What every kernel's source starts with: ``vf``, ``width`` floats, one register of the ISA it is built
    for (``Isa.width``; ``VW`` in the source), through GCC/clang vector extensions, and ``vfi`` its int32 lanes;
    ``vload``/``vstore`` at any float's address, ``vselect``, ``vexp`` (Cephes' expf polynomial, within 2 ulp),
    ``vhsum`` (one vector's lanes summed) and ``vsums`` (``VW`` vectors' lane sums at once, a tree of
    shuffles: ~3 operations per sum where summing each alone costs ~10)."""
    levels, code, src, k = [], [], "p", 1
    while k < width:
        half = width // (2 * k)
        lanes = [[(base + j + extra) + (width if h else 0) for base in range(0, width, 2 * k) for h in (0, 1)
                  for j in range(k)] for extra in (0, k)]  # fmt: skip
        name = f"s{len(levels) + 1}"
        masks = [", ".join(map(str, m)) for m in lanes]
        shuf = " + ".join(f"SHUF({src}[2 * i], {src}[2 * i + 1], {m})" for m in masks)
        code.append(f"    vf {name}[{half}];\n    for (int i = 0; i < {half}; i++) {name}[i] = {shuf};")
        levels.append(name)
        src, k = name, k * 2
    body = "\n".join(code) + f"\n    return {src}[0];" if code else "    return p[0];"
    return f"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#define VW {width}
typedef float vf __attribute__((vector_size({4 * width})));
typedef float vfu __attribute__((vector_size({4 * width}), aligned(4)));
typedef int32_t vfi __attribute__((vector_size({4 * width})));
static inline vf vload(const float *p) {{ return *(const vfu *)p; }}
static inline void vstore(float *p, vf x) {{ *(vfu *)p = x; }}
static inline vf vselect(vfi m, vf a, vf b) {{ return (vf)(((vfi)a & m) | ((vfi)b & ~m)); }}
static inline float vhsum(vf x) {{
    float s = 0.f;
    for (int i = 0; i < VW; i++) s += x[i];
    return s;
}}
#ifdef __clang__
#define SHUF(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUF(a, b, ...) __builtin_shuffle(a, b, (vfi){{__VA_ARGS__}})
#endif
static inline vf vsums(const vf *p) {{
{body}
}}
/* exp(x), VW at a time: Cephes' expf polynomial (within 2 ulp of expf), x clamped to where fp32 has one */
static inline vf vexp(vf x) {{
    const vf zero = {{0}}, lo = zero - 87.3f, hi = zero + 88.7f;
    x = vselect(x < lo, lo, vselect(x > hi, hi, x));
    const vf y = x * 1.44269504088896341f + 0.5f;
    vf n = __builtin_convertvector(__builtin_convertvector(y, vfi), vf); /* towards zero, then floor: */
    n -= vselect(n > y, zero + 1.f, zero);
    const vf r = x - n * 0.693359375f + n * 2.12194440e-4f;
    vf p = zero + 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    return p * (vf)((__builtin_convertvector(n, vfi) + 127) << 23);
}}
"""
