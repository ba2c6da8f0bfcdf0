"""Models for the overlap benchmark (bench/studies/overlap.py): CPU work that holds a core, and "device" time that
does not (a sleep standing in for a GPU kernel)."""

from __future__ import annotations

import time
from typing import Any

from zserve import Model
from zserve.models.embedding import SentenceEmbedding


def burn(ms: float) -> None:
    """Hold a core for ``ms`` milliseconds (pure Python, holds the GIL)."""
    end = time.perf_counter() + ms / 1000.0
    while time.perf_counter() < end:
        pass


class BurnInline(Model):
    """``burn_ms`` of CPU per item, then ``device_ms`` per batch, serially inside the engine (no stage)."""

    def __init__(self, burn_ms: float = 1.0, device_ms: float = 32.0) -> None:
        super().__init__(burn_ms=burn_ms, device_ms=device_ms)
        self.burn_ms = float(burn_ms)
        self.device_ms = float(device_ms)

    def predict(self, batch: list[Any]) -> list[Any]:
        for _ in batch:
            burn(self.burn_ms)
        time.sleep(self.device_ms / 1000.0)
        return batch


class BurnStaged(BurnInline):
    """The same work split: the CPU part in ``preprocess`` on a stage, the device part in ``predict``."""

    def preprocess(self, items: list[Any]) -> list[Any]:
        for _ in items:
            burn(self.burn_ms)
        return items

    def predict(self, batch: list[Any]) -> list[Any]:
        time.sleep(self.device_ms / 1000.0)
        return batch


class InlineEmbedding(SentenceEmbedding):
    """The built-in embedding model with tokenisation back inside the engine (no stage)."""

    preprocess = Model.preprocess  # not overridden any more: no stage

    def setup(self, device: str) -> None:
        SentenceEmbedding.setup_preprocess(self)
        super().setup(device)

    def warmup(self) -> None:
        self.predict(["warm up the encoder"])

    def predict(self, batch: list[str]) -> list[Any]:
        return super().predict(SentenceEmbedding.preprocess(self, batch))
