"""``zserve.models.echo:Echo``: returns each input unchanged. Measures the serving path itself."""

from __future__ import annotations

from typing import Any

from zserve.model import Model


class Echo(Model):
    def predict(self, batch: list[Any]) -> list[Any]:
        return batch
