"""The built-in embedding model, reporting how its batches were padded: each output carries the item's
real tokens and the length its batch was padded to, so that ``bench/cost_batching.py`` can measure padding
efficiency (real tokens / computed tokens) from the answers alone. The forward pass is the built-in one."""

from __future__ import annotations

from typing import Any

import numpy as np

from zserve.models.embedding import SentenceEmbedding


class PaddingReportingEmbedding(SentenceEmbedding):
    def cost(self, item: str) -> int:
        counts = self.count_tokens([item])
        return counts[0] if counts else max(1, len(item) // 4)

    def predict(self, batch: dict[str, np.ndarray]) -> list[Any]:
        mask = np.asarray(batch["attention_mask"])
        vectors = super().predict(batch)
        padded = int(mask.shape[1])
        return [
            {"tokens": int(row.sum()), "padded": padded, "dim": len(v)} for row, v in zip(mask, vectors, strict=True)
        ]

    def encode_response(self, output: dict[str, Any]) -> dict[str, Any]:
        return output
