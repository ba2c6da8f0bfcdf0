"""The built-in embedding model, reporting how its batches were padded: each output carries the item's
real tokens and the length its group was padded to, so that ``bench/studies/cost_batching.py`` can measure padding
efficiency (real tokens / computed tokens) from the answers alone. The forward pass is the built-in one."""

from __future__ import annotations

from typing import Any

from zserve.models.embedding import SentenceEmbedding


class PaddingReportingEmbedding(SentenceEmbedding):
    def cost(self, item: Any) -> int:
        # cost_batching.workload asks with a plain text; deployments with the decoded item
        return super().cost(self.decode_request({"text": item}) if isinstance(item, str) else item)

    def predict(self, batch: dict[str, Any]) -> list[Any]:
        widths = {
            row: group["features"]["attention_mask"].shape[1] for group in batch["groups"] for row in group["rows"]
        }
        return [
            output if isinstance(output, Exception)
            else {"tokens": output["tokens"], "padded": widths[row], "dim": len(output["embedding"])}
            for row, output in enumerate(super().predict(batch))
        ]  # fmt: skip

    def encode_response(self, output: dict[str, Any]) -> dict[str, Any]:
        return output
