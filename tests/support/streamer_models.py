"""Picklable models for Streamer(processes=N) tests (spawned processes import this module)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from zserve import Model


class PidModel(Model):
    """Records the pid of every process that runs setup in ``log_dir``; answers (item, pid, batch size)."""

    def __init__(self, log_dir: str = "") -> None:
        super().__init__(log_dir=log_dir)
        self.log_dir = log_dir

    def setup(self, device: str) -> None:
        Path(self.log_dir, f"setup-{os.getpid()}").write_text(f"{device} {os.environ.get('CUDA_VISIBLE_DEVICES', '-')}")

    def predict(self, batch: list[Any]) -> list[Any]:
        if "raise" in batch:
            raise KeyError("raise was in the batch")
        return [(item, os.getpid(), len(batch)) for item in batch]
