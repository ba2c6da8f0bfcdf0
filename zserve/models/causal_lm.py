"""``zserve.models.causal_lm:CausalLM``: autoregressive LLMs on the generative engine
(``zserve.generator.generator``): continuous batching over a paged KV cache, chunked prefill, prefix
caching, per-request sampling, stop ids and strings, incremental detokenisation.

This handler keeps the options and the request hooks; ``setup`` builds the ``Generator`` (model,
tokenizer, KV pool, core), which the engine process's runner drives when served and ``generate`` drives in
process (``zserve.pipeline``).

Options: the fields of ``zserve.generator.options.GeneratorOptions``, one definition with their types, ranges,
defaults and meaning (docs/generation.md's "Engine options" table is generated from it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from zserve.generation import GenerateRequest, GenerateResponse, parse_generate_request
from zserve.model import Model


class CausalLM(Model):
    generative = True  # served by the generative engine: sequences, not batches (see zserve/generator/generator.py)

    def __init__(self, **options: Any) -> None:
        from zserve.generator.options import GeneratorOptions

        self.engine_options = GeneratorOptions.of(options)  # a ValueError naming the option
        super().__init__(**msgspec.structs.asdict(self.engine_options))  # every option, the defaults filled in
        if not self.engine_options.path:
            raise ValueError("CausalLM needs the `path` option (a local folder, a hub name or package:NAME)")
        self.path = self.engine_options.path
        self.gguf_file = self.engine_options.gguf_file
        self.dtype = self.engine_options.dtype
        self.generator: Any = None  # a Generator after setup (torch is imported lazily)

    # ---- engine side ----

    def setup(self, device: str) -> None:
        from zserve.generator.generator import Generator

        self.generator = Generator.load(
            self.path, device=device, dtype=self.dtype, gguf_file=self.gguf_file, options=self.engine_options
        )

    def warmup(self) -> None:
        self.generator.warmup()

    # ---- request hooks (frontends, and the engine for direct clients) ----

    def decode_request(self, body: Any) -> GenerateRequest:
        """The body as a ``GenerateRequest``, which travels to the engine as it is (msgpack-encoded, decoded there
        with ``type=GenerateRequest``)."""
        return parse_generate_request(body)

    def encode_response(self, output: GenerateResponse | dict[str, Any]) -> dict[str, Any]:
        return output if isinstance(output, dict) else msgspec.to_builtins(output)

    def chat_template(self) -> str | None:
        """The chat template's text as the model's files hold it (tokenizer_config.json, chat_template.jinja),
        read without loading the tokenizer and without the network (a hub model only from the local cache);
        None when not found. The frontend picks the tool-call parser by it."""
        import json
        from pathlib import Path

        from zserve.gguf_cache import resolve_model_path

        try:
            path = resolve_model_path(self.path)
        except (OSError, ValueError):
            return None
        texts = []
        for name in ("chat_template.jinja", "tokenizer_config.json"):
            file: Any = Path(path) / name
            if not file.is_file():
                try:
                    from huggingface_hub import try_to_load_from_cache

                    file = try_to_load_from_cache(path, name)
                except Exception:  # not a hub name
                    file = None
                if not isinstance(file, str):
                    continue
            text = Path(file).read_text(errors="replace")
            if name.endswith(".json"):
                template = json.loads(text).get("chat_template")
                text = template if isinstance(template, str) else json.dumps(template) if template else ""
            texts.append(text or "")
        return "\n".join(texts) or None

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
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        requests = [parse_generate_request({"prompt": p, **sampling}) for p in prompts]
        return self.generator.generate(requests, on_delta)
