"""``zserve.models.causal_lm:CausalLM``: autoregressive LLMs on the generative engine core
(``zserve.stages.generate``): continuous batching over a paged KV cache, chunked prefill, per-request
sampling, stop ids and strings, incremental detokenisation.

Served, it runs in a generative engine process (``zserve.stages.generate.runner``): the broker admits
sequences one by one and every engine step serves all of them. In-process (``zserve.pipeline``),
``generate`` drives the same core directly.

Options: ``path`` (a local folder, a hub name, or ``package:NAME`` for an installed package's folder),
``gguf_file`` (converted once into a cache, see ``zserve.gguf_cache``), ``dtype`` ("float32", "bfloat16",
"float16"), and the engine knobs: ``kv_cache_bytes`` (the KV pool; 0 = 1 GiB on a CPU, 90% of the free
memory on a GPU), or ``num_blocks`` to size it in blocks, ``block_size``, ``max_batched_tokens`` (token
budget per step), ``max_running`` (sequences per step; also the broker's limit per engine),
``chunked_prefill``, ``max_new_tokens`` (the default per request).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from zserve.errors import BadRequest
from zserve.generation import GenerateRequest, GenerateResponse, parse_generate_request
from zserve.model import Model

_CPU_KV_CACHE_BYTES = 1 << 30
_GPU_MEMORY_FRACTION = 0.9


@dataclass(slots=True)
class PreparedPrompt:
    """A request ready for the engine core: token ids, sampling parameters, stop strings."""

    prompt_ids: list[int]
    params: Any  # zserve.stages.generate.sequence.SamplingParams (torch is imported lazily)
    stop: list[str]


class CausalLM(Model):
    generative = True  # served by the generative engine: sequences, not batches

    def __init__(
        self,
        path: str = "",
        gguf_file: str = "",
        dtype: str = "float32",
        kv_cache_bytes: int = 0,
        num_blocks: int = 0,
        block_size: int = 16,
        max_batched_tokens: int = 256,
        max_running: int = 64,
        chunked_prefill: bool = True,
        max_new_tokens: int = 64,
    ) -> None:
        super().__init__(
            path=path, gguf_file=gguf_file, dtype=dtype, kv_cache_bytes=kv_cache_bytes, num_blocks=num_blocks,
            block_size=block_size, max_batched_tokens=max_batched_tokens, max_running=max_running,
            chunked_prefill=chunked_prefill, max_new_tokens=max_new_tokens,
        )  # fmt: skip
        if not path:
            raise ValueError("CausalLM needs the `path` option (a local folder, a hub name or package:NAME)")
        if dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype {dtype!r} must be one of float32, bfloat16, float16")
        self.path = path
        self.gguf_file = gguf_file
        self.dtype = dtype
        self.max_new_tokens = int(max_new_tokens)
        self.max_running = int(max_running)

    # ---- engine side ----

    def setup(self, device: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from zserve.gguf_cache import converted_path, resolve_model_path
        from zserve.stages.generate.engine_core import EngineCore

        path = resolve_model_path(self.path)
        if self.gguf_file:  # transformers' GGUF loader takes ~45 s: convert once, then load the cache
            path = str(converted_path(path, self.gguf_file, self.dtype))
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, self.dtype)).to(device)
        o = self.options
        block_size = int(o["block_size"])
        num_blocks = int(o["num_blocks"]) or self._pool_blocks(model, device, block_size)
        self.core = EngineCore(
            model, num_blocks=num_blocks, block_size=block_size, max_batched_tokens=o["max_batched_tokens"],
            max_running=self.max_running, chunked_prefill=o["chunked_prefill"],
        )  # fmt: skip
        self.max_context = int(getattr(model.config, "max_position_embeddings", 0) or 1 << 30)

    def _pool_blocks(self, model: Any, device: str, block_size: int) -> int:
        import torch

        c = model.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        per_block = 2 * c.num_hidden_layers * kv_heads * head_dim * model.dtype.itemsize * block_size
        budget = int(self.options["kv_cache_bytes"])
        if not budget:
            if device.startswith("cuda"):
                free, _ = torch.cuda.mem_get_info(torch.device(device))
                budget = int(free * _GPU_MEMORY_FRACTION)
            else:
                budget = _CPU_KV_CACHE_BYTES
        return max(1, budget // per_block)

    def warmup(self) -> None:
        self.generate(["warm up"], max_new_tokens=2, ignore_eos=True)

    def prepare(self, request: GenerateRequest) -> PreparedPrompt:
        """Tokenise (applying the chat template to ``messages``) and check the lengths."""
        from zserve.stages.generate.sequence import SamplingParams

        if request.messages is not None:
            text = self.tokenizer.apply_chat_template(
                [msgspec.to_builtins(m) for m in request.messages], tokenize=False, add_generation_prompt=True
            )
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        else:
            ids = self.tokenizer(request.prompt)["input_ids"]
        if not ids:
            raise BadRequest("the prompt is empty after tokenisation", field="prompt")
        room = self.max_context - len(ids)
        if room < 1:
            raise BadRequest(
                f"the prompt has {len(ids)} tokens; this model's context is {self.max_context}", field="prompt"
            )
        # no max_new_tokens: up to max_length if given (MII), else the model's default
        max_new = request.max_new_tokens or (room if request.max_length else min(self.max_new_tokens, room))
        if request.max_new_tokens and request.max_new_tokens > room:
            raise BadRequest(
                f"prompt ({len(ids)} tokens) + max_new_tokens ({request.max_new_tokens}) is over this model's "
                f"context of {self.max_context} tokens",
                field="max_new_tokens",
            )
        if request.max_length is not None:
            if request.max_length <= len(ids):
                raise BadRequest(f"max_length {request.max_length} leaves no room after {len(ids)} prompt tokens",
                                 field="max_length")  # fmt: skip
            max_new = min(max_new, request.max_length - len(ids))
        if not self.core.fits(len(ids) + max_new):
            raise BadRequest(
                f"prompt + max_new_tokens ({len(ids) + max_new} tokens) is more than the KV cache holds", field="prompt"
            )
        params = SamplingParams(
            max_new_tokens=max_new, temperature=request.temperature, top_k=request.top_k, top_p=request.top_p,
            seed=request.seed, stop_token_ids=tuple(request.stop_token_ids), ignore_eos=request.ignore_eos,
            min_new_tokens=request.min_new_tokens,
        )  # fmt: skip
        return PreparedPrompt(ids, params, list(request.stop))

    # ---- request hooks (frontends, and the engine for direct clients) ----

    def decode_request(self, body: Any) -> dict[str, Any]:
        return msgspec.to_builtins(parse_generate_request(body))

    def encode_response(self, output: GenerateResponse | dict[str, Any]) -> dict[str, Any]:
        return output if isinstance(output, dict) else msgspec.to_builtins(output)

    # ---- in process (zserve.pipeline) ----

    def generate(
        self,
        prompts: str | Sequence[str],
        *,
        on_delta: Callable[[int, str], None] | None = None,
        **sampling: Any,
    ) -> list[GenerateResponse]:
        """One response per prompt, generated together in this process. ``sampling``: the fields of
        ``GenerateRequest`` (``max_new_tokens``, ``temperature``, ``top_k``, ``top_p``, ``seed``, ``stop``,
        ``stop_token_ids``, ``ignore_eos``, ``min_new_tokens``, ``max_length``); ``on_delta(index, text)``
        streams text as it is produced."""
        from zserve.stages.generate.detokenize import TextStream

        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        prepared = [self.prepare(parse_generate_request({"prompt": p, **sampling})) for p in prompts]
        index: dict[int, int] = {}
        streams: list[TextStream] = []
        lengths = [0] * len(prompts)
        for i, p in enumerate(prepared):
            streams.append(TextStream(self.tokenizer, p.stop, prompt_ids=p.prompt_ids))
            index[self.core.add(p.prompt_ids, p.params)] = i
        reasons: dict[int, str] = {}
        while len(reasons) < len(prompts):
            for out in self.core.step():
                i = index[out.seq_id]
                if i in reasons:
                    continue
                lengths[i] += 1
                delta, reason = streams[i].advance(out.token_id, out.finish_reason)
                if streams[i].stopped:
                    self.core.abort(out.seq_id)
                if reason:
                    reasons[i] = reason
                if delta and on_delta is not None:
                    on_delta(i, delta)
        return [
            GenerateResponse(s.text, n, len(p.prompt_ids), reasons[i])
            for i, (s, n, p) in enumerate(zip(streams, lengths, prepared, strict=True))
        ]
