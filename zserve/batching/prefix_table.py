"""The index of the engines' prefix caches in C: ``PrefixIndex``'s contents and answers for at most 64 engines,
with the router's prompts in flight and counters kept too, so a request's dispatch (its choice of engine, the
sequence then in flight there, the count), a finished batch and a step's deltas are one call each. With 64
engines routing adds ~4-4.5 us of broker CPU a request on this index with nothing in flight (the packed hashes'
decode included) and the router's calls cost ~3-4.5 us with 64 sequences in flight (the dict index's: ~10-19),
and this index takes at most 80 bytes a cached block where the dict index takes 168
(bench/results/35-broker-cost.md).

A CPython extension module (``prefix_table_c.SOURCE``, plain C, the CPython API only), compiled on first use with
the system's C compiler (``$CC`` or ``cc``, as our kernels are: ``zserve.generator.c_build``, whose compile step
imports nothing heavy) against this Python's headers, and cached under the zserve cache folder by the hash of
the source, the flags and the Python build, and checked against its seal (size, sha256) before it is loaded (a
damaged file is built again). Without a compiler or the headers, or if the build fails or passes 20 s,
``native_index`` warns once and returns None, and the broker keeps the dict index (``PrefixIndex``).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import secrets
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import ModuleType

from zserve.batching.prefix_index import bound
from zserve.batching.prefix_table_c import SOURCE
from zserve.generator.c_build import cached, compiler
from zserve.gguf_cache import zserve_cache

log = logging.getLogger("zserve.broker")

NAME = "_zserve_prefix_table"  # the module's name, as its PyInit_ function says
FLAGS = ["-O2", "-shared", "-fPIC"]  # no -march: the broker's index gains nothing from vectors
MAX_ENGINES = 64  # a mask is one uint64
# A build takes 0.4-0.9 s: a compiler that hangs must not hold the broker's start-up past its liveness probe
# (Kubernetes would restart it, to hang again); the dict index serves instead.
BUILD_TIMEOUT_S = 20.0


def _target(cc: str, flags: list[str]) -> Path:
    build = "\0".join([SOURCE, cc, *flags, sys.version, sysconfig.get_config_var("EXT_SUFFIX") or ""])
    key = hashlib.sha256(build.encode()).hexdigest()[:16]
    return zserve_cache() / "kernels" / f"{NAME}-{key}{sysconfig.get_config_var('EXT_SUFFIX') or '.so'}"


def _load(path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(NAME, str(path))
    spec = importlib.util.spec_from_file_location(NAME, path, loader=loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def buildable() -> bool:
    """Whether this machine has what the build needs (a C compiler and this Python's headers): where it does, a
    build that fails is a defect (the tests fail on it, not skip), and ``ZSERVE_REQUIRE_C_INDEX=1`` says so too."""
    return os.environ.get("ZSERVE_REQUIRE_C_INDEX") == "1" or (
        shutil.which(compiler()) is not None and (Path(sysconfig.get_paths()["include"]) / "Python.h").exists()
    )


@functools.cache
def module() -> ModuleType | None:
    """The extension module, built if this build of it is not in the cache yet; None (warned once) if it cannot
    be: the dict index serves then."""
    cc, include = compiler(), sysconfig.get_paths()["include"]
    if shutil.which(cc) is None:
        log.warning("no C compiler (%s) found: the routing index runs in Python (slower)", cc)
        return None
    if not (Path(include) / "Python.h").exists():
        log.warning("no Python headers (%s/Python.h): the routing index runs in Python (slower)", include)
        return None
    # an extension's CPython symbols are the running interpreter's: macOS's linker must be told to leave them open
    flags = [*FLAGS, f"-I{include}", *(["-undefined", "dynamic_lookup"] if sys.platform == "darwin" else [])]
    target = _target(cc, flags)
    try:
        return cached(cc, NAME, SOURCE, flags, target, _load, BUILD_TIMEOUT_S)
    except (OSError, ImportError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or e
        log.warning("could not build the routing index (%s): it runs in Python (slower)", detail)
        return None


@functools.cache
def native_index() -> type | None:
    """The C index's class (a subclass adding ``PrefixIndex``'s conveniences), or None where it cannot be built."""
    built = module()
    if built is None:
        return None

    class CPrefixIndex(built.Index):  # type: ignore[misc,name-defined]
        """``PrefixIndex`` in C (``prefix_table_c``), with the router's prompts in flight (``routing.NativeInFlight``
        reads them) and counters; ``route`` is ``PrefixRouter.route``'s decision, ``dispatch`` its ``dispatch``,
        ``export`` what ``PrefixIndex.restore`` takes. ``reset`` raises OverflowError for a 65th engine (the router
        then moves to the dict index)."""

        __slots__ = ()

        def __new__(cls, seed: int | None = None) -> CPrefixIndex:
            """``seed``: what keys the table's home slots, random unless given (tests); see ``prefix_table_c``."""
            return super().__new__(cls, secrets.randbits(64) if seed is None else seed)

        def reset(self, engine: bytes, hashes: Iterable[int], kv_blocks: int = 0) -> None:
            self._reset(engine, hashes, bound(kv_blocks))

        def holders(self, h: int) -> list[bytes]:
            return self.engines_in(self.mask(h))

        def matches(self, hashes: Sequence[int], engines: Iterable[bytes]) -> dict[bytes, int]:
            return {e: self.longest(hashes, self.bit(e))[0] for e in engines}

        def holds(self, engine: bytes, h: int) -> bool:
            return bool(self.mask(h) & self.bit(engine))

    return CPrefixIndex
