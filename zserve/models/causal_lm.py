"""``zserve.models.causal_lm:CausalLM``: autoregressive LLMs on the generative engine core
(``zserve.stages.generate``): continuous batching over a paged KV cache, chunked prefill, per-request
sampling, stop ids and strings, incremental detokenisation.

Options: ``path`` (a local folder or hub name for ``from_pretrained``), ``gguf_file``, ``dtype``
("float32", "bfloat16", "float16"), and the engine knobs ``num_blocks``, ``block_size``,
``max_batched_tokens``, ``max_running``, ``chunked_prefill``, ``max_new_tokens`` (default per request).

In progress (generative-engine issue): ``generate`` runs the engine in this process (``zserve.pipeline``);
served through the broker, ``predict`` runs each broker batch to completion, so sequences from different
batches do not yet share steps. The dedicated engine shell (sequences admitted one by one, per-step
streaming) is not built.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from zserve.client import GenerateResponse
from zserve.errors import BadRequest
from zserve.model import Model


class CausalLM(Model):
    def __init__(
        self,
        path: str = "",
        gguf_file: str = "",
        dtype: str = "float32",
        num_blocks: int = 1024,
        block_size: int = 16,
        max_batched_tokens: int = 256,
        max_running: int = 64,
        chunked_prefill: bool = True,
        max_new_tokens: int = 64,
    ) -> None:
        super().__init__(
            path=path, gguf_file=gguf_file, dtype=dtype, num_blocks=num_blocks, block_size=block_size,
            max_batched_tokens=max_batched_tokens, max_running=max_running, chunked_prefill=chunked_prefill,
            max_new_tokens=max_new_tokens,
        )  # fmt: skip
        if not path:
            raise ValueError("CausalLM needs the `path` option (a local folder or hub name)")
        self.path = path
        self.gguf_file = gguf_file
        self.dtype = dtype
        self.max_new_tokens = int(max_new_tokens)

    def setup(self, device: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from zserve.stages.generate.engine_core import EngineCore

        extra = {"gguf_file": self.gguf_file} if self.gguf_file else {}
        self.tokenizer = AutoTokenizer.from_pretrained(self.path, **extra)
        model = AutoModelForCausalLM.from_pretrained(self.path, dtype=getattr(torch, self.dtype), **extra)
        o = self.options
        self.core = EngineCore(
            model.to(device), num_blocks=o["num_blocks"], block_size=o["block_size"],
            max_batched_tokens=o["max_batched_tokens"], max_running=o["max_running"],
            chunked_prefill=o["chunked_prefill"],
        )  # fmt: skip

    def decode_request(self, body: Any) -> dict[str, Any]:
        if isinstance(body, str):
            body = {"prompt": body}
        if not isinstance(body, dict) or not isinstance(body.get("prompt"), str):
            raise BadRequest('body must be {"prompt": "...", ...sampling options}', field="prompt")
        return body

    def predict(self, batch: list[dict[str, Any]]) -> list[Any]:
        """One broker batch, run to completion. Requests with the same options share one engine run."""
        groups: dict[bytes, list[int]] = {}
        for i, item in enumerate(batch):
            options = {k: v for k, v in item.items() if k != "prompt"}
            groups.setdefault(msgspec.json.encode(options, order="sorted"), []).append(i)
        outputs: list[Any] = [None] * len(batch)
        for key, members in groups.items():
            try:
                responses = self.generate([batch[i]["prompt"] for i in members], **msgspec.json.decode(key))
            except TypeError as exc:  # an unknown option
                responses = [BadRequest(str(exc))] * len(members)
            for i, response in zip(members, responses, strict=True):
                outputs[i] = response
        return outputs

    def encode_response(self, output: GenerateResponse) -> dict[str, Any]:
        return msgspec.to_builtins(output)

    def generate(
        self,
        prompts: str | Sequence[str],
        *,
        max_new_tokens: int | None = None,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: Sequence[str] = (),
        stop_token_ids: Sequence[int] = (),
        ignore_eos: bool = False,
        on_delta: Callable[[int, str], None] | None = None,
    ) -> list[GenerateResponse]:
        """One Response per prompt; ``on_delta(index, text)`` streams text as it is produced."""
        from zserve.stages.generate.detokenize import TextStream
        from zserve.stages.generate.sequence import SamplingParams

        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        try:
            params = SamplingParams(
                max_new_tokens=int(max_new_tokens or self.max_new_tokens), temperature=float(temperature),
                top_k=int(top_k), top_p=float(top_p), seed=seed, stop_token_ids=tuple(stop_token_ids),
                ignore_eos=bool(ignore_eos),
            )  # fmt: skip
        except (TypeError, ValueError) as exc:
            raise BadRequest(f"bad sampling option: {exc}") from None
        index: dict[int, int] = {}
        streams: list[TextStream] = []
        lengths = [0] * len(prompts)
        prompt_lengths = []
        for i, prompt in enumerate(prompts):
            ids = self.tokenizer(prompt)["input_ids"]
            prompt_lengths.append(len(ids))
            streams.append(TextStream(self.tokenizer, list(stop), prompt_ids=ids))
            index[self.core.add(ids, params)] = i
        reasons: dict[int, str] = {}
        while len(reasons) < len(prompts):
            for out in self.core.step():
                i = index[out.seq_id]
                if i in reasons:
                    continue
                lengths[i] += 1
                delta = streams[i].push(out.token_id)
                if streams[i].stopped:
                    self.core.abort(out.seq_id)
                    reasons[i] = "stop"
                elif out.finish_reason:
                    delta += streams[i].flush()
                    reasons[i] = out.finish_reason
                if delta and on_delta is not None:
                    on_delta(i, delta)
        return [
            GenerateResponse(s.text, n, p, reasons[i])
            for i, (s, n, p) in enumerate(zip(streams, lengths, prompt_lengths, strict=True))
        ]
