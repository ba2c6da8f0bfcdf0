"""Which accelerators this host has, found without importing torch (the supervisor must stay light): an
override in ``ZSERVE_GPU_COUNT``, else the NVIDIA driver's /proc entries, else ``nvidia-smi -L``."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterable
from pathlib import Path

from zserve.config import ConfigError, ModelConfig

_PROC_GPUS = Path("/proc/driver/nvidia/gpus")


def gpu_count() -> int:
    """How many CUDA devices this host has (0 on a CPU-only host)."""
    override = os.environ.get("ZSERVE_GPU_COUNT", "").strip()
    if override:
        try:
            return max(0, int(override))
        except ValueError:
            raise ConfigError(f"ZSERVE_GPU_COUNT={override!r} is not a number") from None
    if _PROC_GPUS.is_dir():
        return sum(1 for _ in _PROC_GPUS.iterdir())
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout
        except (OSError, subprocess.TimeoutExpired):
            return 0
        return sum(1 for line in out.splitlines() if line.startswith("GPU "))
    return 0


def check_devices(models: Iterable[ModelConfig], count: int | None = None) -> None:
    """Every cuda:N a model names (also inside cuda:N,M) exists on this host; a CPU-only host accepts only
    ``devices = []``."""
    needed = {m.name: [d for d in m.devices if d.startswith("cuda:")] for m in models}
    if not any(needed.values()):
        return
    count = gpu_count() if count is None else count
    for name, devices in needed.items():
        missing = [d for d in devices if max(int(i) for i in d.split(":", 1)[1].split(",")) >= count]
        if missing:
            have = f"{count} CUDA device(s)" if count else "no CUDA device (CPU only)"
            raise ConfigError(
                f"models[{name}].devices: {', '.join(missing)} not on this host, which has {have}; "
                "use devices = [] to run on the CPU (ZSERVE_GPU_COUNT overrides the count)"
            )
